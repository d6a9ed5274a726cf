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

    The grammar gives probability 0 to texts whose turn markers are out of place (a reply
    that does not start with ``<user>``, an empty turn), which would make one bad sample's
    gen PPL infinite. So the judge is the mixture ``(1 - w) * grammar + w * background``, with
    `background` a uniform distribution over the grammar's words and a geometric length
    (mean `background_mean_len`), and ``w = background_weight`` (default 1e-3; 0 gives the bare
    grammar). A valid text loses at most -log(1 - w) ~ 1e-3 nats; an impossible text costs
    about log(|vocab|) nats per word plus log(1/w). Both parts are exact, so the judge is too.
    """

    name = "exact"

    def __init__(self, grammar, background_weight: float = 1e-3, background_mean_len: float = 64.0):
        if not 0 <= background_weight < 1:
            raise ValueError("background_weight must be in [0, 1)")
        self.grammar = grammar
        self.background_weight = background_weight
        self._stop = 1.0 / (background_mean_len + 1.0)
        self._word_logp = np.log((1.0 - self._stop) / len(grammar.vocab))

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
        w = self.background_weight
        if w > 0:
            words = np.asarray([len(t.split()) for t in texts], np.float64)
            background = words * self._word_logp + np.where(complete, np.log(self._stop), 0.0)
            with np.errstate(divide="ignore"):
                logp = np.logaddexp(np.log1p(-w) + logp, np.log(w) + background)
        return logp, n

    def score_replies(self, prompts: Sequence[str], replies: Sequence[str],
                      complete: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
        """log p(reply | prompt) under the judge: joint minus prompt-prefix log-likelihood.

        Scored tokens: the reply's words (+1 for the end event when complete).
        """
        joint = [f"{p} {r}".strip() for p, r in zip(prompts, replies)]
        lp_joint, _ = self.score(joint, complete)
        lp_prompt, _ = self.score(list(prompts), [False] * len(prompts))
        n = np.asarray([len(r.split()) + int(c) for r, c in zip(replies, complete)], np.float64)
        return lp_joint - lp_prompt, n


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
