"""SyntheticChat: a procedurally generated chat language with exact likelihoods.

This module is the project's built-in training corpus *and* the exact judge for
generative perplexity (it replaces GPT-2 Large on CPU-scale experiments). Text is
produced by a probabilistic finite automaton (a hidden Markov model whose hidden
state emits one word per step), so the exact probability of any text is available
by the forward algorithm. Everything here is numpy; no JAX is needed.

Text format
-----------
One conversation per document, 1 to 3 exchanges::

    <user> w w w ... <assistant> w w w ... [<user> ... <assistant> ...]

``<user>`` and ``<assistant>`` are ordinary words of the grammar. Words are
separated by single spaces (``text == " ".join(words)``); when scoring, a text is
split on any whitespace. Words are case-sensitive (the grammar is lower case).
A word that is not in the vocabulary is scored as the special word ``<unk>``
(every content state emits ``<unk>`` with probability ``unk_prob``, so the
grammar still normalises; the marker states emit only their marker).

Generative story
----------------
1. A latent topic ``k`` (weather, food, travel, music, sports, code, health,
   movies) is drawn once and persists through the whole conversation.
2. Each exchange draws a latent verbosity class ``v`` (default 4 classes: short,
   medium, long, very long). The user turn signals it: it contains exactly one
   *cue* word, which is a word of class ``v`` ("briefly", "quick" ... /
   "describe", "overview" ... / "explain", "detail" ... / "everything",
   "comprehensive" ...) with probability ``cue_reliability`` and a neutral
   filler word ("please", "thanks", ...) otherwise.
3. User turn: ``<user>``, optional opener words ("hey", "how", "can", ...),
   a geometric number of content words, the cue word, optional tail words.
4. Assistant turn: ``<assistant>``, an optional formulaic opening phrase
   ("thank you for asking", "great question"), a geometric number of content
   words whose mean depends on ``v`` (default body means 2 / 9 / 45 / 190
   words, which with the phrases gives reply means of about 3 / 12 / 50 / 200:
   a heavy-tailed mixture of geometrics, uncapped), formulaic mid phrases
   ("on the other hand", "for example") inserted between content words, and
   an optional closing phrase ("i hope this helps", "let me know if you need
   anything else").
5. Noise: at every step of a turn the automaton may derail (probability
   ``noise_prob``) into that turn's NOISE state, which emits any non-marker
   vocabulary word uniformly, then stays, rejoins the content syntax, or ends
   the turn. So a misplaced known word costs about ``log(noise_prob / W)``
   (~ -15 nats) instead of making the text impossible: every text whose marker
   skeleton is valid (starts with ``<user>``, markers alternate, no empty turn,
   at most 3 exchanges) has a finite log-probability. Texts with a broken
   skeleton get ``-inf``.
6. After each assistant turn the conversation continues with another exchange
   with probability ``more_exchange_prob[e - 1]`` (``e`` = exchanges so far) and
   ends otherwise; after ``len(more_exchange_prob) + 1`` exchanges it always
   ends. Every loop has probability < 1, so the grammar is a proper
   distribution over finite word sequences; the empty conversation has
   probability 0.

Content words follow a small syntax (sub-states DET, ADJ, NOUN, VERB, ADV, CONN
with a fixed Markov chain between them), so word order matters. NOUN / VERB /
ADJ states emit the topic's words (uncertain, Zipf-weighted, broad), generic
words, and with probability ``leak_prob`` other topics' words. Phrase states
are deterministic chains (each emits its word with probability
``1 - unk_prob``, and continues the chain with probability
``1 - noise_prob``). Zipf weights are permuted by ``GrammarConfig.seed``, so the
seed changes the language.

State space
-----------
A hidden state is ``(k, e, v, r)``: topic ``k`` in ``[0, K)``, exchange index
``e`` in ``[1, E]``, verbosity ``v`` in ``[0, V)``, and a local automaton state
``r`` in ``[0, R)`` (``R`` = 19 structural states + one state per word of each
formulaic phrase: 110 with the default config, so 8 * 3 * 4 * 110 = 10,560
states; see ``state_names``). The local
transition matrix ``T[v]`` does not depend on ``k``; emissions ``E[k, v, r, w]``
do. ``explicit_hmm()`` returns this full, unfactored automaton for small
grammars (tests). The forward algorithm never materialises ``k x e x v x r``:
topics are independent blocks, ``e`` is a deterministic function of the observed
text (only the ``<user>`` state emits ``<user>``), and after a word ``w`` is
observed only the (v, r) states that can emit ``w`` are alive (at most 32 of
440 for a known word), so each step is a batched ``[M_t, M_{t-1}] @ [M_{t-1}, K]``
product over texts; runs of ``<unk>`` are folded into powers of the
transition matrix.

Scores
------
``log_prob(texts)`` is the exact natural-log probability of each whole
conversation including the end-of-conversation event; ``log_prob(texts,
prefix=True)`` is the probability that a conversation *starts* with these words
(for truncated samples). ``num_words`` counts the scored events (words, plus 1
for the end event when ``prefix=False``), so gen PPL is
``exp(-log_prob / num_words)``.

Layout: ``lexicon`` (the word lists), ``grammar`` (``GrammarConfig`` and the automaton's
tables), ``likelihood`` (the forward algorithm), ``sampler`` (vectorised sampling) and
``language`` (``SyntheticChat``, which puts them together).
"""

from relf_jax.data.synthetic_chat.grammar import GrammarConfig
from relf_jax.data.synthetic_chat.language import SyntheticChat
from relf_jax.data.synthetic_chat.lexicon import ASSISTANT, TOPIC_NAMES, UNK, USER

__all__ = [
    "ASSISTANT",
    "TOPIC_NAMES",
    "UNK",
    "USER",
    "GrammarConfig",
    "SyntheticChat",
]
