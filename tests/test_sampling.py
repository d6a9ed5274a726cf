import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relf_jax.errors import UserError
from relf_jax.sampling import autoregressive as ar
from relf_jax.sampling import processors


def test_log_probs_filters():
    logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    p = np.exp(np.asarray(processors.log_probs(logits, 1.0, 0, 1.0)))
    np.testing.assert_allclose(p, [[0.5, 0.2, 0.15, 0.1, 0.05]], atol=1e-6)
    # top-k 2 keeps the two largest, renormalised
    p = np.exp(np.asarray(processors.log_probs(logits, 1.0, 2, 1.0)))
    np.testing.assert_allclose(p, [[0.5 / 0.7, 0.2 / 0.7, 0, 0, 0]], atol=1e-6)
    # top-p 0.75: mass strictly above 0.15 is 0.7 < 0.75 -> keep 3 tokens; above 0.1 is 0.85 -> drop
    p = np.exp(np.asarray(processors.log_probs(logits, 1.0, 0, 0.75)))
    np.testing.assert_allclose(p, [[0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0, 0]], atol=1e-6)
    # temperature 0 is greedy
    p = np.exp(np.asarray(processors.log_probs(logits, 0.0, 0, 1.0)))
    np.testing.assert_array_equal(p, [[1, 0, 0, 0, 0]])
    # temperature scales logits
    p = np.exp(np.asarray(processors.log_probs(logits, 2.0, 0, 1.0)))
    q = np.sqrt([0.5, 0.2, 0.15, 0.1, 0.05])
    np.testing.assert_allclose(p[0], q / q.sum(), atol=1e-6)


def test_filters_off_by_python_values_compile_no_sort():
    """top_k=0 / top_p None or >= 1 as Python values leave the filters out of the trace (the
    engines rely on it: under vmap a runtime cond would always sort); traced ones keep them."""
    logits = jax.random.normal(jax.random.key(0), (3, 64)) * 3

    def sorts(fn, *args):
        return " sort[" in str(jax.make_jaxpr(fn)(*args))  # the primitive

    assert not sorts(lambda x: processors.log_probs(x, 1.0, 0, None), logits)
    assert not sorts(lambda x: processors.log_probs(x, 1.0, 0, 1.0), logits)
    assert not sorts(lambda x, k: processors.sample(x, k, 1.0, 0, None), logits, jax.random.key(1))
    assert sorts(lambda x, p: processors.log_probs(x, 1.0, 0, p), logits, jnp.float32(1.0))
    assert sorts(lambda x, k: processors.log_probs(x, 1.0, k, None), logits, jnp.int32(0))
    assert sorts(lambda x: processors.log_probs(x, 1.0, 5, None), logits)
    # the same numbers either way
    for temperature in (0.0, 0.7):
        want = processors.log_probs(logits, jnp.float32(temperature), jnp.int32(0), jnp.float32(1.0))
        np.testing.assert_array_equal(processors.log_probs(logits, temperature, 0, None), want)
        np.testing.assert_array_equal(processors.log_probs(logits, temperature, 0, 1.0), want)


def test_first_argmax_equals_argmax():
    """The two-reduction argmax (sampling and the verification reference) is jnp.argmax: first
    index on ties, 0 for an all -inf row, booleans, random rows."""
    from kernels_pallas.verify_ref import first_argmax as kernel_first_argmax

    rng = np.random.default_rng(0)
    cases = [rng.standard_normal((3, 5, 257)).astype(np.float32),
             rng.integers(0, 3, (4, 64)).astype(np.float32),  # many ties
             np.array([[-np.inf] * 6, [1, 3, 3, -np.inf, 3, 0]], np.float32),
             rng.random((5, 9)) > 0.7,
             np.zeros((2, 4), bool)]
    for x in cases:
        want = np.asarray(jnp.argmax(jnp.asarray(x), axis=-1))
        for fn in (processors.first_argmax, kernel_first_argmax):
            got = np.asarray(jax.jit(fn)(jnp.asarray(x)))
            assert got.dtype == np.int32 and np.array_equal(got, want), (fn, x)


