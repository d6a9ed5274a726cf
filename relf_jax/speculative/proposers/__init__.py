"""Speculative proposers, one module each: `draft_model` (a small AR model), `prompt_lookup` (copy
from the context) and `ngram_table` (a corpus n-gram table). Each `propose` returns the round's K
draft tokens [B, K] and the logits [B, K, V] they were drawn from."""
