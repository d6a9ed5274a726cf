"""Speculative verification rules: exactness, the NSD identity, greedy, floors, precision."""

import functools
import importlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import verify as verify_kernels
from relf_jax.sampling import processors
from relf_jax.speculative import RULES, VerifyResult, verify
from relf_jax.speculative.verify import output_distribution

verify_module = importlib.import_module("relf_jax.speculative.verify")

# Fixed tiny problem: K = 2 drafts over V = 6 tokens; the draft is far enough from the target
# that sampling from p instead of the residual (or any other slip) is visible.
V, K = 6, 2
TARGET = np.array([[2.0, 1.2, 0.3, -0.4, 0.9, -1.5],
                   [0.1, 1.8, -0.7, 0.6, 1.1, -0.2],
                   [-0.3, 0.4, 1.6, 0.2, -1.0, 0.8]], np.float32)  # [K+1, V]
DRAFT = np.array([[0.5, 2.2, 0.1, 0.8, -0.6, 0.4],
                  [1.4, 0.2, -0.1, 1.7, 0.3, 0.5]], np.float32)  # [K, V]


_log_probs = jax.jit(processors.log_probs)  # one compilation per shape, not one per op


def _dist(logits, temperature=1.0, top_p=1.0):
    """float64 probabilities after the shared transform, renormalised exactly."""
    p = np.exp(np.asarray(_log_probs(jnp.asarray(logits), temperature, 0, top_p), np.float64))
    return p / p.sum(axis=-1, keepdims=True)


def _nucleus(p, top_p):
    return np.asarray(processors.nucleus_mask(jnp.asarray(p, jnp.float32), top_p))


def _tv(a, b):
    return 0.5 * np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).sum()


def _expected_tv(p, n):
    """E[TV(empirical, p)] of an exact sampler with n draws (normal approximation per bin)."""
    p = np.asarray(p, np.float64)
    return 0.5 * np.sum(np.sqrt(2.0 * p * (1.0 - p) / (np.pi * n)))


@functools.partial(jax.jit, static_argnames=("rule",))
def _ref_jit(target, draft, tokens, uniforms, exponentials, temperature, top_p, *, rule):
    return verify_kernels.ref_verify(
        target, draft, tokens, uniforms, exponentials, rule=rule, temperature=temperature,
        top_p=top_p, log_probs_fn=processors.log_probs)


def _ref(target, draft, tokens, uniforms, exponentials, rule, temperature, top_p=1.0):
    """The reference path exactly as `verify` calls it, with hand-made noise."""
    return _ref_jit(jnp.asarray(target), jnp.asarray(draft), jnp.asarray(tokens, jnp.int32),
                    jnp.asarray(uniforms, jnp.float32), jnp.asarray(exponentials, jnp.float32),
                    temperature, top_p, rule=rule)


# ----------------------------------------------------------------------------- exactness


def test_standard_rule_is_exact_by_enumeration():
    """Enumerating every draft pair: first token ~ p_0, second (given acceptance) ~ p_1."""
    p = _dist(TARGET, 1.3, top_p=0.9)  # top-p leaves zeros in p: the residual must cope
    q = _dist(DRAFT, 1.3, top_p=0.9)
    assert (p == 0).any() and (q == 0).any()
    accept = np.minimum(1.0, np.divide(p[:K], q, out=np.ones_like(q), where=q > 0))  # [K, V]
    residual = np.maximum(p[:K] - q, 0.0)
    residual /= residual.sum(axis=-1, keepdims=True)

    first = np.zeros(V)
    second_given_accepted = np.zeros(V)
    joint = np.zeros((V, V))  # first two emitted tokens; a rejection at 0 ends the round
    accepted_mass = 0.0
    for x1, x2 in itertools.product(range(V), repeat=2):
        w = q[0, x1] * q[1, x2]
        a1, a2 = accept[0, x1], accept[1, x2]
        emitted_1 = a1 * np.eye(V)[x1] + (1 - a1) * residual[0]
        emitted_2 = a2 * np.eye(V)[x2] + (1 - a2) * residual[1]
        first += w * emitted_1
        second_given_accepted += w * a1 * emitted_2
        accepted_mass += w * a1
        # After a rejection at 0 the next round starts at position 1, whose first token ~ p_1.
        joint += w * (a1 * np.outer(np.eye(V)[x1], emitted_2)
                      + (1 - a1) * np.outer(residual[0], p[1]))
    np.testing.assert_allclose(first, p[0], atol=1e-12)
    np.testing.assert_allclose(second_given_accepted / accepted_mass, p[1], atol=1e-12)
    np.testing.assert_allclose(joint, np.outer(p[0], p[1]), atol=1e-12)
    np.testing.assert_allclose(output_distribution(p[0], q[0], "standard"), p[0], atol=1e-12)


