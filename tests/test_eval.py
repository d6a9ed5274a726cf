import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from relf_jax.data.synthetic_chat import SyntheticChat
from relf_jax.eval.judges import ExactJudge, ModelJudge
from relf_jax.eval.metrics import (
    distinct_n,
    generative_perplexity,
    mean_unigram_entropy,
    pooled_unigram_entropy,
    prefix_unigram_entropy,
    quality,
    topic_purity,
    true_topic_share,
    unigram_entropy,
)


def test_unigram_entropy_and_distinct():
    assert unigram_entropy(["a", "a", "b", "b"]) == pytest.approx(math.log(2))
    assert unigram_entropy(["a"] * 5) == 0.0
    assert mean_unigram_entropy([["a", "b"], ["c"] * 3]) == pytest.approx(math.log(2) / 2)
    assert distinct_n([["a", "b", "a", "b"]], 2) == pytest.approx(2 / 3)
    assert distinct_n([["a"]], 2) == 0.0


def test_topic_purity_tells_one_topic_per_sample_from_one_per_word():
    """Samples that keep to one topic read 1.0; words whose topics are drawn one by one from four
    read near the expected max share; samples with too few topic words are left out and counted."""
    topic_of = {f"{k}{i}": k for k in "abcd" for i in range(5)}
    assert topic_purity([["a1", "x", "a2", "a3"], ["c0", "c4"]], topic_of) == (1.0, 1.0)
    assert topic_purity([["a1", "b1", "a2", "x"]], topic_of)[0] == pytest.approx(2 / 3)
    assert topic_purity([["a1", "x"], ["b1", "b2"]], topic_of) == (1.0, 0.5)
    purity, share = topic_purity([["x", "y"]], topic_of)
    assert math.isnan(purity) and share == 0.0
    rng = np.random.default_rng(0)
    mixed = [[f"{k}0" for k in rng.choice(list("abcd"), size=8)] for _ in range(4000)]
    # E[max count / 8] for 8 draws from 4 equally likely topics, by simulation of the counts
    counts = np.stack([np.bincount(rng.integers(0, 4, 8), minlength=4) for _ in range(20000)])
    assert topic_purity(mixed, topic_of)[0] == pytest.approx(float((counts.max(1) / 8).mean()), abs=0.01)


def test_true_topic_share_reads_the_mass_on_the_targets_topic():
    """Tokens 0-1 topic 0, 2-3 topic 1, 4 none. A model that knows the topic reads 1; one that
    spreads evenly over the topic tokens reads 1 / 2; positions whose target is no topic token
    are left out."""
    topic_of_id = np.array([0, 0, 1, 1, -1])
    knows = np.array([[0.3, 0.2, 0.0, 0.0, 0.5], [0.0, 0.0, 0.1, 0.1, 0.8], [0.2, 0.2, 0.2, 0.2, 0.2]])
    assert true_topic_share(knows, np.array([1, 2, 4]), topic_of_id, 2) == (1.0, 1.0)
    even = np.full((2, 5), 0.2)
    share, right = true_topic_share(even, np.array([0, 3]), topic_of_id, 2)
    assert share == pytest.approx(0.5) and right == 0.5  # ties go to topic 0
    wrong = np.array([[0.0, 0.0, 0.6, 0.2, 0.2]])
    assert true_topic_share(wrong, np.array([0]), topic_of_id, 2) == (0.0, 0.0)
    assert all(math.isnan(x) for x in true_topic_share(even, np.array([4, 4]), topic_of_id, 2))


