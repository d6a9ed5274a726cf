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
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

__all__ = [
    "ASSISTANT",
    "TOPIC_NAMES",
    "UNK",
    "USER",
    "GrammarConfig",
    "SyntheticChat",
]

USER = "<user>"
ASSISTANT = "<assistant>"
UNK = "<unk>"

# --------------------------------------------------------------------------
# Hand-written word lists. Topic lists are disjoint from each other and from
# the generic content lists (checked at construction).
# --------------------------------------------------------------------------

# topic -> (nouns, verbs, adjectives)
_TOPICS: dict[str, tuple[list[str], list[str], list[str]]] = {
    "weather": (
        ["rain", "snow", "wind", "storm", "cloud", "sun", "forecast", "temperature", "humidity", "thunder", "fog", "umbrella", "climate", "degrees", "drizzle", "hail"],
        ["rains", "snows", "pours", "freezes", "shines", "blows"],
        ["sunny", "cloudy", "windy", "rainy", "humid", "chilly"],
    ),
    "food": (
        ["recipe", "pasta", "bread", "rice", "soup", "salad", "cheese", "garlic", "oven", "kitchen", "dinner", "breakfast", "sauce", "spice", "dessert", "flavor"],
        ["bake", "cook", "boil", "fry", "taste", "chop"],
        ["delicious", "spicy", "sweet", "salty", "fresh", "crispy"],
    ),
    "travel": (
        ["flight", "airport", "hotel", "passport", "luggage", "ticket", "beach", "city", "museum", "train", "journey", "visa", "itinerary", "map", "tourist", "destination"],
        ["fly", "visit", "pack", "explore", "book", "wander"],
        ["scenic", "cheap", "crowded", "exotic", "remote", "historic"],
    ),
    "music": (
        ["song", "guitar", "piano", "melody", "rhythm", "album", "concert", "band", "singer", "chord", "lyrics", "drum", "playlist", "tempo", "orchestra", "harmony"],
        ["sing", "strum", "compose", "listen", "tune", "rehearse"],
        ["catchy", "loud", "acoustic", "melodic", "classical", "jazzy"],
    ),
    "sports": (
        ["team", "match", "goal", "coach", "player", "ball", "league", "stadium", "score", "referee", "tournament", "training", "fans", "racket", "field", "medal"],
        ["kick", "throw", "win", "lose", "sprint", "tackle"],
        ["athletic", "competitive", "fast", "defensive", "olympic", "sporty"],
    ),
    "code": (
        ["function", "variable", "compiler", "bug", "loop", "array", "python", "server", "database", "syntax", "library", "module", "test", "commit", "api", "debugger"],
        ["compile", "debug", "refactor", "deploy", "import", "iterate"],
        ["recursive", "binary", "async", "static", "buggy", "modular"],
    ),
    "health": (
        ["sleep", "exercise", "diet", "doctor", "vitamin", "fever", "muscle", "heart", "stress", "water", "protein", "symptom", "medicine", "nurse", "clinic", "posture"],
        ["rest", "stretch", "heal", "breathe", "recover", "hydrate"],
        ["healthy", "tired", "sore", "calm", "balanced", "chronic"],
    ),
    "movies": (
        ["film", "movie", "actor", "director", "scene", "plot", "sequel", "cinema", "trailer", "genre", "script", "character", "popcorn", "screen", "comedy", "drama"],
        ["watch", "stream", "binge", "premiere", "review", "rewatch"],
        ["thrilling", "funny", "animated", "dramatic", "scary", "cinematic"],
    ),
}
TOPIC_NAMES: tuple[str, ...] = tuple(_TOPICS)