def test_implementation_accepts_with_probability_min_one_p_over_q():
    """verify's test u * q(x) < p(x) switches exactly at u = min(1, p/q), for every token x."""
    settings = {"rule": "standard", "temperature": 1.3, "top_p": 0.9}
    p = np.exp(np.asarray(_log_probs(TARGET, 1.3, 0, 0.9)))
    q = np.exp(np.asarray(_log_probs(DRAFT, 1.3, 0, 0.9)))
    tokens = np.repeat(np.arange(V)[:, None], K, axis=1)  # row x drafts x at both positions
    ratio = np.divide(p[:K], q, out=np.full_like(q, np.inf), where=q > 0).T  # [V, K]
    below = np.where(ratio < 1, ratio * (1 - 1e-4), 0.999)
    above = np.where(ratio < 1, np.minimum(ratio * (1 + 1e-4), 0.99999), 0.99999)
    e = np.ones((V, V))
    tgt, drf = np.broadcast_to(TARGET, (V, K + 1, V)), np.broadcast_to(DRAFT, (V, K, V))
    acc_below = np.asarray(_ref(tgt, drf, tokens, below, e, **settings)[2])
    acc_above = np.asarray(_ref(tgt, drf, tokens, above, e, **settings)[2])
    np.testing.assert_array_equal(acc_below, p[:K].T > 0)
    np.testing.assert_array_equal(acc_above, (ratio >= 1) & (p[:K].T > 0))
    assert (acc_below != acc_above).any() and (p[:K] == 0).any()


def test_emitted_token_comes_from_the_residual_and_bonus_from_p_last():
    """With E_y ~ 0 the race picks y iff y has weight: the residual's support, never p's."""
    settings = {"rule": "standard", "temperature": 1.0}
    p = _dist(TARGET)
    q = _dist(DRAFT)
    x = int(np.argmax(q[0] - p[0]))  # p/q < 1: rejected when u is close to 1
    tgt, drf = np.broadcast_to(TARGET, (V, K + 1, V)), np.broadcast_to(DRAFT, (V, K, V))
    e = np.where(np.eye(V) > 0, 1e-30, 1.0)  # row y favours token y
    reject = _ref(tgt, drf, np.full((V, K), x), np.full((V, K), 0.99999), e, **settings)
    np.testing.assert_array_equal(reject[0], 0)
    residual_support = np.maximum(p[0] - q[0], 0) > 0
    assert residual_support.sum() < V  # otherwise the check below is vacuous
    for y in range(V):
        got = int(reject[1][y])
        assert residual_support[got]
        assert (got == y) == residual_support[y]
    accept_all = _ref(tgt, drf, np.full((V, K), x), np.zeros((V, K)), e, **settings)
    np.testing.assert_array_equal(accept_all[0], K)
    np.testing.assert_array_equal(accept_all[1], np.arange(V))  # p_K has full support


@functools.partial(jax.jit, static_argnames=("rule",))
def _trials(keys, target, draft, temperature, top_p, nsd_top_p, *, rule):
    """One verify per key (vmapped): draft tokens ~ q, then the first two emitted tokens."""
    q_logp = processors.log_probs(draft, temperature, 0, top_p)

    def one(key):
        key_draft, key_verify = jax.random.split(key)
        tokens = jax.random.categorical(key_draft, q_logp, axis=-1).astype(jnp.int32)
        res = verify(target[None], draft[None], tokens[None], key_verify, rule=rule,
                     temperature=temperature, top_p=top_p, nsd_top_p=nsd_top_p)
        n, nxt = res.num_accepted[0], res.next_token[0]
        first = jnp.where(n >= 1, tokens[0], nxt)
        second = jnp.where(n >= 2, tokens[1], nxt)
        return first, second, n >= 1

    return jax.vmap(one)(keys)


def _histogram(tokens, mask=None):
    tokens = np.asarray(tokens)
    if mask is not None:
        tokens = tokens[np.asarray(mask)]
    return np.bincount(tokens, minlength=V) / len(tokens)


