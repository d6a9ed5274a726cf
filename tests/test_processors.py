"""The logits processors against transformers' (same logits, same settings, same distribution)
and against OpenAI's frequency / presence formula written out in NumPy."""

import jax.numpy as jnp
import numpy as np
import pytest

from relf_jax.sampling import processors

torch = pytest.importorskip("torch")
hf = pytest.importorskip("transformers")

V = 50


def _logits(seed, rows=3):
    return np.random.default_rng(seed).normal(0, 2.0, (rows, V)).astype(np.float32)


def _hf_chain(logits, input_ids, *, bias=None, repetition=None, temperature=None, top_k=None, top_p=None,
              min_p=None):
    """transformers' processors in the order `GenerationMixin._get_logits_processor` builds them."""
    procs = []
    if bias:
        procs.append(hf.SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias.items()]))
    if repetition is not None:
        procs.append(hf.RepetitionPenaltyLogitsProcessor(penalty=repetition))
    if temperature is not None:
        procs.append(hf.TemperatureLogitsWarper(temperature))
    if top_k is not None:
        procs.append(hf.TopKLogitsWarper(top_k=top_k))
    if top_p is not None:
        procs.append(hf.TopPLogitsWarper(top_p=top_p))
    if min_p is not None:
        procs.append(hf.MinPLogitsWarper(min_p=min_p))
    scores = torch.tensor(logits)
    ids = torch.tensor(input_ids)
    for p in procs:
        scores = p(ids, scores)
    return torch.log_softmax(scores.double(), -1).numpy()


def _ours(logits, input_ids, *, bias=None, repetition=None, temperature=1.0, top_k=0, top_p=1.0, min_p=None,
          prompt_len=None):
    b = logits.shape[0]
    ids = np.asarray(input_ids)
    plen = ids.shape[1] if prompt_len is None else prompt_len
    counts, seen = processors.token_state(jnp.asarray(ids), jnp.full((b,), plen, jnp.int32), V)
    pen = processors.Penalties(counts=counts, seen=seen)
    if bias:
        dense = np.zeros((b, V), np.float32)
        for t, v in bias.items():
            dense[:, t] = v
        pen = pen.replace(bias=jnp.asarray(dense))
    if repetition is not None:
        pen = pen.replace(repetition=jnp.full((b,), repetition, jnp.float32))
    if plen < ids.shape[1]:
        pen = pen.commit(jnp.asarray(ids[:, plen:]))
    x = processors.adjust(jnp.asarray(logits), pen)
    lp = processors.log_probs(x, jnp.full((b,), temperature, jnp.float32), jnp.full((b,), top_k, jnp.int32),
                              jnp.full((b,), top_p, jnp.float32),
                              None if min_p is None else jnp.full((b,), min_p, jnp.float32))
    return np.asarray(lp, np.float64)


def _same(ours, theirs):
    kept = np.isfinite(theirs)
    assert np.array_equal(np.isfinite(ours), kept)
    np.testing.assert_allclose(ours[kept], theirs[kept], atol=1e-5)


