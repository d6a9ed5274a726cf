"""Sample-quality metrics: generative perplexity under a judge, unigram entropy, distinct-n.

Quality is always reported as a pair (gen PPL, entropy): low-entropy samples game gen PPL.
Both are computed on the judge's tokenization of the decoded text (words for the exact
synthetic-grammar judge, the judge model's tokens for a model judge).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Protocol, Sequence

import numpy as np


class Judge(Protocol):
    """Scores decoded texts. `complete[i]` False means text i was cut off (score it as a prefix)."""

    name: str

    def tokenize(self, text: str) -> list[str | int]: ...

    def score(self, texts: Sequence[str], complete: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
        """(log-likelihood [n] in nats, number of scored tokens [n])."""
        ...


def unigram_entropy(tokens: Sequence) -> float:
    """Entropy (nats) of the empirical unigram distribution of one sample's tokens."""
    if not tokens:
        return 0.0
    counts = np.asarray(list(collections.Counter(tokens).values()), np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


def mean_unigram_entropy(samples: Sequence[Sequence]) -> float:
    """Per-sample unigram entropy averaged over samples (the paper's entropy column)."""
    return float(np.mean([unigram_entropy(s) for s in samples])) if samples else float("nan")


def pooled_unigram_entropy(samples: Sequence[Sequence]) -> float:
    """Entropy (nats) of the unigram distribution of all samples' tokens counted together.

    Unlike `mean_unigram_entropy` it does not depend on how long each sample is (a sample's own
    entropy is at most log of its length, so longer replies read higher), and it also sees
    diversity across samples (a model that repeats one reply reads low). Measured on cpu-wide's
    replies (docs/speculative.md): monotone in the temperature where the per-sample mean is not,
    and two seeds at T = 1 within 0.015 nats of each other where the mean moved by up to 0.13."""
    tokens = [t for s in samples for t in s]
    return unigram_entropy(tokens) if tokens else float("nan")


def prefix_unigram_entropy(samples: Sequence[Sequence], k: int) -> tuple[float, float]:
    """(mean unigram entropy of the first `k` tokens of the samples at least `k` long, the share of
    samples that long): the per-sample entropy at one length, so samples of different lengths
    compare."""
    long_ = [s[:k] for s in samples if len(s) >= k]
    share = len(long_) / len(samples) if samples else 0.0
    return (float(np.mean([unigram_entropy(s) for s in long_])) if long_ else float("nan")), share


def topic_purity(samples: Sequence[Sequence], topic_of: dict, min_words: int = 2) -> tuple[float, float]:
    """(mean share of a sample's topic words that belong to its most frequent topic, over the
    samples with at least `min_words` topic words; the share of samples that have that many).
    `topic_of` maps a word to its topic (words it does not hold are not topic words). 1.0: every
    sample keeps to one topic; with k topics drawn independently per word it falls toward 1 / k.
    On the synthetic chat corpus (`relf_jax.data.synthetic_chat.lexicon.TOPICS`) it tells a model
    that writes one conversation on one subject from one that picks each word's subject alone."""
    purities = []
    for s in samples:
        topics = [topic_of[w] for w in s if w in topic_of]
        if len(topics) >= min_words:
            purities.append(max(collections.Counter(topics).values()) / len(topics))
    share = len(purities) / len(samples) if samples else 0.0
    return (float(np.mean(purities)) if purities else float("nan")), share


def true_topic_share(probs: np.ndarray, targets: np.ndarray, topic_of_id: np.ndarray,
                     num_topics: int) -> tuple[float, float]:
    """How much a model's next-word (or masked-word) distribution knows the topic, at positions
    whose target is a topic token: (mean over those positions of the mass on the target's topic
    over the mass on all topics' tokens; the share of them whose most-massed topic is the
    target's). probs [N, V], targets [N] ids, topic_of_id [V] (-1: not a topic token). A model
    that knows nothing of the topic reads about 1 / num_topics on the first."""
    probs, targets, topic_of_id = np.asarray(probs, np.float64), np.asarray(targets), np.asarray(topic_of_id)
    onehot = np.zeros((len(topic_of_id), num_topics))
    rows = np.flatnonzero(topic_of_id >= 0)
    onehot[rows, topic_of_id[rows]] = 1.0
    keep = topic_of_id[targets] >= 0
    mass = probs[keep] @ onehot
    true = topic_of_id[targets[keep]]
    if not len(true):
        return float("nan"), float("nan")
    share = mass[np.arange(len(true)), true] / np.maximum(mass.sum(-1), 1e-30)
    return float(share.mean()), float(np.mean(mass.argmax(-1) == true))


def distinct_n(samples: Sequence[Sequence], n: int) -> float:
    """Unique n-grams / all n-grams over all samples (0 when there are none)."""
    grams = [tuple(s[i:i + n]) for s in samples for i in range(len(s) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


@dataclasses.dataclass(frozen=True)
class QualityReport:
    gen_ppl: float
    entropy: float
    pooled_entropy: float
    distinct_2: float
    distinct_3: float
    mean_tokens: float
    num_samples: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def generative_perplexity(judge: Judge, texts: Sequence[str], complete: Sequence[bool]) -> float:
    """exp(total negative log-likelihood / total scored tokens) of the samples under `judge`."""
    logp, n = judge.score(texts, complete)
    total = float(np.sum(n))
    if total == 0:
        return float("nan")
    nll = -float(np.sum(logp))
    return math.exp(nll / total) if math.isfinite(nll) else float("inf")


def quality(judge: Judge, texts: Sequence[str], complete: Sequence[bool]) -> QualityReport:
    """Gen PPL, mean and pooled unigram entropy and distinct-2/3 of decoded samples under `judge`."""
    toks = [judge.tokenize(t) for t in texts]
    return QualityReport(gen_ppl=generative_perplexity(judge, texts, complete),
                         entropy=mean_unigram_entropy(toks), pooled_entropy=pooled_unigram_entropy(toks),
                         distinct_2=distinct_n(toks, 2),
                         distinct_3=distinct_n(toks, 3), mean_tokens=float(np.mean([len(t) for t in toks])),
                         num_samples=len(texts))
