"""The SyntheticChat automaton: its knobs (`GrammarConfig`) and its tables (`Grammar`).

`Grammar(config)` builds the vocabulary, the local states ``r`` of a turn, the emissions
``E[k, v, r, w]``, the local transitions ``T[v, r, r']`` and end-of-turn probabilities
``eot[v, r]`` (see the package docstring for the generative story). Everything is numpy.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from relf_jax.data.synthetic_chat.lexicon import (
    ADV,
    ASSISTANT,
    CLOSE_PHRASES,
    CONN,
    CUES,
    DET,
    GEN_ADJ,
    GEN_NOUN,
    GEN_VERB,
    MID_PHRASES,
    OPEN_PHRASES,
    OPENER,
    SYN,
    SYN_ENTRY,
    TAIL,
    TOPIC_NAMES,
    TOPIC_SHARE,
    TOPICS,
    UNK,
    USER,
)
from relf_jax.data.synthetic_chat.transitions import add_noise, transitions

PHRASE_GROUPS = ("open", "mid", "close")


@dataclasses.dataclass(frozen=True)
class GrammarConfig:
    """Knobs of the chat grammar. The default is the project's corpus.

    Per-verbosity tuples (``verbosity_prior``, ``reply_body_means``,
    ``open_prob``, ``mid_prob``, ``close_prob``) must have equal length
    ``V <= 4``; class ``i`` uses the i-th cue list (short .. very long).
    Means are means of geometric distributions on ``{1, 2, ...}``.
    ``GrammarConfig.tiny()`` is a small, short-conversation grammar for
    enumeration tests.
    """

    num_topics: int = 8
    seed: int = 0
    verbosity_prior: tuple[float, ...] = (0.3, 0.35, 0.25, 0.1)
    reply_body_means: tuple[float, ...] = (2.0, 9.0, 45.0, 190.0)
    open_prob: tuple[float, ...] = (0.1, 0.5, 0.6, 0.7)
    mid_prob: tuple[float, ...] = (0.0, 0.02, 0.03, 0.03)  # per body word
    close_prob: tuple[float, ...] = (0.1, 0.5, 0.7, 0.8)
    user_open_prob: float = 0.7
    user_open_mean: float = 1.6
    user_body_mean: float = 5.0
    user_tail_prob: float = 0.35
    user_tail_mean: float = 1.3
    cue_reliability: float = 0.9
    # P(another exchange | e exchanges done), e = 1, 2, ...; max exchanges = len + 1.
    more_exchange_prob: tuple[float, ...] = (0.35, 0.3)
    unk_prob: float = 1e-4
    noise_prob: float = 1e-4  # per state: derail into a turn's NOISE state
    leak_prob: float = 0.05
    zipf_exponent: float = 1.0
    words_per_class: int | None = None  # truncate every word list (tiny grammars)
    phrases_per_group: int | None = None  # truncate the phrase lists
    syntax: bool = True  # False: content = a single NOUN state

    @classmethod
    def tiny(cls, seed: int = 0) -> GrammarConfig:
        """A ~15-word grammar with short conversations (mass > 99% within a few
        thousand strings); exercises every mechanism (topics, verbosity,
        phrases, unk, noise, a second exchange)."""
        return cls(
            num_topics=2,
            seed=seed,
            verbosity_prior=(0.5, 0.5),
            reply_body_means=(1.05, 1.25),
            open_prob=(0.02, 0.05),
            mid_prob=(0.02, 0.02),
            close_prob=(0.02, 0.05),
            user_open_prob=0.05,
            user_open_mean=1.0,
            user_body_mean=1.05,
            user_tail_prob=0.02,
            user_tail_mean=1.0,
            cue_reliability=0.9,
            more_exchange_prob=(0.01,),
            unk_prob=0.01,
            noise_prob=2e-4,
            leak_prob=0.0,
            words_per_class=1,
            phrases_per_group=1,
            syntax=False,
        )


@dataclasses.dataclass(frozen=True)
class _Words:
    """The (possibly truncated) word lists of one config."""

    topic_lists: list[tuple[list[str], list[str], list[str]]]  # per topic: (nouns, verbs, adjectives)
    syn: tuple[str, ...]
    generic: dict[str, list[str]]
    opener: list[str]
    tail: list[str]
    cues: list[list[str]]
    phrases: dict[str, list[list[str]]]

    @classmethod
    def from_config(cls, c: GrammarConfig, topics: list[str], V: int) -> _Words:
        def cut(words):
            return list(words) if c.words_per_class is None else list(words)[: c.words_per_class]

        def pcut(phr):
            return list(phr) if c.phrases_per_group is None else list(phr)[: c.phrases_per_group]

        return cls(
            topic_lists=[tuple(cut(x) for x in TOPICS[t]) for t in topics],
            syn=SYN if c.syntax else ("NOUN",),
            generic={"DET": cut(DET), "NOUN": cut(GEN_NOUN), "VERB": cut(GEN_VERB),
                     "ADJ": cut(GEN_ADJ), "ADV": cut(ADV), "CONN": cut(CONN)},
            opener=cut(OPENER), tail=cut(TAIL), cues=[cut(CUES[i]) for i in range(V)],
            phrases={"open": [p.split() for p in pcut(OPEN_PHRASES)],
                     "mid": [p.split() for p in pcut(MID_PHRASES)],
                     "close": [p.split() for p in pcut(CLOSE_PHRASES)]},
        )

    def vocabulary(self) -> list[str]:
        """The ordered union of every word; ``<unk>``, ``<user>``, ``<assistant>`` first."""
        vocab = [UNK, USER, ASSISTANT]
        seen = set(vocab)

        def add(words):
            for w in words:
                if w not in seen:
                    seen.add(w)
                    vocab.append(w)

        add(self.opener)
        for s in self.syn:
            add(self.generic[s])
        for tl in self.topic_lists:
            for i, s in enumerate(("NOUN", "VERB", "ADJ")):
                if s in self.syn:
                    add(tl[i])
        for cl in self.cues:
            add(cl)
        add(self.tail)
        for g in PHRASE_GROUPS:
            for p in self.phrases[g]:
                add(p)
        return vocab

    def topic_words(self, syntax: bool) -> list[set[str]]:
        """Per topic, its own words; raises if two topics or a topic and the generic lists share one."""
        topic_words = []
        for tl in self.topic_lists:
            words = set(tl[0]) | (set(tl[1]) | set(tl[2]) if syntax else set())
            topic_words.append(words)
        all_generic = set().union(*self.generic.values())
        for i, a in enumerate(topic_words):
            if a & all_generic:
                raise AssertionError(f"topic words overlap generic words: {a & all_generic}")
            for b in topic_words[i + 1:]:
                if a & b:
                    raise AssertionError(f"topic lists overlap: {a & b}")
        return topic_words

    def local_states(self) -> tuple[list[str], dict[str, list[list[int]]]]:
        """(names of the local states, per phrase group the state indices of each phrase)."""
        syn = self.syn
        names = ["U_START", "U_OPEN"] + [f"U_{s}" for s in syn] + ["U_CUE", "U_TAIL", "U_NOISE", "A_MARK"]
        names += [f"A_{s}" for s in syn] + ["A_NOISE"]
        phrase_states: dict[str, list[list[int]]] = {}
        for g in PHRASE_GROUPS:
            phrase_states[g] = []
            for p in self.phrases[g]:
                idx = []
                for j, w in enumerate(p):
                    idx.append(len(names))
                    names.append(f"{g.upper()}:{' '.join(p)}:{j}:{w}")
                phrase_states[g].append(idx)
        return names, phrase_states

    def syntax_entry(self) -> dict[str, float]:
        """P(first content sub-state), renormalised over the sub-states in use."""
        entry = {s: p for s, p in SYN_ENTRY.items() if s in self.syn}
        tot = sum(entry.values())
        return {s: p / tot for s, p in entry.items()}


def _validate(c: GrammarConfig) -> int:
    """The number of verbosity classes ``V``; raises on an inconsistent config."""
    V = len(c.verbosity_prior)
    if not 1 <= V <= len(CUES):
        raise ValueError(f"need 1..{len(CUES)} verbosity classes, got {V}")
    for name in ("reply_body_means", "open_prob", "mid_prob", "close_prob"):
        if len(getattr(c, name)) != V:
            raise ValueError(f"{name} must have {V} entries like verbosity_prior")
    if not 1 <= c.num_topics <= len(TOPIC_NAMES):
        raise ValueError(f"num_topics must be in 1..{len(TOPIC_NAMES)}")
    if not 0.0 < c.unk_prob < 1.0:
        raise ValueError("unk_prob must be in (0, 1)")
    if not 0.0 <= c.noise_prob < 1.0:
        raise ValueError("noise_prob must be in [0, 1)")
    return V


class Grammar:
    """The chat grammar's automaton (tables only; `SyntheticChat` adds sampling and scoring).

    Attributes:
      config: the ``GrammarConfig``.
      vocab: list of words; ``vocab[0] == "<unk>"``, then ``<user>``,
        ``<assistant>``.
      topics: topic names, ``len == config.num_topics``.
      topic_words: per topic, the set of its own words (nouns, verbs, adjectives).
      verbosity_cues: per verbosity class, its cue words.
      state_names: names of the ``R`` local automaton states.
      emission [K, V, R, W], trans [V, R, R], eot [V, R]: the automaton's tables.
      p_more [max_exchanges + 2]: P(another exchange | e exchanges done), 0 beyond the cap.
    """

    def __init__(self, config: GrammarConfig = GrammarConfig()):
        c = config
        self.config = c
        V = _validate(c)
        self.K, self.V = c.num_topics, V
        self.topics = list(TOPIC_NAMES[: c.num_topics])
        rng = np.random.default_rng(np.random.SeedSequence([c.seed, 0x5C4A7]))
        words = _Words.from_config(c, self.topics, V)
        self.vocab = words.vocabulary()
        self.word_to_id = {w: i for i, w in enumerate(self.vocab)}
        self.W = len(self.vocab)
        self.unk_id, self.user_id, self.assistant_id = 0, 1, 2
        self.topic_words = words.topic_words(c.syntax)
        self.verbosity_cues = [list(x) for x in words.cues]
        names, phrase_states = words.local_states()
        self.state_names = names
        self.R = len(names)
        sid = {n: i for i, n in enumerate(names)}
        self.start_state = sid["U_START"]
        self.emission = self._emissions(words, sid, phrase_states, rng)  # [K, V, R, W]
        entry = words.syntax_entry()
        trans, eot = transitions(c, V, words.syn, entry, sid, phrase_states)
        add_noise(c, names, sid, entry, trans, eot)
        assert np.allclose(trans.sum(-1) + eot, 1.0)
        assert np.all(trans[:, :, self.start_state] == 0.0)
        self.trans, self.eot = trans, eot  # [V, R, R], [V, R]
        self.topic_prior = np.full(self.K, 1.0 / self.K)
        self.verbosity_prior = np.asarray(c.verbosity_prior, np.float64)
        if not np.isclose(self.verbosity_prior.sum(), 1.0):
            raise ValueError("verbosity_prior must sum to 1")
        self.max_exchanges = len(c.more_exchange_prob) + 1
        # p_more[e] for e = exchanges completed (index 0 unused); 0 beyond the cap.
        self.p_more = np.zeros(self.max_exchanges + 2)
        self.p_more[1 : self.max_exchanges] = c.more_exchange_prob

    def _word_dist(self, rng):
        """``dist(words, p=None)``: a [W] distribution over `words` (Zipf weights permuted by
        `rng` when `p` is None)."""
        c, W = self.config, self.W

        def zipf(n):
            wts = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** c.zipf_exponent
            return rng.permutation(wts / wts.sum())

        def dist(words, p=None):
            d = np.zeros(W)
            if not words:
                return d
            p = zipf(len(words)) if p is None else p
            for w, q in zip(words, p):
                d[self.word_to_id[w]] += q
            return d

        return dist

    def _content(self, words: _Words, dist) -> np.ndarray:
        """Emissions of the content sub-states, [K, len(syn), W]: topic, generic and leaked words."""
        c, syn, topic_lists = self.config, words.syn, words.topic_lists
        gen_d = {s: dist(words.generic[s]) for s in syn}
        cat_index = {"NOUN": 0, "VERB": 1, "ADJ": 2}
        # one Zipf permutation per topic list, shared by user and assistant states
        topic_d = [{s: dist(tl[cat_index[s]]) for s in syn if s in cat_index} for tl in topic_lists]
        content = np.zeros((self.K, len(syn), self.W))
        for k in range(self.K):
            for j, s in enumerate(syn):
                if s not in cat_index:
                    content[k, j] = gen_d[s]
                    continue
                others = [w for o in range(self.K) if o != k for w in topic_lists[o][cat_index[s]]]
                leak = dist(others, np.full(len(others), 1.0 / max(1, len(others))))
                share = TOPIC_SHARE[s]
                content[k, j] = _mix([(share, topic_d[k][s]),
                                      (1.0 - share - c.leak_prob, gen_d[s]),
                                      (c.leak_prob, leak)])
        return content

    def _emissions(self, words: _Words, sid: dict[str, int], phrase_states, rng) -> np.ndarray:
        """E[k, v, r, w]; every state but the two markers emits ``<unk>`` with ``unk_prob``."""
        c, V, R = self.config, self.V, self.R
        dist = self._word_dist(rng)
        content = self._content(words, dist)  # draws the generic and topic Zipf permutations first
        E = np.zeros((self.K, V, R, self.W))
        E[:, :, sid["U_START"], self.user_id] = 1.0
        E[:, :, sid["A_MARK"], self.assistant_id] = 1.0
        E[:, :, sid["U_OPEN"]] = dist(words.opener)
        tail_d = dist(words.tail)
        E[:, :, sid["U_TAIL"]] = tail_d
        noise_words = [w for w in self.vocab if w not in (UNK, USER, ASSISTANT)]
        noise_d = dist(noise_words, np.full(len(noise_words), 1.0 / len(noise_words)))
        E[:, :, sid["U_NOISE"]] = noise_d
        E[:, :, sid["A_NOISE"]] = noise_d
        for v in range(V):
            E[:, v, sid["U_CUE"]] = _mix([(c.cue_reliability, dist(words.cues[v])),
                                          (1.0 - c.cue_reliability, tail_d)])
        for j, s in enumerate(words.syn):
            E[:, :, sid[f"U_{s}"]] = content[:, None, j]
            E[:, :, sid[f"A_{s}"]] = content[:, None, j]
        for g in PHRASE_GROUPS:
            for p, idx in zip(words.phrases[g], phrase_states[g]):
                for w, r in zip(p, idx):
                    E[:, :, r, self.word_to_id[w]] = 1.0
        content_states = [r for r in range(R) if r not in (sid["U_START"], sid["A_MARK"])]
        E[:, :, content_states] *= 1.0 - c.unk_prob
        E[:, :, content_states, self.unk_id] += c.unk_prob
        assert np.allclose(E.sum(-1), 1.0)
        return E

    def explicit_hmm(self, max_states: int = 20000) -> dict:
        """The full, unfactored automaton over states ``(k, e, v, r)`` (small grammars).

        Returns a dict with ``init`` [S], ``trans`` [S, S], ``final`` [S],
        ``emit`` [S, W] (float64) and ``states`` (list of (k, e, v, r)), such that
        ``p(w_1..w_T) = sum_path init[s_1] emit[s_1, w_1] prod_t trans[s_{t-1}, s_t]
        emit[s_t, w_t] * final[s_T]`` and ``trans.sum(1) + final == 1``.
        """
        K, E, V, R = self.K, self.max_exchanges, self.V, self.R
        S = K * E * V * R
        if S > max_states:
            raise ValueError(f"{S} states > max_states={max_states}")
        states = [(k, e, v, r) for k in range(K) for e in range(1, E + 1)
                  for v in range(V) for r in range(R)]
        index = {s: i for i, s in enumerate(states)}
        init = np.zeros(S)
        trans = np.zeros((S, S))
        final = np.zeros(S)
        emit = np.zeros((S, self.W))
        u = self.start_state
        for (k, e, v, r), i in index.items():
            emit[i] = self.emission[k, v, r]
            if e == 1 and r == u:
                init[i] = self.topic_prior[k] * self.verbosity_prior[v]
            for r2 in range(R):
                if self.trans[v, r, r2]:
                    trans[i, index[(k, e, v, r2)]] = self.trans[v, r, r2]
            pm = self.p_more[e]
            if e < E:
                for v2 in range(V):
                    trans[i, index[(k, e + 1, v2, u)]] += self.eot[v, r] * pm * self.verbosity_prior[v2]
            final[i] = self.eot[v, r] * (1.0 - pm)
        return {"init": init, "trans": trans, "final": final, "emit": emit, "states": states}


def _mix(parts):
    parts = [(m, d) for m, d in parts if m > 0 and d.sum() > 0]
    tot = sum(m for m, _ in parts)
    return sum(m / tot * d for m, d in parts)