_DET = ["the", "a", "this", "that", "some", "your", "my", "our", "every", "each", "many", "most", "any", "these", "those", "their", "its", "no"]
_GEN_NOUN = (
    ["thing", "things", "way", "time", "people", "idea", "part", "place", "day", "week", "year", "kind", "lot", "problem", "option", "choice", "reason", "plan", "step", "result", "friend", "home", "work"]
)
_GEN_VERB = (
    ["is", "are", "was", "can", "will", "helps", "makes", "takes", "needs", "gets", "feels", "seems", "works", "means", "has", "goes", "keeps", "gives", "try", "use", "find", "change"]
)
_GEN_ADJ = (
    ["good", "bad", "great", "new", "old", "big", "small", "best", "better", "simple", "hard", "easy", "important", "different", "common", "popular", "nice", "useful", "main", "real", "usual"]
)
_ADV = (
    ["usually", "generally", "often", "sometimes", "really", "maybe", "probably", "definitely", "always", "never", "also", "however", "just", "very", "quite", "still", "actually", "typically"]
)
_CONN = ["and", "but", "or", "so", "because", "with", "in", "on", "for", "of", "to", "at", "from", "about", "when", "if", "then", "while", "after", "before", "by", "than", "into", "over"]
_OPENER = (
    ["hi", "hello", "hey", "so", "ok", "please", "what", "how", "why", "when", "where", "which", "can", "could", "would", "should", "do", "does", "tell", "me", "i", "you", "question", "help", "wondering", "curious", "know", "want", "need"]
)
# Verbosity cue words, class 0 (short) .. class 3 (very long).
_CUES = (
    ["briefly", "quick", "quickly", "short", "concise", "simply", "tldr", "shortly"],
    ["describe", "overview", "summarize", "outline", "sketch", "basics", "summary", "gist"],
    ["explain", "detail", "details", "thoroughly", "carefully", "deeply", "reasoning", "why"],
    ["everything", "comprehensive", "exhaustive", "complete", "guide", "elaborate", "thorough", "tutorial"],
)
_TAIL = ["please", "thanks", "now", "today", "again", "too", "here", "anyway"]

_OPEN_PHRASES = [
    "sure", "of course", "great question", "good question", "thank you for asking",
    "happy to help", "here is what i know", "let me explain", "well", "okay so",
]
_MID_PHRASES = [
    "for example", "on the other hand", "in other words", "as a result", "it depends on",
    "the key is", "in general", "keep in mind that", "to be honest", "first of all",
    "after that",
]
_CLOSE_PHRASES = [
    "hope that helps", "i hope this helps", "let me know if you need anything else",
    "feel free to ask more", "thank you for asking", "have a nice day", "good luck",
    "enjoy", "that is all",
]

# Syntax of content words: sub-states and the Markov chain between them
# (conditional on the body continuing). Rows sum to 1.
_SYN = ("DET", "ADJ", "NOUN", "VERB", "ADV", "CONN")
_SYN_ENTRY = {"DET": 0.45, "NOUN": 0.3, "ADV": 0.15, "ADJ": 0.1}
_SYN_TRANS = {
    "DET": {"ADJ": 0.3, "NOUN": 0.7},
    "ADJ": {"NOUN": 0.75, "ADJ": 0.1, "CONN": 0.15},
    "NOUN": {"VERB": 0.45, "CONN": 0.35, "NOUN": 0.1, "ADV": 0.1},
    "VERB": {"DET": 0.45, "ADJ": 0.15, "ADV": 0.15, "CONN": 0.15, "NOUN": 0.1},
    "ADV": {"VERB": 0.4, "ADJ": 0.4, "DET": 0.2},
    "CONN": {"DET": 0.5, "NOUN": 0.3, "ADV": 0.2},
}
# Topic share of each content category: (topic words, generic words, other topics).
_TOPIC_SHARE = {"NOUN": 0.7, "VERB": 0.35, "ADJ": 0.4}


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


def _cont(mean: float) -> float:
    """Continue probability of a geometric on {1, 2, ...} with the given mean."""
    if mean < 1.0:
        raise ValueError(f"geometric mean must be >= 1, got {mean}")
    return 1.0 - 1.0 / mean


