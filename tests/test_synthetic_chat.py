"""Tests for the SyntheticChat grammar (exact likelihood judge) and its TFDS builder."""

import hashlib
import heapq
import itertools

import numpy as np
import pytest

from relf_jax.data.synthetic_chat import ASSISTANT, USER, GrammarConfig, SyntheticChat


@pytest.fixture(scope="module")
def grammar():
    return SyntheticChat()


@pytest.fixture(scope="module")
def tiny():
    return SyntheticChat(GrammarConfig.tiny())


@pytest.fixture(scope="module")
def medium():
    # Every mechanism on (syntax, 4 verbosity classes, 3 exchanges, phrases) but
    # small enough for the explicit, unfactored automaton.
    return SyntheticChat(GrammarConfig(num_topics=3, words_per_class=3, phrases_per_group=2,
                                       more_exchange_prob=(0.4, 0.5), unk_prob=0.02, seed=3))


@pytest.fixture(scope="module")
def infos(grammar):
    return grammar.sample_with_info(2000, seed=11)


def _shuffle_within_turns(text, rng):
    words = text.split()
    out, seg = [], []
    for w in words + [None]:
        if w in (USER, ASSISTANT, None):
            rng.shuffle(seg)
            out += seg
            seg = []
            if w is not None:
                out.append(w)
        else:
            seg.append(w)
    return " ".join(out)


def _ref_log_probs(g, hmm, texts):
    """Plain dense forward algorithm on the explicit automaton (reference), all texts at once:
    returns (complete, prefix) log-probabilities."""
    ids = [g.encode(t) for t in texts]
    n, steps = len(texts), max((len(x) for x in ids), default=0)
    logz = np.zeros(n)
    alive = np.array([len(x) > 0 for x in ids])
    a = np.zeros((n, hmm["init"].shape[0]))
    for j, x in enumerate(ids):
        if len(x):
            a[j] = hmm["init"] * hmm["emit"][:, x[0]]
    for t in range(1, steps):
        live = np.array([len(x) > t for x in ids]) & alive
        if not live.any():
            break
        s = a[live].sum(1)
        dead = np.flatnonzero(live)[s == 0]
        alive[dead] = False
        live &= alive
        s = a[live].sum(1)
        logz[live] += np.log(s)
        words = [ids[j][t] for j in np.flatnonzero(live)]
        a[live] = ((a[live] / s[:, None]) @ hmm["trans"]) * hmm["emit"][:, words].T
    with np.errstate(divide="ignore"):
        complete = np.where(alive, logz + np.log(a @ hmm["final"]), -np.inf)
        prefix = np.where(alive, logz + np.log(a.sum(1)), -np.inf)
    empty = np.array([len(x) == 0 for x in ids])
    return np.where(empty, -np.inf, complete), np.where(empty, 0.0, prefix)


def _brute_force(hmm, ids, prefix):
    """Sum over all state paths (emission-pruned DFS), no dynamic programming."""
    init, trans, emit, final = hmm["init"], hmm["trans"], hmm["emit"], hmm["final"]
    total = 0.0

    def rec(t, s, p):
        nonlocal total
        p = p * emit[s, ids[t]]
        if p == 0:
            return
        if t == len(ids) - 1:
            total += p * (1.0 if prefix else final[s])
            return
        for s2 in np.nonzero(trans[s] * emit[:, ids[t + 1]])[0]:
            rec(t + 1, s2, p * trans[s, s2])

    for s in np.nonzero(init)[0]:
        rec(0, s, init[s])
    return np.log(total) if total > 0 else -np.inf


# ----------------------------------------------------------------- structure
def test_sizes_and_docs(grammar):
    assert 300 <= len(grammar.vocab) <= 500
    assert grammar.vocab[:3] == ["<unk>", USER, ASSISTANT]
    assert len(set(grammar.vocab)) == len(grammar.vocab)
    assert grammar.topics[:2] == ["weather", "food"] and len(grammar.topics) == 8
    assert grammar.R == len(grammar.state_names)


