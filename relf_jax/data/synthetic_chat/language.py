"""`SyntheticChat`: the chat grammar with its sampler and its exact scorer (the public class)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from relf_jax.data.synthetic_chat.grammar import Grammar, GrammarConfig
from relf_jax.data.synthetic_chat.lexicon import ASSISTANT, USER
from relf_jax.data.synthetic_chat.likelihood import ForwardScorer
from relf_jax.data.synthetic_chat.sampler import Sampler


class SyntheticChat(Grammar):
    """The chat grammar: sampling and exact scoring. The tables and their attributes (``vocab``,
    ``topics``, ``topic_words``, ``verbosity_cues``, ``state_names``, ...) are `Grammar`'s."""

    def __init__(self, config: GrammarConfig = GrammarConfig()):
        super().__init__(config)
        self._scorer = ForwardScorer(self)
        self._sampler = Sampler(self)

    # ------------------------------------------------------------------ sizes
    @property
    def num_states(self) -> int:
        """Size of the formal hidden state space K * E * V * R."""
        return self.K * self.max_exchanges * self.V * self.R

    def __repr__(self):
        return (f"SyntheticChat(topics={self.K}, verbosity={self.V}, local_states={self.R}, "
                f"states={self.num_states}, vocab={self.W})")

    # -------------------------------------------------------------- tokenise
    def encode(self, text: str) -> np.ndarray:
        """Word ids [T] (int32) of a text; unknown words map to ``<unk>`` (id 0)."""
        get = self.word_to_id.get
        return np.fromiter((get(w, 0) for w in text.split()), dtype=np.int32)

    def num_words(self, texts: Sequence[str], prefix: bool = False) -> np.ndarray:
        """Number of scored events per text, int64 [n]: the words, plus 1 for the
        end-of-conversation event when ``prefix=False`` (matching ``log_prob``).
        Gen PPL = ``exp(-log_prob(texts, prefix) / num_words(texts, prefix))``."""
        return np.array([len(t.split()) + (0 if prefix else 1) for t in texts], np.int64)

    # ---------------------------------------------------------------- scoring
    def log_prob(self, texts: Sequence[str], prefix: bool = False) -> np.ndarray:
        """Exact log-probabilities (natural log), float64 [n].

        ``prefix=False``: ``log p(conversation == text)``, including the end event.
        ``prefix=True``: ``log P(a conversation starts with the words of text)``
        (no end term; the empty prefix has log-probability 0).
        Impossible texts (e.g. not starting with ``<user>``, empty) give ``-inf``.
        Computed with the scaled forward algorithm, batched over texts.
        """
        seqs = [self.encode(t) for t in texts]
        full, pre, _ = self._scorer.forward(seqs)
        return pre if prefix else full

    def conditional_log_prob(self, prompts: Sequence[str], continuations: Sequence[str],
                             prefix: bool = False) -> np.ndarray:
        """``log p(continuation | prompt)`` float64 [n]
        ``= log p(prompt + continuation) - log p_prefix(prompt)``, where the
        joint is a complete conversation (``prefix=False``) or a prefix
        (``prefix=True``). Words are joined with a space. NaN where the prompt
        itself has probability 0."""
        if len(prompts) != len(continuations):
            raise ValueError("prompts and continuations must have the same length")
        seqs, marks = [], []
        for p, cont in zip(prompts, continuations):
            a, b = self.encode(p), self.encode(cont)
            seqs.append(np.concatenate([a, b]))
            marks.append(len(a))
        full, pre, at_mark = self._scorer.forward(seqs, np.asarray(marks, np.int64))
        joint = pre if prefix else full
        with np.errstate(invalid="ignore"):
            out = joint - at_mark
        out[np.isneginf(at_mark)] = np.nan
        return out

    # --------------------------------------------------------------- sampling
    def sample(self, n: int, seed: int, topics: Sequence[int] | None = None) -> list[str]:
        """``n`` conversation texts, deterministic given ``(n, seed, topics)``.
        ``topics`` (indices into ``self.topics``) restricts the latent topic,
        drawn from the renormalised prior over the subset."""
        seqs, _, _ = self._sampler.sample_ids(n, seed, topics)
        vocab = self.vocab
        return [" ".join([vocab[i] for i in s.tolist()]) for s in seqs]

    def sample_with_info(self, n: int, seed: int, topics: Sequence[int] | None = None) -> list[dict]:
        """Like ``sample`` (same texts for the same arguments), with latents.

        Each dict: ``text``; ``topic`` (int) and ``topic_name``; ``verbosity``
        (class of the first exchange) and ``verbosities`` (one per exchange);
        ``num_exchanges``; ``prompt`` (text up to and including the first
        ``<assistant>``); ``reply`` (rest of the first assistant turn, at least
        one word); ``reply_len`` (words in ``reply``).
        """
        seqs, topic, verb = self._sampler.sample_ids(n, seed, topics)
        vocab = self.vocab
        out = []
        for s, k, vb in zip(seqs, topic, verb):
            words = [vocab[i] for i in s.tolist()]
            a = words.index(ASSISTANT)
            try:
                b = words.index(USER, a)
            except ValueError:
                b = len(words)
            vbs = [int(x) for x in vb if x >= 0]
            out.append({
                "text": " ".join(words), "topic": int(k), "topic_name": self.topics[int(k)],
                "verbosity": vbs[0], "verbosities": vbs, "num_exchanges": len(vbs),
                "prompt": " ".join(words[: a + 1]), "reply": " ".join(words[a + 1 : b]),
                "reply_len": b - a - 1,
            })
        return out