def test_nucleus_mask_ties_and_extremes():
    probs = jnp.asarray([0.4, 0.2, 0.2, 0.2])
    np.testing.assert_array_equal(processors.nucleus_mask(probs, 0.5), [True, True, True, True])
    np.testing.assert_array_equal(processors.nucleus_mask(probs, 0.3), [True, False, False, False])
    np.testing.assert_array_equal(processors.nucleus_mask(probs, 1e-9), [True, False, False, False])


def test_sample_matches_distribution_histogram():
    """200k draws: empirical frequencies match the transformed distribution (5 sigma)."""
    logits = jnp.asarray([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 200_000
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 3, 1.0)]:
        target = np.exp(np.asarray(processors.log_probs(logits, temperature, top_k, top_p)))
        keys = jax.random.split(jax.random.key(7), n)
        draws = np.asarray(jax.jit(jax.vmap(lambda k: processors.sample(logits, k, temperature, top_k, top_p)))(keys))
        freq = np.bincount(draws, minlength=6) / n
        sigma = np.sqrt(target * (1 - target) / n) + 1e-12
        assert np.all(np.abs(freq - target) <= 5 * sigma + 1e-9), (temperature, top_k, top_p, freq, target)


def test_sample_histogram_wide_vocabulary_per_row_settings():
    """A 512-token vocabulary with logits spread over ~30 nats, two rows with their own
    temperature / top-p in one call: each row's 200k draws pass a chi-square test against its own
    distribution (tokens expected fewer than 5 times pooled into one bin), and tokens the filter
    removed never appear."""
    from scipy import stats

    v, n = 512, 200_000
    logits = jax.random.normal(jax.random.key(3), (2, v)) * 5.0
    temperature, top_p = jnp.asarray([1.0, 0.6]), jnp.asarray([1.0, 0.8])
    target = np.exp(np.asarray(processors.log_probs(logits, temperature, 0, top_p), np.float64))
    keys = jax.random.split(jax.random.key(11), n)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: processors.sample(logits, k, temperature, 0, top_p)))(keys))
    for row in range(2):
        counts = np.bincount(draws[:, row], minlength=v)
        expected = target[row] / target[row].sum() * n
        assert counts[expected == 0].sum() == 0, row
        big = expected >= 5
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        chi2 = float(np.sum((obs - exp) ** 2 / np.maximum(exp, 1e-12)))
        assert stats.chi2.sf(chi2, len(obs) - 1) > 1e-6, (row, chi2, len(obs))
    assert np.sum(target[1] == 0) > v // 2  # the nucleus row really filters


def test_generate_compiles_once_and_stream_matches(tiny_model):
    graphdef, params = tiny_model
    settings = ar.DecodeSettings(max_new_tokens=10, eos_id=1)
    before = ar.generate_jit._cache_size()
    prompts, lens = ar.pad_prompts([[2, 5, 6], [2, 7, 8, 9, 10]])
    s1 = ar.generate(graphdef, params, prompts, lens, jax.random.key(0), ar.TracedSampling.make(1.0), settings)
    # other prompts in the same bucket, other sampling knobs: no recompilation
    prompts2, lens2 = ar.pad_prompts([[2, 9], [2, 3, 4, 5, 6, 7, 8]])
    ar.generate(graphdef, params, prompts2, lens2, jax.random.key(1), ar.TracedSampling.make(0.5, 5, 0.9), settings)
    assert ar.generate_jit._cache_size() - before == 1
    streamed = [tok for tok, _ in ar.stream(graphdef, params, prompts, lens, jax.random.key(0),
                                            ar.TracedSampling.make(1.0), settings)]
    out = np.stack(streamed, 1)
    reps = ar.replies(s1, lens)
    for r in range(2):
        np.testing.assert_array_equal(out[r, :len(reps[r])], reps[r])
    # each reply runs to max_new_tokens unless it ends at its first EOS
    assert all(len(r) == 10 or (r[-1] == 1 and 1 not in r[:-1]) for r in reps), reps


