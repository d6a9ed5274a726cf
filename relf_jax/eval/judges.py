"""Judges for generative perplexity.

- `ExactJudge`: the synthetic chat grammar's exact likelihood (forward algorithm), the
  project's stand-in for GPT-2 Large. Tokens are the grammar's words.
- `ModelJudge`: any relf_jax AR model with its own tokenizer; texts are re-tokenized with it.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from relf_jax.sampling.autoregressive import prompt_bucket


class ExactJudge:
    """Exact log-likelihood under a `relf_jax.data.synthetic_chat.SyntheticChat` grammar.

    A complete text (the sample ended with EOS) is scored with the end-of-conversation event;
    a cut-off text as a prefix. Scored tokens: the text's words (+1 for the end event).
    """

    name = "exact"

    def __init__(self, grammar):
        self.grammar = grammar

    def tokenize(self, text: str) -> list[str]:
        return text.split()

    def score(self, texts: Sequence[str], complete: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
        texts = list(texts)
        complete = np.asarray(complete, bool)
        logp = np.zeros(len(texts))
        n = np.zeros(len(texts))
        for flag in (True, False):
            idx = np.flatnonzero(complete == flag)
            if idx.size == 0:
                continue
            sub = [texts[i] for i in idx]
            logp[idx] = self.grammar.log_prob(sub, prefix=not flag)
            n[idx] = self.grammar.num_words(sub, prefix=not flag)
        return logp, n


class ModelJudge:
    """Log-likelihood of re-tokenized text under a relf_jax causal LM."""

    name = "model"

    def __init__(self, graphdef, params, tokenizer, max_len: int, batch_size: int = 16):
        self.graphdef, self.params, self.tokenizer = graphdef, params, tokenizer
        self.max_len, self.batch_size = max_len, batch_size

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def score(self, texts: Sequence[str], complete: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
        tok = self.tokenizer
        seqs = []
        for text, done in zip(texts, complete):
            ids = [tok.bos_id] + tok.encode(text) + ([tok.eos_id] if done else [])
            seqs.append(ids[: self.max_len])
        logp = np.zeros(len(seqs))
        n = np.asarray([len(s) - 1 for s in seqs], np.float64)
        for start in range(0, len(seqs), self.batch_size):
            chunk = seqs[start:start + self.batch_size]
            width = min(prompt_bucket(max(len(s) for s in chunk)), self.max_len)
            arr = np.zeros((self.batch_size, width), np.int32)
            mask = np.zeros((self.batch_size, width), np.float32)
            for i, s in enumerate(chunk):
                arr[i, :len(s)] = s
                mask[i, 1:len(s)] = 1.0
            out = np.asarray(_sequence_logprob(self.graphdef, self.params, jnp.asarray(arr), jnp.asarray(mask)))
            logp[start:start + len(chunk)] = out[:len(chunk)]
        return logp, n


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _sequence_logprob(graphdef, params, tokens, mask):
    logits, _ = nnx.merge(graphdef, params)(tokens)
    lp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    tok_lp = jnp.take_along_axis(lp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(tok_lp * mask[:, 1:], axis=-1)