def test_standard_rule_monte_carlo_matches_target():
    n = 10**5
    p = _dist(TARGET)
    first, second, accepted = _trials(jax.random.split(jax.random.PRNGKey(0), n),
                                      TARGET, DRAFT, 1.0, 1.0, 0.9, rule="standard")
    first, second, accepted = np.asarray(first), np.asarray(second), np.asarray(accepted)
    tvs = {}
    for m in (10**4, 10**5):  # the first 10^4 trials, then all of them
        tvs[m] = _tv(_histogram(first[:m]), p[0])
        assert tvs[m] < 3.0 * _expected_tv(p[0], m), (m, tvs[m], _expected_tv(p[0], m))
        acc = accepted[:m]
        assert _tv(_histogram(second[:m], acc), p[1]) < 3.0 * _expected_tv(p[1], acc.sum())
    assert tvs[10**5] < tvs[10**4]
    # Sampling p instead of the residual at a rejection would be far outside the bound here.
    accepted = np.minimum(p[0], _dist(DRAFT)[0])
    biased = accepted + (1.0 - accepted.sum()) * p[0]
    assert _tv(biased, p[0]) > 10 * _expected_tv(p[0], 10**5)


# ----------------------------------------------------------------------------- NSD


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.3])
def test_nsd_total_variation_identity(temperature):
    """TV(out, p) == sum_{x in N} max(0, q(x) - p(x)), analytically and by Monte Carlo."""
    n = 10**5
    p = _dist(TARGET, temperature)[0]
    q = _dist(DRAFT, temperature)[0]
    for i, nsd_top_p in enumerate((0.8, 0.9, 0.95)):
        in_nucleus = _nucleus(p, nsd_top_p)
        excess = np.sum(np.where(in_nucleus, np.maximum(q - p, 0.0), 0.0))
        out = output_distribution(p, q, "nsd", nsd_top_p)
        assert excess > 0.01  # a non-trivial deviation
        np.testing.assert_allclose(out.sum(), 1.0, atol=1e-12)
        np.testing.assert_allclose(_tv(out, p), excess, atol=1e-9)
        first, _, _ = _trials(jax.random.split(jax.random.PRNGKey(i), n), TARGET, DRAFT,
                              temperature, 1.0, nsd_top_p, rule="nsd")
        empirical = _histogram(first)
        bound = 3.0 * _expected_tv(out, n)
        assert _tv(empirical, out) < bound
        assert abs(_tv(empirical, p) - excess) < bound


def _random_problem(seed, b=32, k=3, v=40, spread=0.8):
    """Continuous random logits (no ties): target [b, k+1, v], draft [b, k, v] near it."""
    rng = np.random.default_rng(seed)
    target = (2.0 * rng.standard_normal((b, k + 1, v))).astype(np.float32)
    draft = (target[:, :k] + spread * rng.standard_normal((b, k, v))).astype(np.float32)
    return jnp.asarray(target), jnp.asarray(draft)


_sample_tokens = jax.jit(
    lambda key, logits, temperature, top_p: jax.random.categorical(
        key, processors.log_probs(logits, temperature, 0, top_p), axis=-1).astype(jnp.int32))


def test_temperature_zero_standard_and_nsd_reduce_to_greedy():
    target, draft = _random_problem(3)
    b, k, v = draft.shape
    rng = np.random.default_rng(4)
    # Mostly the draft's argmax (as a T=0 draft proposes), some arbitrary tokens.
    tokens = np.where(rng.random((b, k)) < 0.8, np.argmax(np.asarray(draft), -1),
                      rng.integers(0, v, (b, k))).astype(np.int32)
    key = jax.random.PRNGKey(7)
    greedy = verify(target, draft, tokens, key, rule="greedy", temperature=0.0)
    assert 0 < int(greedy.num_accepted.sum()) < b * k
    for rule, nsd_top_p in (("standard", 0.9), ("nsd", 0.9), ("nsd", 0.5), ("nsd", 1.0)):
        res = verify(target, draft, tokens, key, rule=rule, temperature=0.0, top_p=0.9,
                     nsd_top_p=nsd_top_p)
        np.testing.assert_array_equal(res.num_accepted, greedy.num_accepted)
        np.testing.assert_array_equal(res.next_token, greedy.next_token)
        np.testing.assert_array_equal(res.accept, greedy.accept)


# ----------------------------------------------------------------------------- greedy, floors