class SyntheticChat:
    """The chat grammar: sampling and exact scoring.

    Attributes:
      config: the ``GrammarConfig``.
      vocab: list of words; ``vocab[0] == "<unk>"``, then ``<user>``,
        ``<assistant>``.
      topics: topic names, ``len == config.num_topics``.
      topic_words: per topic, the set of its own words (nouns, verbs, adjectives).
      verbosity_cues: per verbosity class, its cue words.
      state_names: names of the ``R`` local automaton states.
    """

    def __init__(self, config: GrammarConfig = GrammarConfig()):
        c = config
        self.config = c
        V = len(c.verbosity_prior)
        if not 1 <= V <= len(_CUES):
            raise ValueError(f"need 1..{len(_CUES)} verbosity classes, got {V}")
        for name in ("reply_body_means", "open_prob", "mid_prob", "close_prob"):
            if len(getattr(c, name)) != V:
                raise ValueError(f"{name} must have {V} entries like verbosity_prior")
        if not 1 <= c.num_topics <= len(TOPIC_NAMES):
            raise ValueError(f"num_topics must be in 1..{len(TOPIC_NAMES)}")
        if not 0.0 < c.unk_prob < 1.0:
            raise ValueError("unk_prob must be in (0, 1)")
        if not 0.0 <= c.noise_prob < 1.0:
            raise ValueError("noise_prob must be in [0, 1)")
        self.K, self.V = c.num_topics, V
        self.topics = list(TOPIC_NAMES[: c.num_topics])
        rng = np.random.default_rng(np.random.SeedSequence([c.seed, 0x5C4A7]))

        def cut(words):
            return list(words) if c.words_per_class is None else list(words)[: c.words_per_class]

        def pcut(phr):
            return list(phr) if c.phrases_per_group is None else list(phr)[: c.phrases_per_group]

        topic_lists = [tuple(cut(x) for x in _TOPICS[t]) for t in self.topics]  # (N, Vb, A)
        syn = _SYN if c.syntax else ("NOUN",)
        generic = {"DET": cut(_DET), "NOUN": cut(_GEN_NOUN), "VERB": cut(_GEN_VERB),
                   "ADJ": cut(_GEN_ADJ), "ADV": cut(_ADV), "CONN": cut(_CONN)}
        opener, tail = cut(_OPENER), cut(_TAIL)
        cues = [cut(_CUES[i]) for i in range(V)]
        phrases = {"open": [p.split() for p in pcut(_OPEN_PHRASES)],
                   "mid": [p.split() for p in pcut(_MID_PHRASES)],
                   "close": [p.split() for p in pcut(_CLOSE_PHRASES)]}

        # ---- vocabulary (ordered union) --------------------------------------
        vocab = [UNK, USER, ASSISTANT]
        seen = set(vocab)

        def add(words):
            for w in words:
                if w not in seen:
                    seen.add(w)
                    vocab.append(w)

        add(opener)
        for s in syn:
            add(generic[s])
        for tl in topic_lists:
            for i, s in enumerate(("NOUN", "VERB", "ADJ")):
                if s in syn:
                    add(tl[i])
        for cl in cues:
            add(cl)
        add(tail)
        for g in ("open", "mid", "close"):
            for p in phrases[g]:
                add(p)
        self.vocab = vocab
        self.word_to_id = {w: i for i, w in enumerate(vocab)}
        W = self.W = len(vocab)
        self.unk_id, self.user_id, self.assistant_id = 0, 1, 2

        self.topic_words = []
        for tl in topic_lists:
            words = set(tl[0]) | (set(tl[1]) | set(tl[2]) if c.syntax else set())
            self.topic_words.append(words)
        all_generic = set().union(*generic.values())
        for i, a in enumerate(self.topic_words):
            if a & all_generic:
                raise AssertionError(f"topic words overlap generic words: {a & all_generic}")
            for b in self.topic_words[i + 1:]:
                if a & b:
                    raise AssertionError(f"topic lists overlap: {a & b}")
        self.verbosity_cues = [list(x) for x in cues]

        # ---- local states ----------------------------------------------------
        names = ["U_START", "U_OPEN"] + [f"U_{s}" for s in syn] + ["U_CUE", "U_TAIL", "U_NOISE", "A_MARK"]
        names += [f"A_{s}" for s in syn] + ["A_NOISE"]
        phrase_states: dict[str, list[list[int]]] = {}
        for g in ("open", "mid", "close"):
            phrase_states[g] = []
            for p in phrases[g]:
                idx = []
                for j, w in enumerate(p):
                    idx.append(len(names))
                    names.append(f"{g.upper()}:{' '.join(p)}:{j}:{w}")
                phrase_states[g].append(idx)
        self.state_names = names
        R = self.R = len(names)
        sid = {n: i for i, n in enumerate(names)}
        self.start_state = sid["U_START"]

        # ---- emissions E[k, v, r, w] -----------------------------------------
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

        def mix(parts):
            parts = [(m, d) for m, d in parts if m > 0 and d.sum() > 0]
            tot = sum(m for m, _ in parts)
            return sum(m / tot * d for m, d in parts)

        gen_d = {s: dist(generic[s]) for s in syn}
        cat_index = {"NOUN": 0, "VERB": 1, "ADJ": 2}
        # one Zipf permutation per topic list, shared by user and assistant states
        topic_d = [{s: dist(tl[cat_index[s]]) for s in syn if s in cat_index} for tl in topic_lists]
        content = np.zeros((self.K, len(syn), W))
        for k in range(self.K):
            for j, s in enumerate(syn):
                if s not in cat_index:
                    content[k, j] = gen_d[s]
                    continue
                others = [w for o in range(self.K) if o != k for w in topic_lists[o][cat_index[s]]]
                leak = dist(others, np.full(len(others), 1.0 / max(1, len(others))))
                share = _TOPIC_SHARE[s]
                content[k, j] = mix([(share, topic_d[k][s]),
                                     (1.0 - share - c.leak_prob, gen_d[s]),
                                     (c.leak_prob, leak)])
        E = np.zeros((self.K, V, R, W))
        E[:, :, sid["U_START"], self.user_id] = 1.0
        E[:, :, sid["A_MARK"], self.assistant_id] = 1.0
        E[:, :, sid["U_OPEN"]] = dist(opener)
        tail_d = dist(tail)
        E[:, :, sid["U_TAIL"]] = tail_d
        noise_words = [w for w in vocab if w not in (UNK, USER, ASSISTANT)]
        noise_d = dist(noise_words, np.full(len(noise_words), 1.0 / len(noise_words)))
        E[:, :, sid["U_NOISE"]] = noise_d
        E[:, :, sid["A_NOISE"]] = noise_d
        for v in range(V):
            E[:, v, sid["U_CUE"]] = mix([(c.cue_reliability, dist(cues[v])),
                                         (1.0 - c.cue_reliability, tail_d)])
        for j, s in enumerate(syn):
            E[:, :, sid[f"U_{s}"]] = content[:, None, j]
            E[:, :, sid[f"A_{s}"]] = content[:, None, j]
        for g in ("open", "mid", "close"):
            for p, idx in zip(phrases[g], phrase_states[g]):
                for w, r in zip(p, idx):
                    E[:, :, r, self.word_to_id[w]] = 1.0
        content_states = [r for r in range(R) if r not in (sid["U_START"], sid["A_MARK"])]
        E[:, :, content_states] *= 1.0 - c.unk_prob
        E[:, :, content_states, self.unk_id] += c.unk_prob
        assert np.allclose(E.sum(-1), 1.0)
        self.emission = E  # [K, V, R, W]

        # ---- transitions T[v, r, r'] and end-of-turn eot[v, r] ----------------
        T = np.zeros((V, R, R))
        eot = np.zeros((V, R))
        entry = {s: p for s, p in _SYN_ENTRY.items() if s in syn}
        tot = sum(entry.values())
        entry = {s: p / tot for s, p in entry.items()}

        def syn_next(s):
            if not c.syntax:
                return {"NOUN": 1.0}
            return _SYN_TRANS[s]

        def to_phrases(v, r, group, prob):
            n = len(phrase_states[group])
            for idx in phrase_states[group]:
                T[v, r, idx[0]] += prob / n

        for v in range(V):
            # user turn
            T[v, sid["U_START"], sid["U_OPEN"]] += c.user_open_prob
            for s, p in entry.items():
                T[v, sid["U_START"], sid[f"U_{s}"]] += (1 - c.user_open_prob) * p
            q = _cont(c.user_open_mean)
            T[v, sid["U_OPEN"], sid["U_OPEN"]] += q
            for s, p in entry.items():
                T[v, sid["U_OPEN"], sid[f"U_{s}"]] += (1 - q) * p
            q = _cont(c.user_body_mean)
            for s in syn:
                for s2, p in syn_next(s).items():
                    T[v, sid[f"U_{s}"], sid[f"U_{s2}"]] += q * p
                T[v, sid[f"U_{s}"], sid["U_CUE"]] += 1 - q
            T[v, sid["U_CUE"], sid["U_TAIL"]] += c.user_tail_prob
            T[v, sid["U_CUE"], sid["A_MARK"]] += 1 - c.user_tail_prob
            q = _cont(c.user_tail_mean)
            T[v, sid["U_TAIL"], sid["U_TAIL"]] += q
            T[v, sid["U_TAIL"], sid["A_MARK"]] += 1 - q
            # assistant turn
            o = c.open_prob[v] if phrase_states["open"] else 0.0
            to_phrases(v, sid["A_MARK"], "open", o)
            for s, p in entry.items():
                T[v, sid["A_MARK"], sid[f"A_{s}"]] += (1 - o) * p
            for idx in phrase_states["open"] + phrase_states["mid"]:
                for a, b in itertools.pairwise(idx):
                    T[v, a, b] = 1.0
                for s, p in entry.items():
                    T[v, idx[-1], sid[f"A_{s}"]] += p
            q = _cont(c.reply_body_means[v])
            m = c.mid_prob[v] if phrase_states["mid"] else 0.0
            z = c.close_prob[v] if phrase_states["close"] else 0.0
            for s in syn:
                r = sid[f"A_{s}"]
                to_phrases(v, r, "mid", q * m)
                for s2, p in syn_next(s).items():
                    T[v, r, sid[f"A_{s2}"]] += q * (1 - m) * p
                to_phrases(v, r, "close", (1 - q) * z)
                eot[v, r] = (1 - q) * (1 - z)
            for idx in phrase_states["close"]:
                for a, b in itertools.pairwise(idx):
                    T[v, a, b] = 1.0
                eot[v, idx[-1]] = 1.0
        # Noise: every state of a turn may derail (prob noise_prob) into the
        # turn's NOISE state, which emits any non-marker word uniformly and then
        # stays, rejoins the content syntax, or ends the turn. This gives every
        # text with a valid marker skeleton a finite probability.
        nu = c.noise_prob
        user_role = [i for i, n in enumerate(names) if n.startswith("U_")]
        asst_role = [i for i in range(R) if i not in user_role]
        for v in range(V):
            for role, noise in ((user_role, sid["U_NOISE"]), (asst_role, sid["A_NOISE"])):
                for r in role:
                    if r != noise:
                        T[v, r] *= 1.0 - nu
                        eot[v, r] *= 1.0 - nu
                        T[v, r, noise] += nu
            for pre, exit_to in (("U", sid["A_MARK"]), ("A", None)):
                r = sid[f"{pre}_NOISE"]
                T[v, r, r] = 0.5
                for s_, p in entry.items():
                    T[v, r, sid[f"{pre}_{s_}"]] += 0.3 * p
                if exit_to is None:
                    eot[v, r] = 0.2
                else:
                    T[v, r, exit_to] += 0.2
        assert np.allclose(T.sum(-1) + eot, 1.0)
        assert np.all(T[:, :, self.start_state] == 0.0)
        self.trans, self.eot = T, eot  # [V, R, R], [V, R]

        self.topic_prior = np.full(self.K, 1.0 / self.K)
        self.verbosity_prior = np.asarray(c.verbosity_prior, np.float64)
        if not np.isclose(self.verbosity_prior.sum(), 1.0):
            raise ValueError("verbosity_prior must sum to 1")
        self.max_exchanges = len(c.more_exchange_prob) + 1
        # p_more[e] for e = exchanges completed (index 0 unused); 0 beyond the cap.
        self._p_more = np.zeros(self.max_exchanges + 2)
        self._p_more[1 : self.max_exchanges] = c.more_exchange_prob

        # Forward-algorithm layouts over flat local states f = v * R + r, plus one
        # dummy state F (all zeros) used for padding; one pad word W (emits nothing).
        F = V * R
        Tf = np.zeros((F + 1, F + 1))
        for v in range(V):
            Tf[v * R : (v + 1) * R, v * R : (v + 1) * R] = T[v]
            for v2 in range(V):  # end of turn -> next exchange's <user> (times p_more)
                Tf[v * R : (v + 1) * R, v2 * R + self.start_state] = eot[v] * self.verbosity_prior[v2]
        self._TfT = np.ascontiguousarray(Tf.T)  # [F+1, F+1], TfT[to, from]
        E2 = np.zeros((W + 1, F + 1, self.K))
        E2[:W, :F] = E.reshape(self.K, F, W).transpose(2, 1, 0)
        self._E2 = E2  # [W+1, F+1, K]
        self._eot_f = np.concatenate([eot.reshape(F), [0.0]])
        self._init_f = np.zeros((F + 1, self.K))
        for v in range(V):
            self._init_f[v * R + self.start_state] = self.verbosity_prior[v] * self.topic_prior
        # Support of each known word: flat states that can emit it (padded with
        # F). <unk> (emitted by every content state) is never expanded: runs of
        # <unk> are folded into powers of (Tf D), see _forward_chunk.
        can = E2.any(axis=2)  # [W+1, F+1]
        can[self.unk_id] = False
        sizes = np.maximum(can.sum(1), 1)
        sup = np.full((W + 1, int(sizes.max())), F, np.int64)
        for w in range(W + 1):
            nz = np.nonzero(can[w])[0]
            sup[w, : nz.size] = nz
        self._sup, self._sup_len = sup, sizes
        self.F = F
        self._Tf = Tf
        content = np.zeros(F + 1)
        content[:F] = (E[0, :, :, self.unk_id] > 0).reshape(F)
        self._TfD = Tf * content[None, :]  # one step that ends in an <unk>-emitting state
        self._log_unk = float(np.log(c.unk_prob))
        self._pow2 = [self._TfD]  # (Tf D)^(2^j)
        self._GT_cache: dict[int, np.ndarray] = {}
        self._h_tab = np.ones((1, F + 1))  # h_u = (Tf D)^u 1
        self._g_tab = self._eot_f[None].copy()  # g_u = (Tf D)^u eot
        self._T_fwd = T.copy()  # local T with the end-of-turn mass in the U_START column
        self._T_fwd[:, :, self.start_state] = eot
        self._sampler_tables = None

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
        full, pre, _ = self._forward(seqs)
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
        full, pre, at_mark = self._forward(seqs, np.asarray(marks, np.int64))
        joint = pre if prefix else full
        with np.errstate(invalid="ignore"):
            out = joint - at_mark
        out[np.isneginf(at_mark)] = np.nan
        return out

    def _forward(self, seqs: list[np.ndarray], marks: np.ndarray | None = None,
                 chunk: int = 256):
        """Scaled forward pass. Returns (log p complete [n], log p prefix [n],
        log p prefix of the first marks[i] words [n])."""
        n = len(seqs)
        full = np.full(n, -np.inf)
        pre = np.full(n, -np.inf)
        at_mark = np.zeros(n)
        lens = np.array([len(s) for s in seqs], np.int64)
        marks = np.zeros(n, np.int64) if marks is None else marks
        pre[lens == 0] = 0.0  # empty prefix; full stays -inf (no empty conversations)
        order = np.argsort(lens, kind="stable")
        order = order[lens[order] > 0]
        for i in range(0, len(order), chunk):
            idx = order[i : i + chunk]
            f, p, m = self._forward_chunk([seqs[j] for j in idx], marks[idx])
            full[idx], pre[idx], at_mark[idx] = f, p, m
        return full, pre, at_mark

    def _GT(self, u: int) -> np.ndarray:
        """``((Tf D)^u Tf)^T`` [F+1, F+1]: transition across ``u`` <unk> words
        (without the ``unk_prob^u`` factor), transposed (``[to, from]``)."""
        if u == 0:
            return self._TfT
        got = self._GT_cache.get(u)
        if got is None:
            while (1 << len(self._pow2)) <= u:
                self._pow2.append(self._pow2[-1] @ self._pow2[-1])
            m = self._Tf
            for j in range(len(self._pow2)):
                if u >> j & 1:
                    m = self._pow2[j] @ m
            got = np.ascontiguousarray(m.T)
            if len(self._GT_cache) >= 16:
                self._GT_cache.clear()
            self._GT_cache[u] = got
        return got

    def _hg(self, u: np.ndarray):
        """Vectors h_u = (Tf D)^u 1 and g_u = (Tf D)^u eot, rows [len(u), F+1]."""
        need = int(u.max())
        while self._h_tab.shape[0] <= need:
            n = self._h_tab.shape[0]
            h, g = [self._h_tab], [self._g_tab]
            for _ in range(n):  # double the tables
                h.append((self._TfD @ h[-1][-1])[None])
                g.append((self._TfD @ g[-1][-1])[None])
            self._h_tab, self._g_tab = np.concatenate(h), np.concatenate(g)
        return self._h_tab[u], self._g_tab[u]

    def _forward_chunk(self, seqs, marks):
        """Forward pass over one batch of texts, sparse in the state.

        After a known word w only the flat states in support(w) are alive
        (<= 32 of V*R), so a step is a batched ``[M_t, M_{t-1}] @ [M_{t-1}, K]``
        product. ``<unk>`` (emitted by every content state with probability
        ``unk_prob``) is not expanded: a run of ``u`` unknown words is folded
        into the next transition as ``unk_prob^u (Tf D)^u Tf`` (D = content
        states), and prefix / end probabilities inside a run use
        ``(Tf D)^u 1`` and ``(Tf D)^u eot``. Exact, not an approximation.
        """
        W, F, K = self.W, self.F, self.K
        B = len(seqs)
        lens = np.array([len(s) for s in seqs])
        Tm = int(lens.max())
        ids = np.full((B, Tm), W, np.int64)  # pad word W (emits nothing)
        for b, s in enumerate(seqs):
            ids[b, : len(s)] = s
        ids[ids[:, 0] == self.unk_id, 0] = W  # a text cannot start with <unk>
        is_unk = ids == self.unk_id
        is_user = ids == self.user_id
        e_before = np.cumsum(is_user, axis=1) - is_user  # exchanges completed before t
        cap = len(self._p_more) - 1
        factor = np.where(is_user, self._p_more[np.minimum(e_before, cap)], 1.0)  # [B, Tm]
        p_end = 1.0 - self._p_more[np.minimum(is_user.sum(1), cap)]
        Mmax = self._sup.shape[1]

        alpha = np.zeros((B, Mmax, K))  # normalised forward values on `prev`
        prev = np.full((B, Mmax), F, np.int64)  # their flat states (F = dummy)
        wid = np.ones(B, np.int64)
        pend = np.zeros(B, np.int64)  # <unk> words since the last known word
        logz = np.zeros(B)
        full = np.full(B, -np.inf)
        pre = np.full(B, -np.inf)
        at_mark = np.where(marks == 0, 0.0, -np.inf)
        last = lens - 1
        for t in range(Tm):
            active = t < lens
            pend[is_unk[:, t] & active] += 1
            rows = np.nonzero(~is_unk[:, t] & active)[0]
            if rows.size:
                w = ids[rows, t]
                mc = int(self._sup_len[w].max())
                cur = self._sup[w, :mc]  # [n, Mc]
                emit = self._E2[w[:, None], cur]  # [n, Mc, K]
                if t == 0:
                    a = self._init_f[cur] * emit
                else:
                    mp = int(wid[rows].max())
                    pv = prev[rows, :mp]
                    u = pend[rows]
                    if not u.any():
                        tsub = self._TfT[cur[:, :, None], pv[:, None, :]]
                    else:
                        tsub = np.empty((rows.size, mc, mp))
                        for uu in np.unique(u):
                            sel = u == uu
                            tsub[sel] = self._GT(int(uu))[cur[sel][:, :, None], pv[sel][:, None, :]]
                        logz[rows] += u * self._log_unk
                        pend[rows] = 0
                    a = np.matmul(tsub, alpha[rows, :mp]) * emit
                    a *= factor[rows, t, None, None]
                sa = a.sum(axis=(1, 2))
                with np.errstate(divide="ignore"):
                    logz[rows] += np.log(sa)
                a /= np.where(sa > 0, sa, 1.0)[:, None, None]
                alpha[rows, :mc] = a
                alpha[rows, mc:] = 0.0
                prev[rows, :mc] = cur
                prev[rows, mc:] = F
                wid[rows] = mc
            hit = np.nonzero((marks == t + 1) | (last == t))[0]
            if hit.size:
                u = pend[hit]
                h, g = self._hg(u)  # [d, F+1]
                st = prev[hit]
                a = alpha[hit].sum(-1)  # [d, Mmax]
                mass = (a * np.take_along_axis(h, st, 1)).sum(1)
                end = (a * np.take_along_axis(g, st, 1)).sum(1) * p_end[hit]
                base = logz[hit] + u * self._log_unk
                with np.errstate(divide="ignore"):
                    lpre = base + np.log(mass)
                    lfull = base + np.log(end)
                m = marks[hit] == t + 1
                at_mark[hit[m]] = lpre[m]
                f = last[hit] == t
                pre[hit[f]] = lpre[f]
                full[hit[f]] = lfull[f]
        return full, pre, at_mark

    # ---------------------------------------------------------- explicit HMM
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
            pm = self._p_more[e]
            if e < E:
                for v2 in range(V):
                    trans[i, index[(k, e + 1, v2, u)]] += self.eot[v, r] * pm * self.verbosity_prior[v2]
            final[i] = self.eot[v, r] * (1.0 - pm)
        return {"init": init, "trans": trans, "final": final, "emit": emit, "states": states}

    # --------------------------------------------------------------- sampling
    def _tables(self):
        if self._sampler_tables is None:
            K, V, R, W = self.K, self.V, self.R, self.W
            ce = np.cumsum(self.emission.reshape(K * V * R, W), axis=1)
            ce /= ce[:, -1:]
            ce += np.arange(K * V * R)[:, None]  # row offsets -> globally sorted keys
            ct = np.cumsum(self._T_fwd.reshape(V * R, R), axis=1)
            ct /= ct[:, -1:]
            ct += np.arange(V * R)[:, None]
            self._sampler_tables = (ce.ravel(), ct.ravel())
        return self._sampler_tables

    def _sample_ids(self, n: int, seed: int, topics: Sequence[int] | None):
        """Vectorised sampling over conversations. Returns (list of id arrays,
        topic [n], verbosity [n, max_exchanges] (-1 where unused))."""
        K, V, R, W = self.K, self.V, self.R, self.W
        rng = np.random.default_rng(np.random.SeedSequence([seed, 0xC4A7]))
        if topics is None:
            allowed = np.arange(K)
        else:
            allowed = np.asarray(sorted({int(t) for t in topics}), np.int64)
            if allowed.size == 0 or allowed.min() < 0 or allowed.max() >= K:
                raise ValueError(f"topics must be a non-empty subset of range({K})")
        prior = self.topic_prior[allowed] / self.topic_prior[allowed].sum()
        ce, ct = self._tables()
        u = self.start_state
        topic = allowed[rng.choice(allowed.size, size=n, p=prior)]
        verb = np.full((n, self.max_exchanges), -1, np.int64)
        v = rng.choice(V, size=n, p=self.verbosity_prior)
        verb[:, 0] = v
        e = np.ones(n, np.int64)
        r = np.full(n, u, np.int64)
        alive = np.arange(n)
        k = topic.copy()
        rec_conv, rec_word = [], []
        while alive.size:
            # emit
            row = (k * V + v) * R + r
            w = np.searchsorted(ce, row + rng.random(alive.size), side="right") - row * W
            rec_conv.append(alive)
            rec_word.append(np.minimum(w, W - 1))
            # transition
            row = v * R + r
            r = np.searchsorted(ct, row + rng.random(alive.size), side="right") - row * R
            r = np.minimum(r, R - 1)
            eot = r == u
            if eot.any():
                more = eot & (rng.random(alive.size) < self._p_more[np.minimum(e, len(self._p_more) - 1)])
                if more.any():
                    e = e + more
                    v = np.where(more, rng.choice(V, size=alive.size, p=self.verbosity_prior), v)
                    verb[alive[more], e[more] - 1] = v[more]
                keep = ~(eot & ~more)
                alive, k, v, e, r = alive[keep], k[keep], v[keep], e[keep], r[keep]
        conv = np.concatenate(rec_conv)
        words = np.concatenate(rec_word)
        order = np.argsort(conv, kind="stable")
        counts = np.bincount(conv, minlength=n)
        seqs = np.split(words[order], np.cumsum(counts)[:-1])
        return seqs, topic, verb

    def sample(self, n: int, seed: int, topics: Sequence[int] | None = None) -> list[str]:
        """``n`` conversation texts, deterministic given ``(n, seed, topics)``.
        ``topics`` (indices into ``self.topics``) restricts the latent topic,
        drawn from the renormalised prior over the subset."""
        seqs, _, _ = self._sample_ids(n, seed, topics)
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
        seqs, topic, verb = self._sample_ids(n, seed, topics)
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