def test_explicit_automaton_is_normalised(medium, tiny):
    for g in (medium, tiny):
        h = g.explicit_hmm()
        np.testing.assert_allclose(h["init"].sum(), 1.0, atol=1e-12)
        np.testing.assert_allclose(h["trans"].sum(1) + h["final"], 1.0, atol=1e-12)
        np.testing.assert_allclose(h["emit"].sum(1), 1.0, atol=1e-12)
        assert (h["trans"] >= 0).all() and (h["final"] >= 0).all()


# ------------------------------------------------------------------- scoring
def test_samples_finite_and_shuffles_lower(grammar):
    texts = grammar.sample(400, seed=5)
    lp = grammar.log_prob(texts)
    assert lp.dtype == np.float64 and lp.shape == (400,)
    assert np.isfinite(lp).all()
    rng = np.random.default_rng(0)
    shuf = [_shuffle_within_turns(t, rng) for t in texts]
    changed = np.array([a != b for a, b in zip(texts, shuf)])
    assert changed.sum() > 250
    lps = grammar.log_prob(shuf)
    assert np.isfinite(lps).all()  # markers kept in place: possible (noise states), but worse
    d = (lp - lps)[changed]
    assert d.mean() > 5.0
    assert (d > 0).mean() > 0.85
    # Shuffling everything moves the markers: impossible (or at least lower).
    full = [" ".join(rng.permutation(t.split())) for t in texts[:100]]
    lpf = grammar.log_prob(full)
    keep = np.array([a != b for a, b in zip(texts[:100], full)])
    assert (lpf[keep] < lp[:100][keep]).all()


def test_tiny_grammar_enumeration_sums_to_one(tiny):
    """Best-first enumeration of prefixes: every expanded prefix satisfies
    P_prefix(x) == P(x) + sum_w P_prefix(x w), and the complete strings found
    carry > 99% of the mass (never more than 1)."""
    words = tiny.vocab
    heap = [(-1.0, "")]
    complete, expanded, worst = 0.0, 0, 0.0
    while complete < 0.99 and heap and expanded < 30000:
        batch = [heapq.heappop(heap) for _ in range(min(1024, len(heap)))]
        prefixes = [p for _, p in batch]
        pp = np.array([-q for q, _ in batch])
        cand = [(p + " " + w).strip() for p in prefixes for w in words]
        child = np.exp(tiny.log_prob(cand, prefix=True)).reshape(len(prefixes), len(words))
        fin = np.exp(tiny.log_prob(prefixes))
        worst = max(worst, float(np.max(np.abs(child.sum(1) + fin - pp) / pp)))
        complete += fin.sum()
        expanded += len(prefixes)
        for c, q in zip(cand, child.ravel()):
            if q > 0:
                heapq.heappush(heap, (-q, c))
    assert worst < 1e-9
    assert 0.99 < complete <= 1.0 + 1e-9
    # the unexpanded frontier holds exactly the rest of the mass
    np.testing.assert_allclose(complete + sum(-q for q, _ in heap), 1.0, atol=1e-9)


def test_log_prob_matches_brute_force_path_sum(tiny):
    h = tiny.explicit_hmm()
    texts = tiny.sample(40, seed=1)
    texts = sorted(set(texts), key=len)[:6]
    extra = [
        "<user> thing briefly <assistant> rain",
        "<user> rain zzz briefly <assistant> rain <unk> rain",
        "<user> hi rain describe please <assistant> sure rain",
        "<user> rain briefly <assistant> rain <user> rain describe <assistant> rain hope that helps",
        "<user> rain briefly <assistant> recipe",  # topic switch: impossible (no leak)
        "<user> rain <assistant> rain",  # no cue word: impossible
    ]
    for text in texts + extra:
        ids = tiny.encode(text)
        for prefix in (False, True):
            want = _brute_force(h, ids, prefix)
            got = tiny.log_prob([text], prefix=prefix)[0]
            if np.isinf(want):
                assert got == want, text
            else:
                np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10, err_msg=text)