@pytest.mark.parametrize("repetition", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(repetition):
    logits = _logits(0)
    ids = np.random.default_rng(1).integers(0, V, (3, 12))
    _same(_ours(logits, ids, repetition=repetition), _hf_chain(logits, ids, repetition=repetition))
    # the reply's tokens count as seen as well as the prompt's (committed after the prefill)
    _same(_ours(logits, ids, repetition=repetition, prompt_len=5), _hf_chain(logits, ids, repetition=repetition))


@pytest.mark.parametrize("settings", [
    {"top_k": 7}, {"top_p": 0.8}, {"min_p": 0.1}, {"temperature": 0.7, "top_k": 10, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 1.5, "min_p": 0.2, "top_p": 0.95}])
def test_warpers_match_transformers(settings):
    logits = _logits(2)
    ids = np.zeros((3, 1), np.int64)
    theirs = _hf_chain(logits, ids, **settings)
    _same(_ours(logits, ids, **settings), theirs)


def test_bias_and_penalty_chain_matches_transformers():
    logits = _logits(3)
    ids = np.random.default_rng(4).integers(0, V, (3, 9))
    bias = {3: 5.0, 7: -100.0, 11: 2.5}
    kw = {"bias": bias, "repetition": 1.2, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "min_p": 0.02}
    _same(_ours(logits, ids, **kw), _hf_chain(logits, ids, **kw))


def test_frequency_and_presence_follow_openai_formula():
    logits = _logits(5, rows=2)
    prompt = np.random.default_rng(6).integers(0, V, (2, 4))
    reply = np.random.default_rng(7).integers(0, 6, (2, 10))  # repeats
    freq, pres = np.float32([0.5, 1.5]), np.float32([0.3, -0.4])
    counts, seen = processors.token_state(jnp.asarray(prompt), jnp.full((2,), 4, jnp.int32), V)
    pen = processors.Penalties(frequency=jnp.asarray(freq), presence=jnp.asarray(pres), counts=counts, seen=seen)
    pen = pen.commit(jnp.asarray(reply))
    ours = np.asarray(processors.adjust(jnp.asarray(logits), pen))
    want = logits.astype(np.float64).copy()
    for b in range(2):  # OpenAI: mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence (reply tokens)
        c = np.bincount(reply[b], minlength=V)
        want[b] = want[b] - c * freq[b] - (c > 0) * pres[b]
    np.testing.assert_allclose(ours, want, atol=1e-5)


def test_extra_counts_equal_committing_the_drafts():
    logits = _logits(8, rows=1)
    counts, seen = processors.token_state(jnp.asarray([[1, 2, 3]]), jnp.asarray([3]), V)
    pen = processors.Penalties(repetition=jnp.asarray([1.4]), frequency=jnp.asarray([0.6]),
                               presence=jnp.asarray([0.2]), counts=counts, seen=seen)
    drafts = jnp.asarray([[4, 4, 9]])
    extra = jnp.asarray(np.eye(V, dtype=np.int32)[[4, 4, 9]].cumsum(0))[None]  # [1, 3, V] through drafts[:j+1]
    at_positions = processors.adjust(jnp.broadcast_to(jnp.asarray(logits)[:, None], (1, 3, V)), pen, extra)
    for j in range(3):
        want = processors.adjust(jnp.asarray(logits), pen.commit(drafts[:, :j + 1]))
        np.testing.assert_allclose(np.asarray(at_positions[:, j]), np.asarray(want), atol=1e-6)


def test_off_processors_leave_logits_untouched():
    logits = jnp.asarray(_logits(9))
    assert np.array_equal(np.asarray(processors.adjust(logits, processors.Penalties())), np.asarray(logits))
    assert np.array_equal(np.asarray(processors.adjust(logits, None)), np.asarray(logits))
    np.testing.assert_array_equal(np.asarray(processors.log_probs(logits, 1.0, 0, None, 0.0)),
                                  np.asarray(processors.log_probs(logits)))


def test_sample_respects_min_p_and_reported_greedy_log_probs():
    logits = jnp.asarray(_logits(10, rows=1))
    lp = np.asarray(processors.log_probs(logits, 1.0, 0, 1.0, 0.3))[0]
    import jax

    toks = np.asarray(jax.vmap(lambda k: processors.sample(logits, k, 1.0, 0, 1.0, 0.3))(
        jax.random.split(jax.random.key(0), 400)))
    assert np.all(np.isfinite(lp[toks.ravel()]))
    # temperature 0: the report is the softmax whose argmax was taken, not the one-hot
    rep = np.asarray(processors.reported_log_probs(logits, 0.0))[0]
    np.testing.assert_allclose(rep, np.asarray(jax.nn.log_softmax(logits))[0], atol=1e-6)
    top = np.asarray(processors.top_log_probs(jnp.asarray(rep)[None], jnp.asarray([3]), 4))[0]
    assert top[0] == pytest.approx(rep[3]) and list(top[1:5].astype(int)) == list(np.argsort(-rep)[:4])