def test_greedy_rule():
    v = 5
    argmax = np.array([2, 4, 1, 3])  # target argmax at positions 0..K for K = 3
    target = np.tile(np.eye(v, dtype=np.float32)[argmax] * 3.0, (4, 1, 1))
    draft = np.zeros((4, 3, v), np.float32)
    tokens = np.array([[2, 4, 0], [2, 4, 1], [0, 4, 1], [2, 0, 1]])
    for temperature in (0.0, 0.5, 1.0):
        res = verify(jnp.asarray(target), jnp.asarray(draft), jnp.asarray(tokens),
                     jax.random.PRNGKey(0), rule="greedy", temperature=temperature)
        assert isinstance(res, VerifyResult)
        np.testing.assert_array_equal(res.num_accepted, [2, 3, 0, 1])
        np.testing.assert_array_equal(res.next_token, [1, 3, 2, 4])
        np.testing.assert_array_equal(res.accept, [[1, 1, 0], [1, 1, 1], [0, 1, 1], [1, 0, 1]])
    np.testing.assert_array_equal(output_distribution(np.array([0.2, 0.5, 0.3]),
                                                      np.ones(3) / 3, "greedy"), [0, 1, 0])


def test_residual_floor_falls_back_to_p():
    """p == q and the draft token outside the top-p set: rejected, residual mass 0 -> ~p."""
    n = 4000
    p0 = _dist(TARGET, 1.0, top_p=0.5)[0]
    outside = int(np.argmin(p0))  # a token outside the top-p set: p0 == q0 == 0
    assert p0[outside] == 0 and (p0 > 0).sum() >= 2
    target = jnp.asarray(np.broadcast_to(TARGET, (n, K + 1, V)))
    tokens = jnp.full((n, K), outside, jnp.int32)
    for rule in ("standard", "nsd"):
        res = verify(target, target[:, :K], tokens, jax.random.PRNGKey(1), rule=rule, top_p=0.5,
                     nsd_top_p=0.3)
        np.testing.assert_array_equal(res.num_accepted, 0)
        nxt = np.asarray(res.next_token)
        assert ((nxt >= 0) & (nxt < V)).all()
        assert (p0[nxt] > 0).all()
        assert _tv(np.bincount(nxt, minlength=V) / n, p0) < 3.0 * _expected_tv(p0, n)


def test_no_acceptance_collapse_at_temperature_one_when_p_equals_q():
    target, draft = _random_problem(11)
    draft = draft.astype(jnp.bfloat16).astype(jnp.float32)  # exact in both dtypes
    target = target.at[:, :-1].set(draft)
    tokens = _sample_tokens(jax.random.PRNGKey(12), draft, 1.0, 1.0)
    for rule in ("standard", "nsd"):
        for dtype in (jnp.float32, jnp.bfloat16):
            res = verify(target.astype(dtype), draft.astype(dtype), tokens,
                         jax.random.PRNGKey(13), rule=rule, temperature=1.0)
            np.testing.assert_array_equal(res.num_accepted, draft.shape[1])
            assert bool(res.accept.all())


def test_bfloat16_inputs_decide_like_their_float32_casts():
    target, draft = _random_problem(5, spread=1.0)
    target, draft = target.astype(jnp.bfloat16), draft.astype(jnp.bfloat16)
    key = jax.random.PRNGKey(6)
    for rule, temperature, top_p in (("standard", 1.0, 1.0), ("nsd", 0.8, 0.9),
                                     ("greedy", 1.0, 1.0), ("standard", 0.0, 1.0)):
        tokens = _sample_tokens(key, draft, max(temperature, 1e-3), top_p)
        args = {"rule": rule, "temperature": temperature, "top_p": top_p, "nsd_top_p": 0.9}
        half = verify(target, draft, tokens, key, **args)
        full = verify(target.astype(jnp.float32), draft.astype(jnp.float32), tokens, key, **args)
        assert 0 < int(full.num_accepted.sum()) < full.accept.size or rule == "greedy"
        for a, c in zip(jax.tree.leaves(half), jax.tree.leaves(full)):
            np.testing.assert_array_equal(a, c)


# ----------------------------------------------------------------------------- API