def test_pooled_entropy_ignores_reply_length_and_sees_repeated_replies():
    """Replies drawn from one 8-word distribution: the per-reply mean grows with reply length (it
    is at most log of the length), the pooled entropy does not; and ten copies of one reply read
    as diverse as that reply alone, where ten different replies read more."""
    rng = np.random.default_rng(0)
    p = np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.05, 0.05])
    exact = float(-(p * np.log(p)).sum())

    def replies(length):
        return [list(rng.choice(8, size=length, p=p)) for _ in range(2000)]

    short, long_ = replies(8), replies(32)
    assert mean_unigram_entropy(long_) - mean_unigram_entropy(short) > 0.3
    assert pooled_unigram_entropy(short) == pytest.approx(exact, abs=0.01)
    assert pooled_unigram_entropy(long_) == pytest.approx(exact, abs=0.01)
    one = short[0]
    assert pooled_unigram_entropy([one] * 10) == pytest.approx(unigram_entropy(one))
    assert pooled_unigram_entropy(short[:10]) > unigram_entropy(one) + 0.1
    assert math.isnan(pooled_unigram_entropy([[], []]))
    # at one length the per-sample entropy no longer follows the samples' lengths
    e8, share = prefix_unigram_entropy(short + long_, 8)
    assert share == 1.0 and e8 == pytest.approx(mean_unigram_entropy(short), abs=0.02)
    e32, share = prefix_unigram_entropy(short + long_, 32)
    assert share == 0.5 and e32 == pytest.approx(mean_unigram_entropy(long_))
    assert math.isnan(prefix_unigram_entropy([["a"]], 2)[0])


@pytest.fixture(scope="module")
def grammar():
    return SyntheticChat()


def test_exact_judge_scores_grammar_samples(grammar):
    judge = ExactJudge(grammar)
    texts = grammar.sample(64, seed=3)
    logp, n = judge.score(texts, [True] * len(texts))
    bare = grammar.log_prob(texts)
    np.testing.assert_allclose(logp, bare + math.log1p(-1e-3), atol=1e-6)
    ppl = generative_perplexity(judge, texts, [True] * len(texts))
    assert ppl == pytest.approx(math.exp(-logp.sum() / n.sum()))
    # shuffled words are much less likely: the judge separates good from bad text
    rng = np.random.default_rng(0)
    shuffled = [" ".join(["<user>"] + list(rng.permutation(t.split()[1:]))) for t in texts]
    assert generative_perplexity(judge, shuffled, [True] * len(texts)) > 3 * ppl


def test_exact_judge_is_finite_on_impossible_text(grammar):
    judge = ExactJudge(grammar)
    assert grammar.log_prob(["<assistant> <user>"])[0] == -np.inf
    logp, _ = judge.score(["<assistant> <user>", "<user> <assistant> hello"], [True, False])
    assert np.all(np.isfinite(logp))


def test_quality_pair(grammar):
    judge = ExactJudge(grammar)
    texts = grammar.sample(16, seed=1)
    q = quality(judge, texts, [True] * 16)
    assert q.gen_ppl > 1 and q.entropy > 0 and 0 < q.distinct_2 <= 1 and q.num_samples == 16


def test_model_judge_matches_manual_log_likelihood(tiny_model, tiny_model_cfg):
    graphdef, params = tiny_model

    class ToyTokenizer:
        bos_id, eos_id = 2, 1

        def encode(self, text):
            return [int(w) for w in text.split()]

    judge = ModelJudge(graphdef, params, ToyTokenizer(), max_len=32, batch_size=4)
    texts = ["5 6 7", "8 9 10 11 12"]
    logp, n = judge.score(texts, [True, False])
    forward = jax.jit(lambda p, x: jax.nn.log_softmax(nnx.merge(graphdef, p)(x)[0][0, :-1], axis=-1))
    for text, done, lp, count in zip(texts, [True, False], logp, n):
        ids = [2] + [int(w) for w in text.split()] + ([1] if done else [])
        ls = np.asarray(forward(params, jnp.asarray([ids])))
        manual = float(sum(ls[i, ids[i + 1]] for i in range(len(ids) - 1)))
        assert lp == pytest.approx(manual, abs=1e-4)
        assert count == len(ids) - 1


def test_exact_judge_conditional_reply_score(grammar):
    judge = ExactJudge(grammar, background_weight=0.0)
    infos = grammar.sample_with_info(8, seed=4)
    prompts = [i["prompt"] for i in infos]
    replies = [i["text"][len(i["prompt"]):].strip() for i in infos]
    lp, n = judge.score_replies(prompts, replies, [True] * 8)
    np.testing.assert_allclose(lp, grammar.conditional_log_prob(prompts, replies), atol=1e-8)
    assert np.all(n == [len(r.split()) + 1 for r in replies])