def test_matches_dense_forward_on_medium_grammar(medium):
    """Fast sparse forward (incl. folded <unk> runs) == plain dense forward on
    the explicit automaton, on samples and corrupted samples."""
    h = medium.explicit_hmm()
    rng = np.random.default_rng(0)
    texts = medium.sample(24, seed=2)
    cases = list(texts)
    for t in texts[:10]:
        w = t.split()
        for rate in (0.1, 0.5):
            cases.append(" ".join(x if (i == 0 or rng.random() > rate) else "qqq" for i, x in enumerate(w)))
        cases.append(" ".join(w[: max(1, len(w) // 2)] + ["zz", "zz", "zz"]))  # ends in an <unk> run
        cases.append(" ".join(w[:3] + ["qq"] * 12 + w[3:]))  # a long run
        cases.append(" ".join(rng.permutation(w)))
    cases += ["", "   ", "<user>", "<user> zz", "zz <user>", " ".join(texts[:4])]
    for prefix, want in zip((False, True), _ref_log_probs(medium, h, cases)):
        got = medium.log_prob(cases, prefix=prefix)
        assert np.array_equal(np.isneginf(got), np.isneginf(want))
        fin = np.isfinite(want)
        assert fin.sum() > 40
        np.testing.assert_allclose(got[fin], want[fin], rtol=1e-9, atol=1e-9)


def test_conditional_log_prob(grammar, infos):
    sub = infos[:64]
    prompts = [d["prompt"] for d in sub]
    conts = [d["text"][len(d["prompt"]) + 1:] for d in sub]
    for prefix in (False, True):
        got = grammar.conditional_log_prob(prompts, conts, prefix=prefix)
        joint = grammar.log_prob([p + " " + c for p, c in zip(prompts, conts)], prefix=prefix)
        want = joint - grammar.log_prob(prompts, prefix=True)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-9)
        assert np.all(got <= 1e-9)
    # a reply is more likely after its own prompt than after a prompt on another topic
    def n_topic(d, key):
        return sum(w in grammar.topic_words[d["topic"]] for w in d[key].split())

    pairs = [(d, e) for d, e in itertools.pairwise(infos[:601]) if d["topic"] != e["topic"]
             and n_topic(d, "reply") >= 2 and n_topic(d, "prompt") >= 1 and n_topic(e, "prompt") >= 1]
    replies = [d["reply"] for d, _ in pairs]
    own = grammar.conditional_log_prob([d["prompt"] for d, _ in pairs], replies, prefix=True)
    other = grammar.conditional_log_prob([e["prompt"] for _, e in pairs], replies, prefix=True)
    assert len(pairs) > 100 and (own > other).mean() > 0.97
    assert np.isnan(grammar.conditional_log_prob(["hello there"], ["<user>"])[0])


def test_empty_and_impossible_texts(grammar):
    lp = grammar.log_prob(["", "   ", "rain <user>", "<assistant> hi", "<user>"])
    assert np.isneginf(lp).all()
    pre = grammar.log_prob(["", "  ", "<user>", "rain"], prefix=True)
    np.testing.assert_allclose(pre[:3], 0.0, atol=1e-12)
    assert np.isneginf(pre[3])
    one = "<user> rain briefly <assistant> rain"
    assert np.isfinite(grammar.log_prob([one]))[0]
    assert np.isfinite(grammar.log_prob([" ".join([one] * 3)]))[0]
    assert np.isneginf(grammar.log_prob([" ".join([one] * 4)]))[0]  # max 3 exchanges
    np.testing.assert_array_equal(grammar.num_words([one, ""]), [6, 1])
    np.testing.assert_array_equal(grammar.num_words([one, ""], prefix=True), [5, 0])


def test_unknown_word_scores_finite_but_lower(grammar, infos):
    orig, bad = [], []
    for d in infos[:200]:
        words = d["text"].split()
        a = words.index(ASSISTANT)
        pos = [i for i in range(a + 1, len(words)) if words[i] in grammar.topic_words[d["topic"]]]
        if pos:
            orig.append(d["text"])
            bad.append(" ".join(words[: pos[0]] + ["xyzzyplugh"] + words[pos[0] + 1:]))
    assert len(orig) > 50
    lp, lpb = grammar.log_prob(orig), grammar.log_prob(bad)
    assert np.isfinite(lpb).all() and (lpb < lp).all()
    np.testing.assert_allclose(lpb, grammar.log_prob([b.replace("xyzzyplugh", "<unk>") for b in bad]))


def test_log_prob_of_long_prefixes_in_one_batch(grammar):
    """256 texts cut at 300 words (mid-turn: prefix=True) score in one call, all finite. How fast
    is a benchmark's question, not a test's."""
    texts = [t for t in grammar.sample(8000, seed=3) if len(t.split()) >= 300]
    texts = [" ".join(t.split()[:300]) for t in texts][:256]
    assert len(texts) == 256
    lp = grammar.log_prob(texts, prefix=True)
    assert lp.shape == (256,) and np.isfinite(lp).all()


# ------------------------------------------------------------------ sampling
def test_sampler_matches_log_prob(tiny):
    texts = tiny.sample(20000, seed=4)
    uniq, counts = np.unique(texts, return_counts=True)
    top = np.argsort(-counts)[:12]
    p = np.exp(tiny.log_prob(list(uniq[top])))
    freq = counts[top] / len(texts)
    sigma = np.sqrt(p * (1 - p) / len(texts))
    assert np.all(np.abs(freq - p) < 5 * sigma + 1e-4), (freq, p)


def test_sample_with_info_consistent(grammar, infos):
    texts = grammar.sample(2000, seed=11)
    assert texts == [d["text"] for d in infos]
    for d in infos[:200]:
        assert d["text"].startswith(d["prompt"] + " " + d["reply"])
        assert d["prompt"].startswith(USER) and d["prompt"].endswith(ASSISTANT)
        assert d["reply_len"] == len(d["reply"].split()) >= 1
        assert d["text"].split().count(USER) == d["num_exchanges"] == len(d["verbosities"])
        assert d["verbosity"] == d["verbosities"][0]
        assert "  " not in d["text"]
    nex = np.array([d["num_exchanges"] for d in infos])
    assert set(nex.tolist()) == {1, 2, 3}
    assert abs((nex >= 2).mean() - 0.35) < 0.04  # more_exchange_prob = (0.35, 0.3)
    assert abs((nex == 3).sum() / (nex >= 2).sum() - 0.3) < 0.08


def test_verbosity_words_shape_reply_length(grammar, infos):
    cue_class = {w: v for v, ws in enumerate(grammar.verbosity_cues) for w in ws}
    by_class = {v: [] for v in range(4)}
    for d in infos:
        cls = [cue_class[w] for w in d["prompt"].split() if w in cue_class]
        if len(cls) == 1:
            by_class[cls[0]].append(d["reply_len"])
    means = [np.mean(by_class[v]) for v in range(4)]
    assert all(len(by_class[v]) > 100 for v in range(4))
    assert means[0] < means[1] < means[2] < means[3]
    assert means[3] > 5 * means[0] and means[2] > 5 * means[0]
    # the latent class itself
    lat = np.array([d["verbosity"] for d in infos])
    lens = np.array([d["reply_len"] for d in infos])
    assert lens[lat == 3].mean() > 30 * lens[lat == 0].mean()


def test_reply_topic_words_match_topic(grammar, infos):
    good = total = 0
    for d in infos:
        counts = [sum(w in tw for w in d["reply"].split()) for tw in grammar.topic_words]
        if sum(counts) >= 3:
            total += 1
            good += int(np.argmax(counts) == d["topic"])
    assert total > 500
    assert good / total > 0.95


def test_reply_lengths_heavy_tailed(infos):
    lens = np.array([d["reply_len"] for d in infos])
    assert lens.max() > 150
    assert np.median(lens) < 30
    assert lens.min() <= 2
    assert (lens > 100).mean() > 0.02


def test_formulaic_phrases_are_deterministic_chains(grammar):
    pre = grammar.conditional_log_prob(["<user> rain explain <assistant> rain let me know if you need"],
                                       ["anything else"], prefix=True)[0]
    assert pre > -0.01  # only the unk / noise probability is missing
    # a misplaced known word is possible (noise state) but costly; markers are strict
    ok = "<user> rain explain <assistant> rain let me know if you need anything else"
    bad = "<user> rain explain <assistant> rain let me know if you anything need else"
    lp_ok, lp_bad = grammar.log_prob([ok, bad])
    assert np.isfinite(lp_bad) and lp_bad < lp_ok - 10
    skeleton = "<user> helps helps <assistant> i i <user> example <assistant> hope"
    assert np.isfinite(grammar.log_prob([skeleton]))[0]
    for broken in ("<user> <assistant> rain", "<user> rain <assistant>", "<user> rain <user> rain",
                   "<assistant> rain", "<user> rain <assistant> rain <assistant> rain"):
        assert np.isneginf(grammar.log_prob([broken]))[0], broken


def test_determinism_and_topic_restriction(grammar):
    a = grammar.sample(50, seed=7)
    assert a == grammar.sample(50, seed=7)
    assert a != grammar.sample(50, seed=8)
    info = grammar.sample_with_info(300, seed=9, topics=[2, 5])
    assert {d["topic"] for d in info} == {2, 5}
    other = set().union(*(grammar.topic_words[k] for k in (0, 1, 3, 4, 6, 7)))
    own = grammar.topic_words[2] | grammar.topic_words[5]
    words = [w for d in info for w in d["text"].split()]
    assert sum(w in own for w in words) > 10 * sum(w in other for w in words)
    with pytest.raises(ValueError):
        grammar.sample(3, seed=0, topics=[8])
    g2 = SyntheticChat(GrammarConfig(seed=1))
    assert g2.vocab == grammar.vocab and g2.sample(50, seed=7) != a


def test_corpus_is_pinned(grammar):
    # The corpus every checkpoint and benchmark was trained on: a refactor must keep it byte-identical
    # (a deliberate change of the language updates these digests and says so).
    def digest(texts):
        return hashlib.sha256("\n".join(texts).encode()).hexdigest()

    assert digest(grammar.sample(200, seed=0)) == (
        "29697caf100324b38f216d5b4cc6f580608ef82183d6299140e6457e01b606b8")
    assert digest(SyntheticChat(GrammarConfig(seed=1)).sample(50, seed=3, topics=[2, 5])) == (
        "b7b545f4ac11d7675d5a0f99c492caad2026dc2973012557be0f776285966ca9")


# ---------------------------------------------------------------------- TFDS
def test_tfds_builder(tmp_path):
    from relf_jax.data.builders.synthetic_chat import SyntheticChatBuilder, build

    builder = build(str(tmp_path), num_train=300, num_validation=40, seed=2, topics=[1])
    assert isinstance(builder, SyntheticChatBuilder) and builder.name == "synthetic_chat"
    assert "n300_v40_s2_t1" in str(builder.data_dir)
    train = builder.as_data_source("train")
    val = builder.as_data_source("validation")
    assert len(train) == 300 and len(val) == 40
    rec = train[0]["text"]
    text = rec.decode() if isinstance(rec, bytes) else rec
    assert text.startswith(USER)
    g = SyntheticChat(GrammarConfig(seed=2))
    train_texts = {(r["text"].decode() if isinstance(r["text"], bytes) else r["text"]) for r in train}
    val_texts = [(r["text"].decode() if isinstance(r["text"], bytes) else r["text"]) for r in val]
    assert np.isfinite(g.log_prob(val_texts)).all()
    assert len(set(val_texts) - train_texts) > 20  # held out (short ones may repeat)
    food = g.topic_words[1]
    assert sum(w in food for t in val_texts for w in t.split()) > 20
    again = build(str(tmp_path), num_train=300, num_validation=40, seed=2, topics=[1])
    assert again.data_dir == builder.data_dir and len(again.as_data_source("train")) == 300