def test_validation_errors():
    t = jnp.zeros((2, 3, 5))
    d = jnp.zeros((2, 2, 5))
    x = jnp.zeros((2, 2), jnp.int32)
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match="rule"):
        verify(t, d, x, key, rule="typical")
    with pytest.raises(ValueError, match="draft_logits"):
        verify(t, d[:, :1], x, key)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify(t, d, x[:, :1], key)
    with pytest.raises(ValueError, match="K\\+1"):
        verify(t[:, :1], d[:, :0], x[:, :0], key)
    with pytest.raises(ValueError, match="integer"):
        verify(t, d, x.astype(jnp.float32), key)
    with pytest.raises(ValueError, match="floating"):
        verify(t.astype(jnp.int32), d, x, key)
    with pytest.raises(ValueError, match="rule"):
        output_distribution(np.ones(3) / 3, np.ones(3) / 3, "typical")
    assert RULES == ("standard", "nsd", "greedy")


def test_dispatch(monkeypatch):
    from kernels_pallas import dispatch

    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert not dispatch.runs_verify_kernel(None, 0)  # CPU -> reference
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not dispatch.runs_verify_kernel(None, 0)  # GPU -> reference: the kernel is slower there (measured)
    assert dispatch.runs_verify_kernel(True, 0) and not dispatch.runs_verify_kernel(False, 0)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert dispatch.runs_verify_kernel(None, 0)
    assert not dispatch.runs_verify_kernel(None, 5)  # the kernel has no top-k
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")
    assert not dispatch.runs_verify_kernel(None, 0)
    assert dispatch.runs_verify_kernel(True, 0)


def test_sparse_candidates_decide_exactly_like_their_scattered_logits():
    """`verify_sparse` (the corpus n-gram draft's M candidates) gives `verify`'s decisions on the
    same logits scattered over the vocabulary, for the same key: every rule, greedy and sampled
    rows, top-k / top-p, padded candidates that repeat a real one's id, drafts off the candidates."""
    import types

    from relf_jax.speculative import ngram_draft

    rng = np.random.default_rng(3)
    b, k, m, v = 32, 3, 5, 40
    for trial in range(3):
        target = jnp.asarray(rng.normal(size=(b, k + 1, v)) * 2, jnp.float32)
        ids = np.stack([[rng.choice(v, m, replace=False) for _ in range(k)] for _ in range(b)])
        logits = rng.normal(size=(b, k, m)).astype(np.float32)
        pad = rng.random((b, k, m)) < 0.3
        pad[..., 0] = False
        logits[pad] = -np.inf
        ids = np.where(pad & (rng.random((b, k, m)) < 0.5), ids[..., :1], ids)
        ids, logits = jnp.asarray(ids, jnp.int32), jnp.asarray(logits)
        dense = ngram_draft.candidate_logits(types.SimpleNamespace(vocab_size=v), ids, logits)
        x = jnp.where(jnp.asarray(rng.random((b, k)) < 0.7), ids[..., 0], jnp.asarray(rng.integers(0, v, (b, k))))
        key = jax.random.key(trial)
        for rule, (temperature, top_k, top_p) in itertools.product(
                RULES, [(1.0, 0, 1.0), (0.7, 0, 0.8), (1.3, 2, 1.0), (0.0, 0, 1.0)]):
            want = verify(target, dense, x, key, rule=rule, temperature=temperature, top_k=top_k, top_p=top_p,
                          use_kernel=False)
            got = verify_module.verify_sparse(target, ids, logits, x, key, rule=rule, temperature=temperature,
                                              top_k=top_k, top_p=top_p)
            for a, c in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(c), err_msg=f"{rule} {temperature} {top_k}")
    # a padded entry repeating the drafted id must not lift it back into the residual: q = 1 on
    # token 5, p(5) = 0.5, so a rejected round never emits 5
    p = np.full(8, 0.5 / 7)
    p[5] = 0.5
    target = jnp.asarray(np.log(np.tile(p, (1, 2, 1))), jnp.float32)
    ids, logits = jnp.asarray([[[5, 2, 5]]], jnp.int32), jnp.asarray([[[0.0, -np.inf, -np.inf]]], jnp.float32)
    res = jax.vmap(lambda key: verify_module.verify_sparse(target, ids, logits, jnp.asarray([[5]]), key))(
        jax.random.split(jax.random.key(0), 2000))
    rejected = np.asarray(res.num_accepted)[:, 0] == 0
    assert 800 < rejected.sum() < 1200 and not np.any(np.asarray(res.next_token)[rejected, 0] == 5)
    with pytest.raises(ValueError, match="verify_sparse"):
        verify_module.verify_sparse(target, ids[..., :2], logits, jnp.asarray([[5]]), jax.random.key(0))
