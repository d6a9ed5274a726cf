"""The corpus n-gram draft: its counts, its back-off, and exact speculative sampling with it."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from relf_jax.errors import UserError
from relf_jax.sampling import autoregressive as ar
from relf_jax.speculative import generate as spec
from relf_jax.speculative.ngram_draft import NgramDraft, build_ngram_draft, next_logits
from relf_jax.speculative.proposers import ngram_table


@jax.jit  # one program per table layout, not one per operation
def _softmax_next(table, context, valid):
    return jax.nn.softmax(next_logits(table, context, valid))


def _probs(table, context, valid):
    return np.asarray(_softmax_next(table, jnp.asarray(context), jnp.asarray(valid)))


def test_counts_back_off_and_unigram():
    rows = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [5]]
    table = build_ngram_draft(rows, 6, order=3, top_m=2)
    np.testing.assert_allclose(_probs(table, [[1, 2]], [2])[0], [0, 0, 0, 2 / 3, 1 / 3, 0], atol=1e-6)
    # (5, 2) was never seen: back off to the context (2,)
    np.testing.assert_allclose(_probs(table, [[5, 2]], [2])[0], [0, 0, 0, 2 / 3, 1 / 3, 0], atol=1e-6)
    # only one token of context exists: (1,) -> 2 always
    np.testing.assert_allclose(_probs(table, [[0, 1]], [1])[0], [0, 0, 1, 0, 0, 0], atol=1e-6)
    # nothing known: the unigram's top 2 (1 and 2 seen 3 times each), renormalised
    np.testing.assert_allclose(_probs(table, [[5, 5]], [2])[0], [0, 0.5, 0.5, 0, 0, 0], atol=1e-6)
    np.testing.assert_allclose(_probs(table, [[1, 2]], [0])[0], [0, 0.5, 0.5, 0, 0, 0], atol=1e-6)


def test_matches_a_brute_force_count():
    rng = np.random.default_rng(0)
    vocab, order, top_m = 23, 4, 3
    rows = [rng.integers(0, 6 if i % 2 else vocab, rng.integers(1, 40)).tolist() for i in range(60)]
    table = build_ngram_draft(rows, vocab, order=order, top_m=top_m, min_count=2)
    counts = collections.defaultdict(collections.Counter)
    for r in rows:
        for i in range(len(r)):
            for c in range(0, order):
                if i - c >= 0:
                    counts[tuple(r[i - c:i])][r[i]] += 1

    def expected(ctx):
        for c in range(len(ctx), -1, -1):
            cnt = counts.get(tuple(ctx[len(ctx) - c:]))
            if cnt and (c == 0 or sum(cnt.values()) >= 2):
                top = sorted(cnt.items(), key=lambda kv: (-kv[1], kv[0]))[:top_m]
                p = np.zeros(vocab)
                for t, n in top:
                    p[t] = n
                return p / p.sum()

    contexts = [r[i - order + 1:i] for r in rows for i in range(order - 1, len(r))][:200]
    contexts += [rng.integers(0, vocab, order - 1).tolist() for _ in range(50)]
    got = _probs(table, contexts, [order - 1] * len(contexts))
    for ctx, g in zip(contexts, got):
        np.testing.assert_allclose(g, expected(ctx), atol=1e-6, err_msg=str(ctx))


def test_save_load_round_trip_and_errors(tmp_path):
    table = build_ngram_draft([[1, 2, 3, 1, 2, 4]], 8, order=3, top_m=4)
    path = str(tmp_path / "t.npz")
    table.save(path)
    back = NgramDraft.load(path)
    assert back.vocab_size == 8 and back.order == 3 and back.top_m == 4
    for a, b in zip(jax.tree.leaves(table), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(UserError, match="order"):
        build_ngram_draft([[1, 2]], 8, order=1)
    with pytest.raises(UserError, match="token ids"):
        build_ngram_draft([[1, 9]], 8)
    with pytest.raises(UserError, match="at least one"):
        build_ngram_draft([], 8)


def _table_for(vocab, seed=0):
    rng = np.random.default_rng(seed)
    # skewed rows over part of the vocabulary: q differs from the target and is 0 on many tokens
    return build_ngram_draft([rng.integers(0, 2 * vocab // 3, 30).tolist() for _ in range(400)], vocab, order=3,
                             top_m=25)


def test_generate_errors_and_greedy_equals_greedy_ar(tiny_model, tiny_model_cfg):
    tg, tp = tiny_model
    prompts, lens = ar.pad_prompts([[2, 5, 6, 7, 5, 6], [2, 9]])
    settings = spec.SpecSettings(k=3, rule="greedy", proposer="corpus_ngram", max_new_tokens=10, eos_id=-1)
    with pytest.raises(UserError, match="NgramDraft"):
        spec.generate(tg, tp, prompts, lens, jax.random.key(0), spec.SpecParams.make(1.0), settings)
    with pytest.raises(UserError, match="covers"):
        spec.generate(tg, tp, prompts, lens, jax.random.key(0), spec.SpecParams.make(1.0), settings,
                      draft_params=_table_for(tiny_model_cfg.vocab_size + 1))
    state = spec.generate(tg, tp, prompts, lens, jax.random.key(0), spec.SpecParams.make(1.0), settings,
                          draft_params=_table_for(tiny_model_cfg.vocab_size))
    want = ar.replies(ar.generate(tg, tp, prompts, lens, jax.random.key(0), ar.TracedSampling.make(0.0),
                                  ar.DecodeSettings(max_new_tokens=10, eos_id=-1)), lens)
    toks, lengths = np.asarray(state.tokens), np.asarray(state.lengths)
    assert [toks[i, int(lens[i]):int(lengths[i])].tolist() for i in range(2)] == want


def test_sparse_and_scattered_verification_give_the_same_replies(tiny_model, tiny_model_cfg, monkeypatch):
    """`generate` verifies the table's drafts on their candidates (`verify_sparse`) unless the
    Pallas kernel runs, which gets them scattered over the vocabulary: the same replies. This
    checks the wiring of both paths; on this random tiny target most drafts are settled by the
    nucleus or the off-candidate residual whatever q's values, so the decisions themselves are
    pinned by `test_verify.py::test_sparse_candidates_decide_exactly_like_their_scattered_logits`."""
    tg, tp = tiny_model
    prompts, lens = ar.pad_prompts([[2, 5, 6, 7, 5, 6], [2, 9], [2, 6, 5]])
    table = _table_for(tiny_model_cfg.vocab_size)
    runs, scattered = {}, []
    for sparse in (True, False):
        if not sparse:  # as where the kernel runs (use_kernel=False: another compiled program, same verifier)
            monkeypatch.setattr(spec, "sparse_verify", lambda settings: False)
            propose = ngram_table.propose
            monkeypatch.setattr(ngram_table, "propose", lambda *a: scattered.append(1) or propose(*a))
        for rule, temperature in (("nsd", 1.0), ("standard", 1.0)):
            settings = spec.SpecSettings(k=3, rule=rule, proposer="corpus_ngram", max_new_tokens=24, eos_id=-1,
                                         use_kernel=None if sparse else False)
            state = spec.generate(tg, tp, prompts, lens, jax.random.key(4), spec.SpecParams.make(temperature),
                                  settings, draft_params=table)
            runs[sparse, rule] = np.asarray(state.tokens)
    assert scattered  # the second pass traced the scattered path
    for rule in ("nsd", "standard"):
        np.testing.assert_array_equal(runs[True, rule], runs[False, rule])


def test_standard_rule_with_the_ngram_draft_samples_the_target(tiny_model, tiny_model_cfg):
    """Tokens 2 and 3 of the reply (decided by verification of n-gram drafts) follow the target's
    own marginals: a chi-square test against p(y) = sum_x p(x) p(y | x), and likewise for z."""
    from scipy import stats

    tg, tp = tiny_model
    v = tiny_model_cfg.vocab_size
    prompt = [2, 5, 6]
    n = 6000
    prompts, lens = ar.pad_prompts([prompt] * n)
    settings = spec.SpecSettings(k=2, rule="standard", proposer="corpus_ngram", max_new_tokens=3, eos_id=-1)
    # the table counts the target's own samples, truncated to 4 tokens per context: q is close to
    # p on its top tokens and 0 elsewhere, so both acceptances and residual draws happen
    few, few_lens = ar.pad_prompts([prompt] * 300)
    rows = ar.replies(ar.generate(tg, tp, few, few_lens, jax.random.key(9), ar.TracedSampling.make(1.0),
                                  ar.DecodeSettings(max_new_tokens=12, eos_id=-1)), few_lens)
    table = build_ngram_draft([prompt + r for r in rows], v, order=3, top_m=4)
    state = spec.generate(tg, tp, prompts, lens, jax.random.key(3), spec.SpecParams.make(1.0), settings,
                          draft_params=table)
    toks = np.asarray(state.tokens)[:, len(prompt):len(prompt) + 3]
    assert 0.2 < spec.stats(state)["mean_accepted"] < 1.8  # drafts get accepted and rejected

    @jax.jit  # one program per shape (op by op, the forward compiled each of its ops)
    def next_token_probs(params, seqs):
        logits = nnx.merge(tg, params)(seqs, jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape))
        logits = logits[0] if isinstance(logits, tuple) else logits
        return jax.nn.softmax(logits[:, -1].astype(jnp.float32))

    def dist(seqs):
        return np.asarray(next_token_probs(tp, jnp.asarray(seqs, jnp.int32)), np.float64)

    px = dist([prompt])[0]
    py_x = dist([prompt + [x] for x in range(v)])  # [x, y]
    py = px @ py_x
    pairs = [prompt + [x, y] for x in range(v) for y in range(v)]
    pz = (px[:, None] * py_x).reshape(-1) @ dist(pairs)
    for obs_tokens, p in ((toks[:, 1], py), (toks[:, 2], pz)):
        obs = np.bincount(obs_tokens, minlength=v).astype(float)
        exp = p * n
        chi2 = float(np.sum((obs - exp) ** 2 / exp))
        assert stats.chi2.sf(chi2, v - 1) > 1e-4, chi2


def test_drafts_follow_the_transformed_draft_logits():
    """The proposer samples over a context's M candidates; its tokens must follow the
    distribution the verifier is given (the returned [B, K, V] logits after the same
    temperature / top-p transform): Monte Carlo histograms within a few standard errors, and
    greedy picks the lowest id among equally frequent candidates, as an argmax over V does. A
    draft temperature scale of 0.5 squares the table's probabilities (renormalised)."""
    import types

    from relf_jax.sampling import processors

    rows = [[1, 2, 3], [1, 2, 4], [1, 2, 3], [1, 2, 5], [1, 2, 4], [1, 2, 6], [2, 5, 4], [2, 5, 4]]
    table = build_ngram_draft(rows, 8, order=3, top_m=4)
    state = types.SimpleNamespace(tokens=jnp.asarray([[1, 2, 0, 0]], jnp.int32), lengths=jnp.asarray([2]))
    n = 20_000
    qs = {}
    for temperature, top_p, scale in ((1.0, 1.0, 1.0), (0.7, 0.8, 1.0), (1.6, 0.9, 1.0), (1.0, 1.0, 0.5)):
        sp = spec.SpecParams.make(temperature, top_p, 0.9, draft_temperature_scale=scale)
        settings = spec.SpecSettings(k=2, rule="standard", proposer="corpus_ngram", max_new_tokens=4, eos_id=-1)
        draw = jax.jit(jax.vmap(
            lambda key, sp=sp, settings=settings: ngram_table.propose(table, state, sp, settings, key)))
        toks, logits = draw(jax.random.split(jax.random.key(1), n))
        q = np.exp(np.asarray(jax.jit(processors.log_probs, static_argnums=(1, 2, 3))(
            logits[0, 0, 0], temperature, 0, top_p)), dtype=np.float64)
        freq = np.bincount(np.asarray(toks[:, 0, 0]), minlength=8) / n
        se = np.sqrt(q * (1 - q) / n) + 1e-12
        assert np.all(np.abs(freq - q) <= 5 * se + 1e-9), (temperature, top_p, scale, freq, q)
        assert q[3] > 0.2 and q[4] > 0.2  # the context (1, 2): 3 and 4 each seen twice
        qs[scale, temperature] = q
    plain = qs[1.0, 1.0]
    np.testing.assert_allclose(qs[0.5, 1.0], plain ** 2 / np.sum(plain ** 2), atol=1e-5)
    greedy = jax.jit(lambda key: ngram_table.propose(  # jitted: op by op it compiles ~40 programs
        table, state, spec.SpecParams.make(0.0, 1.0, 0.9),
        spec.SpecSettings(k=1, rule="greedy", proposer="corpus_ngram", max_new_tokens=4, eos_id=-1), key))(
        jax.random.key(0))[0]
    assert int(greedy[0, 0]) == 3  # 3 and 4 tie at two counts each: the lower id, as argmax over V


def test_dense_index_finds_the_same_rows_as_the_binary_search():
    from relf_jax.speculative import ngram_draft

    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 4 if i % 3 else 40, rng.integers(1, 30)).tolist() for i in range(80)]
    table = build_ngram_draft(rows, 40, order=4, top_m=3)
    # c = 1, 2 fit a direct index; c = 3's hashed keys wrap, so it keeps the binary search
    assert [int(d.shape[0]) for d in table.dense] == [40, 1600, 0]
    searched = table.replace(dense=())
    ctx = jnp.asarray(np.r_[rng.integers(0, 4, (300, 3)), rng.integers(0, 40, (300, 3))], jnp.int32)
    valid = jnp.asarray(rng.integers(0, 4, 600), jnp.int32)
    candidates = jax.jit(ngram_draft.next_candidates)
    for a, b in zip(candidates(table, ctx, valid), candidates(searched, ctx, valid)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int((np.asarray(table.dense[1]) >= 0).sum()) == int(table.keys[1].shape[0])