def test_greedy_generation_equals_argmax_recompute(tiny_model):
    graphdef, params = tiny_model
    from flax import nnx
    model = jax.jit(lambda t: nnx.merge(graphdef, params)(t)[0])
    settings = ar.DecodeSettings(max_new_tokens=6, eos_id=-1)
    prompts, lens = ar.pad_prompts([[2, 11], [2, 12, 13, 14]])
    state = ar.generate(graphdef, params, prompts, lens, jax.random.key(0), ar.TracedSampling.make(0.0), settings)
    for r, reply in enumerate(ar.replies(state, lens)):
        seq = list(np.asarray(prompts[r, :int(lens[r])]))
        for tok in reply:
            padded = np.zeros((1, 16), np.int32)  # one shape: one compilation
            padded[0, :len(seq)] = seq
            logits = model(jnp.asarray(padded))
            assert int(jnp.argmax(logits[0, len(seq) - 1])) == tok
            seq.append(tok)


def test_eos_stops_row(tiny_model):
    graphdef, params = tiny_model
    # make token 1 (EOS) the greedy choice after a forced prompt by picking eos = the greedy token
    settings0 = ar.DecodeSettings(max_new_tokens=3, eos_id=-1)
    prompts, lens = ar.pad_prompts([[2, 11]])
    first = ar.replies(ar.generate(graphdef, params, prompts, lens, jax.random.key(0),
                                   ar.TracedSampling.make(0.0), settings0), lens)[0][0]
    settings = ar.DecodeSettings(max_new_tokens=8, eos_id=first)
    state = ar.generate(graphdef, params, prompts, lens, jax.random.key(0), ar.TracedSampling.make(0.0), settings)
    assert ar.replies(state, lens)[0] == [first]
    assert bool(state.done[0])


def test_bad_sampling_inputs():
    with pytest.raises(UserError, match="temperature"):
        ar.TracedSampling.make(-1.0)
    with pytest.raises(UserError, match="top_p"):
        ar.TracedSampling.make(1.0, 0, 0.0)
    with pytest.raises(UserError, match="top_k"):
        ar.TracedSampling.make(1.0, -2, 1.0)
    with pytest.raises(UserError, match="exceeds the model context"):
        ar.check_context(100, 50, 128)


def test_per_row_settings_equal_separate_rows():
    logits = jax.random.normal(jax.random.key(3), (3, 40)) * 2
    temps, ks, ps = jnp.asarray([0.0, 0.8, 1.2]), jnp.asarray([0, 5, 0]), jnp.asarray([1.0, 1.0, 0.7])
    together = processors.log_probs(logits, temps, ks, ps)
    for r in range(3):
        alone = processors.log_probs(logits[r], float(temps[r]), int(ks[r]), float(ps[r]))
        np.testing.assert_allclose(together[r], alone, atol=1e-6)


def test_running_sum_and_greedy_ties():
    """The matmul running sum equals cumsum (any V, also not a multiple of the block); greedy
    sampling returns the first of tied maxima, as argmax does, and ignores the key."""
    w = jax.random.uniform(jax.random.key(0), (3, 2, 77))
    np.testing.assert_allclose(processors.running_sum(w, block=8), jnp.cumsum(w, axis=-1), rtol=1e-6)
    np.testing.assert_allclose(processors.running_sum(w), jnp.cumsum(w, axis=-1), rtol=1e-6)
    logits = jnp.asarray([[0.0, 3.0, 1.0, 3.0], [5.0, -1.0, 5.0, 5.0]])
    for seed in range(5):
        np.testing.assert_array_equal(processors.sample(logits, jax.random.key(seed), 0.0), [1, 0])
    per_row = processors.sample(logits, jax.random.key(0), jnp.asarray([0.0, 1.0]))
    assert int(per_row[0]) == 1 and int(per_row[1]) in (0, 2, 3)
