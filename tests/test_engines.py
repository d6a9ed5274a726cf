"""Serving engines: each model engine gives exactly its sampler's tokens, whatever the batch."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relf_jax.errors import UserError
from relf_jax.methods import BlockDiffusion, Flow, NgramTable, PromptLookup, Speculative, parse_method
from relf_jax.serving import engines as E
from relf_jax.serving.engine_api import RequestParams
from relf_jax.serving.engines.slots import Held, subset_slots
from tests._serving import run_engine, tiny_lm

TOK = E.ByteTokenizer()
PROMPTS = [[2] + TOK.encode("<user> hello there <assistant>"), [2] + TOK.encode("<user> hi <assistant>"),
           [2] + TOK.encode("<user> weather? <assistant>")]


def test_mock_engine_echoes_the_last_user_turn():
    eng = E.MockEngine(2)
    prompt = [2] + TOK.encode("<user> one <assistant> x <user> two three <assistant>")
    assert TOK.decode(eng.reply_for(prompt)) == "two three"
    out = run_engine(eng, [(1, prompt, RequestParams(50), 0)], steps=12, both_paths=True)
    assert out[1] == eng.reply_for(prompt)  # 9 bytes + EOS, one per step (first from prefill)


@pytest.mark.parametrize("steps_per_call", [1, 3])
def test_ar_engine_matches_the_sampler_per_request(steps_per_call):
    from relf_jax.sampling import autoregressive as ar

    lm = tiny_lm("ar", max_seq_len=64)
    eng = E.AREngine(lm, 3, steps_per_call=steps_per_call)
    n = 8
    # the top-p request joins after two steps (the step switches to its nucleus-filtering build)
    jobs = [(0, PROMPTS[0], RequestParams(n, 1.0, seed=11), 0),
            (2, PROMPTS[1], RequestParams(n, 1.0, top_p=0.9, seed=5), 2),
            (1, PROMPTS[2], RequestParams(n, 1.0, seed=7), 3)]  # joins between steps
    out = run_engine(eng, jobs, steps=n + 4, both_paths=True)
    assert all(len(toks) >= n for toks in out.values())
    for slot, prompt, p, at in jobs:
        arr, lens = ar.pad_prompts([prompt], 0)
        st = ar.generate(lm.graphdef, lm.params, arr, lens, jax.random.key(p.seed),
                         ar.TracedSampling.make(p.temperature, 0, p.top_p), ar.DecodeSettings(n, TOK.eos_id, 0))
        want = ar.replies(st, lens)[0]
        assert out[slot][:len(want)] == want, slot


@pytest.mark.parametrize("rule,proposer,steps_per_call,scale", [
    ("nsd", "draft", 1, 1.0), ("nsd", "draft", 2, 0.5), ("standard", "corpus_ngram", 1, 1.0),
    ("standard", "prompt_lookup", 1, 1.0)])
def test_speculative_engine_matches_the_sampler_per_request(rule, proposer, steps_per_call, scale):
    """Each slot's tokens are `spec.generate`'s for its request alone (scale: the draft's
    temperature scale, `Speculative.draft_temperature_scale`)."""
    from relf_jax.sampling import autoregressive as ar
    from relf_jax.speculative import generate as spec
    from relf_jax.speculative.ngram_draft import build_ngram_draft

    lm, draft = tiny_lm("ar", 0, max_seq_len=64), tiny_lm("ar", 1, max_seq_len=64)
    table = build_ngram_draft(PROMPTS, lm.model_cfg.vocab_size) if proposer == "corpus_ngram" else None
    draft = draft if proposer == "draft" else None
    k, rounds = 3, 4
    eng = E.SpeculativeEngine(lm, 2, method=parse_method(rule, k=k, proposer=proposer, draft_temperature_scale=scale),
                              draft=draft,
                              steps_per_call=steps_per_call, ngram_table=table)
    jobs = [(0, PROMPTS[0], RequestParams(40, 1.0, seed=3), 0),
            (1, PROMPTS[2], RequestParams(40, 1.0, top_p=0.8, seed=4), 1)]  # top-p joins a round later
    out = run_engine(eng, jobs, steps=rounds + 1, both_paths=True)
    for slot, prompt, p, at in jobs:
        arr, lens = ar.pad_prompts([prompt], 0)
        settings = spec.SpecSettings(k=k, rule=rule, proposer=proposer, max_new_tokens=200, eos_id=TOK.eos_id,
                                     pad_id=0)
        st = spec.generate(lm.graphdef, lm.params, arr, lens, jax.random.key(p.seed),
                           spec.SpecParams.make(p.temperature, p.top_p, draft_temperature_scale=scale), settings,
                           draft_graphdef=draft.graphdef if draft else None,
                           draft_params=draft.params if draft else table)
        # the same rounds: compare what both produced in the rounds the engine ran
        n = len(out[slot])
        got = np.asarray(st.tokens)[0, len(prompt):len(prompt) + n].tolist()
        assert out[slot] == got[:n], slot
        assert n >= rounds * steps_per_call  # at least one token per round


def test_several_steps_per_call_stop_a_slot_inside_the_call():
    """A slot stops mid-call at a stop token (any of the engine's, not only EOS) or at the
    context end, and reports done in that call; its tokens are the sampler's."""
    lm = tiny_lm("ar", max_seq_len=32)
    params = RequestParams(20, 1.0, seed=4)
    ref = run_engine(E.AREngine(lm, 2), [(0, PROMPTS[1], params, 0)], steps=6)[0]
    i = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])  # a token not produced before
    eng = E.AREngine(lm, 2, steps_per_call=8)
    eng.stop_ids = (*eng.stop_ids, ref[i])  # read when the step is traced (first generate)
    state = eng.insert(eng.prefill(PROMPTS[1], params), eng.init_state(), 0)
    state, out = eng.generate(state)
    assert out.tokens[0] == ref[1:i + 1] and out.done[0] and out.tokens[1] == [] and not out.done[1]
    # the context end: a 14-token prompt and its first token leave 17 places of 32: 8 + 8 + 1
    eng = E.AREngine(lm, 2, steps_per_call=8)
    prompt = [2] + TOK.encode("<user> " + "x" * 40)[:13]
    state = eng.insert(eng.prefill(prompt, params), eng.init_state(), 1)
    got = []
    for want_done in (False, False, True):
        state, out = eng.generate(state)
        got.append(out.tokens[1])
        assert out.done[1] == want_done and out.tokens[0] == []
    assert [len(g) for g in got] == [8, 8, 1]
    with pytest.raises(UserError, match="steps_per_call"):
        E.AREngine(lm, 2, steps_per_call=0)


def test_engines_compile_the_top_p_sort_only_while_a_slot_filters():
    """Under the engines' vmap a runtime cond would sort every step; the state records on the
    host which slots use top_p < 1, and only then is the filter traced."""
    lm, draft = tiny_lm("ar", 0, max_seq_len=64), tiny_lm("ar", 1, max_seq_len=64)
    cases = [(E.AREngine(lm, 2), lambda eng, st: ((lm.params,), st.slots)),
             (E.SpeculativeEngine(lm, 2, method=Speculative(rule="nsd", k=2), draft=draft),
              lambda eng, st: ((lm.params, draft.params), st.slots))]
    for eng, args in cases:
        def sorts(state):
            step = functools.partial(eng.step_all, features=state.features)
            return " sort[" in str(jax.make_jaxpr(step)(*args(eng, state)))  # the primitive

        state = eng.init_state()
        assert not sorts(state)
        state = eng.insert(eng.prefill(PROMPTS[0], RequestParams(8, 1.0, top_p=0.5)), state, 1)
        assert sorts(state)
        state = eng.insert(eng.prefill(PROMPTS[1], RequestParams(8, 1.0)), state, 0)
        assert sorts(state)
        state = eng.free(state, 1)
        assert not sorts(state)


def test_block_diffusion_engine_matches_the_decoder():
    from relf_jax.sampling import block_diffusion as bdd
    from relf_jax.sampling.block_diffusion import decode_settings

    lm = tiny_lm("bd", max_seq_len=64)
    eng = E.BlockDiffusionEngine(lm, 2, method=BlockDiffusion(threshold=0.5))
    d = lm.model_cfg.block_size
    # sampled tokens (a traced temperature per slot); the second request joins a step later
    jobs = [(1, PROMPTS[2], RequestParams(64, 1.0, seed=9), 0), (0, PROMPTS[1], RequestParams(64, 1.0, seed=2), 1)]
    out = run_engine(eng, jobs, steps=4)
    settings = decode_settings(lm, max_blocks=4, threshold=0.5, temperature=1.0)
    for slot, prompt, p, at in jobs:
        arr, plen = bdd.pad_prompts([prompt], 0, d)
        st = bdd.generate(lm.graphdef, lm.params, jnp.asarray(arr), jnp.asarray(plen), settings,
                          jax.random.key(p.seed))
        want = bdd.outputs(st, plen)[0]
        assert len(out[slot]) > 0 and out[slot] == want[:len(out[slot])], slot
        assert len(out[slot]) == len(want) or len(out[slot]) >= (3 - at) * d  # a prefix only if cut by steps


def test_relf_engine_holds_the_prompt_and_is_batch_independent():
    from relf_jax.flow.samplers import sample as flow_sample
    from relf_jax.flow.singular import network_residual

    lm = tiny_lm("relf")
    eng = E.ReLFEngine(lm, 3, method=Flow(nfe=4))
    p = RequestParams(64, seed=1)
    alone = run_engine(eng, [(0, PROMPTS[0], p, 0)], steps=1)[0]
    crowded = run_engine(eng, [(2, PROMPTS[0], p, 0), (0, PROMPTS[1], RequestParams(64, seed=2), 0)], steps=1)[2]
    assert alone == crowded and len(alone) > 0
    assert all(t not in (TOK.pad_id, TOK.bos_id) for t in alone)
    # the sampler itself lands the held positions on the prompt's tokens
    from flax import nnx

    table = lm.extras["flow.embeddings"]
    L = lm.cfg.data.seq_len
    row = np.zeros((1, L), np.int32)
    row[0, :len(PROMPTS[0])] = PROMPTS[0]
    known = jnp.arange(L)[None] < len(PROMPTS[0])
    model = nnx.merge(lm.graphdef, lm.params)
    toks, _ = flow_sample(jax.random.key(0), lambda z, t, sc: network_residual(model, z, sc, t, embeddings=table),
                          table, eng.flow_settings, batch=1, length=L, known=(known, table[jnp.asarray(row)]))
    assert np.asarray(toks)[0, :len(PROMPTS[0])].tolist() == PROMPTS[0]


def test_relf_engine_holds_a_clean_prompt_for_a_prompt_trained_model():
    lm = tiny_lm("relf", flow_prompt_input=True)
    eng = E.ReLFEngine(lm, 2, method=Flow(nfe=3))
    assert eng.flow_settings.prompt == "clean"
    out = run_engine(eng, [(1, PROMPTS[0], RequestParams(64, seed=3), 0)], steps=1)[1]
    assert len(out) > 0 and all(t not in (TOK.pad_id, TOK.bos_id) for t in out)
    assert E.ReLFEngine(tiny_lm("relf"), 1, method=Flow(nfe=3)).flow_settings.prompt == "renoise"


def test_requests_that_do_not_fit_are_refused():
    eng = E.MockEngine(1, max_context=32)
    eng.check_request(10, 22)
    with pytest.raises(UserError, match="context"):
        eng.check_request(10, 23)
    with pytest.raises(UserError):
        RequestParams(max_tokens=0)
    with pytest.raises(UserError):
        RequestParams(max_tokens=4, temperature=-1)
    with pytest.raises(UserError):
        RequestParams(max_tokens=4, top_p=0.0)


def test_a_smaller_max_context_shrinks_the_cache_not_the_tokens():
    """`max_context` below the model's: every slot's KV cache has that length, requests past it
    are refused, and a request that fits gets the tokens it gets with the model's full context
    (AR and speculative)."""
    lm, draft = tiny_lm("ar", 0, max_seq_len=64), tiny_lm("ar", 1, max_seq_len=64)
    params = RequestParams(8, 1.0, seed=6)
    for make in (lambda **kw: E.AREngine(lm, 2, steps_per_call=2, **kw),
                 lambda **kw: E.SpeculativeEngine(lm, 2, method=Speculative(rule="nsd", k=2), draft=draft, **kw)):
        small, full = make(max_context=40), make()
        assert small.max_context == 40 and full.max_context == 64
        cache_lengths = {x.shape[-2] for x in jax.tree.leaves(small.init_state().slots.state) if x.ndim == 5}
        assert cache_lengths == {40}, cache_lengths
        want = run_engine(full, [(1, PROMPTS[0], params, 0)], steps=3)[1]
        assert run_engine(small, [(1, PROMPTS[0], params, 0)], steps=3)[1] == want and len(want) > 3
        with pytest.raises(UserError, match="context"):
            small.check_request(len(PROMPTS[0]), 40)
        for bad in (1, 65, 2.5):
            with pytest.raises(UserError, match="max_context"):
                make(max_context=bad)


def test_cache_span_grows_and_shrinks_with_the_occupied_slots_not_the_tokens(monkeypatch):
    """The AR and speculative engines cut their slots' KV caches to the span the occupied
    slots need (`engines.slots.Spans`): a long request grows it, its end shrinks it, and each
    request's tokens are still its sampler's over the full context."""
    from relf_jax.sampling import autoregressive as ar
    from relf_jax.serving.engines import slots
    from relf_jax.speculative import generate as spec

    monkeypatch.setattr(slots, "SPAN_MIN", 16)  # spans 16, 32, 64 on a 64-token context
    lm, draft = tiny_lm("ar", 0, max_seq_len=64), tiny_lm("ar", 1, max_seq_len=64)
    pa, pb = RequestParams(40, 1.0, seed=3), RequestParams(8, 1.0, seed=9)
    for eng in (E.AREngine(lm, 2, steps_per_call=2),
                E.SpeculativeEngine(lm, 2, method=Speculative(rule="nsd", k=2), draft=draft)):
        assert eng.spans.lengths == (16, 32, 64)
        eng.warmup([6], spans=1)  # the shortest span only (as `ChatModel` does); the rest compile when used
        assert eng.spans.pin is None and not any(eng.init_state().ends)
        state, pre = eng.prefill_insert(PROMPTS[1], pa, eng.init_state(), 0)  # 6 prompt tokens
        out, spans = {0: list(pre.tokens)}, [eng.cache_span(state)]
        for _ in range(40):  # A alone, past what 32 slots hold
            if len(out[0]) >= 36:
                break
            state, res = eng.generate(state)
            out[0] += res.tokens[0]
            spans.append(eng.cache_span(state))
        pre = eng.prefill(PROMPTS[1], pb)  # B joins with the unfused path, A leaves (its max_tokens)
        state = eng.free(eng.insert(pre, state, 1), 0)
        out[1] = list(pre.tokens)
        for _ in range(2):
            state, res = eng.generate(state)
            out[1] += res.tokens[1]
            spans.append(eng.cache_span(state))
        assert spans[0] == 16 and 64 in spans and spans[-1] == 16, spans
        arr, lens = ar.pad_prompts([PROMPTS[1]], 0)
        for slot, p in ((0, pa), (1, pb)):
            key = jax.random.key(p.seed)
            if isinstance(eng, E.AREngine):
                st = ar.generate(lm.graphdef, lm.params, arr, lens, key, ar.TracedSampling.make(1.0),
                                 ar.DecodeSettings(50, TOK.eos_id, 0))
                got = ar.replies(st, lens)[0]
            else:
                st = spec.generate(lm.graphdef, lm.params, arr, lens, key, spec.SpecParams.make(1.0),
                                   spec.SpecSettings(k=2, rule="nsd", max_new_tokens=50, eos_id=TOK.eos_id),
                                   draft_graphdef=draft.graphdef, draft_params=draft.params)
                got = np.asarray(st.tokens)[0, len(PROMPTS[1]):].tolist()
            assert out[slot] == got[:len(out[slot])], (type(eng).__name__, slot)


def test_few_busy_slots_step_alone_with_the_same_tokens():
    """With few slots occupied the engines step only those (padded to a power of two with free
    ones); every request's tokens are the same as when all slots step."""
    from relf_jax.speculative.ngram_draft import build_ngram_draft

    held = Held(slots=None, occupied=frozenset({5, 1, 6}))
    assert subset_slots(held, 8).tolist() == [1, 5, 6, 0]
    assert subset_slots(Held(None, occupied=frozenset({3})), 8).tolist() == [3]
    assert subset_slots(Held(None, occupied=frozenset(range(5))), 8) is None
    assert subset_slots(Held(None, occupied=frozenset({0})), 1) is None
    lm = tiny_lm("ar", 0, max_seq_len=64)
    table = build_ngram_draft(PROMPTS, lm.model_cfg.vocab_size)
    jobs = [(5, PROMPTS[0], RequestParams(12, 1.0, seed=3), 0), (1, PROMPTS[1], RequestParams(12, 1.0, seed=4), 1),
            (6, PROMPTS[2], RequestParams(12, 1.0, top_p=0.9, seed=5), 1)]
    for eng in (E.AREngine(lm, 8, steps_per_call=2),
                E.SpeculativeEngine(lm, 8, method=Speculative(rule="standard", k=2, proposer=NgramTable()),
                                    ngram_table=table)):
        outs = []
        for compact in (True, False):  # one engine (its prefill compiled once), stepping both ways
            eng.compact = compact
            outs.append(run_engine(eng, jobs, steps=6))
        assert outs[0] == outs[1] and all(len(t) > 1 for t in outs[0].values())


def _reference_log_probs(lm, prompt, reply, params: RequestParams):
    """Per reply position: the processed log-probs [V] from one forward over prompt + reply
    (no cache), the processors applied by hand with the counts of the reply so far."""
    from flax import nnx

    from relf_jax.sampling import processors

    seq = jnp.asarray([list(prompt) + list(reply)], jnp.int32)
    # jitted (op by op these compile ~80 small programs); the sampling parameters stay static
    forward = jax.jit(lambda p, seq: nnx.merge(lm.graphdef, p)(seq, jnp.arange(seq.shape[1])[None])[0])
    report = jax.jit(processors.reported_log_probs, static_argnums=(1, 2, 3, 4))
    logits = np.asarray(forward(lm.params, seq))[0]
    v = logits.shape[-1]
    bias = np.zeros(v, np.float32)
    for t, b in params.logit_bias:
        bias[t] = b
    out = []
    for j in range(len(reply)):
        counts = np.bincount(np.asarray(reply[:j], int), minlength=v)
        seen = counts > 0
        seen[np.asarray(prompt)] = True
        x = logits[len(prompt) - 1 + j].astype(np.float64) + bias
        x = np.where(seen, np.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty), x)
        x = x - counts * params.frequency_penalty - (counts > 0) * params.presence_penalty
        out.append(np.asarray(report(jnp.asarray(x, jnp.float32), params.temperature,
                                     params.top_k, params.top_p, params.min_p)))
    return out


@pytest.fixture(scope="module")
def ar_engine():
    """One 2-slot AR engine over `tiny_lm("ar", 0, max_seq_len=64)` for the tests that only send
    it requests: an engine serves request after request, so they share its compiled programs."""
    return E.AREngine(tiny_lm("ar", 0, max_seq_len=64), 2)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_ar_engine_processors_and_log_probs_match_a_full_forward(temperature, ar_engine):
    """Penalties, bias, top-k, min-p per slot: each emitted token is possible under the processed
    distribution of a cache-free forward over the reply so far, and the reported log-probs are
    that distribution's (1e-4), next to a slot that uses none of it."""
    eng = ar_engine
    lm = eng.lm
    params = RequestParams(12, temperature, seed=5, top_k=40, min_p=0.01, repetition_penalty=1.5,
                             frequency_penalty=0.4, presence_penalty=0.3, logit_bias=((40, 3.0), (41, -100.0)),
                             logprobs=5)
    plain = RequestParams(12, 1.0, seed=6)
    state = eng.init_state()
    state, pre = eng.prefill_insert(PROMPTS[0], params, state, 0)
    state, _ = eng.prefill_insert(PROMPTS[1], plain, state, 1)
    toks, lps = list(pre.tokens), list(pre.log_probs)
    while len(toks) < 10:
        state, out = eng.generate(state)
        toks += out.tokens[0]
        lps += out.log_probs[0]
        assert len(out.log_probs[1]) == len(out.tokens[1])
    assert 41 not in toks
    ref = _reference_log_probs(lm, PROMPTS[0], toks, params)
    for t, (lp, top), want in zip(toks, lps, ref):
        assert np.isfinite(want[t]) and lp == pytest.approx(float(want[t]), abs=1e-4)
        ids = [i for i, _ in top]
        np.testing.assert_allclose([x for _, x in top][:5], np.sort(want)[::-1][:5], atol=1e-4)
        assert ids[0] == int(np.argmax(want))
    if temperature == 0:
        assert all(t == int(np.argmax(w)) for t, w in zip(toks, ref))


def test_engines_refuse_what_they_do_not_implement():
    eng = E.MockEngine(1)
    with pytest.raises(UserError, match="logprobs"):
        eng.check_params(RequestParams(4, logprobs=2))
    lm = tiny_lm("ar", 0, max_seq_len=64)
    with pytest.raises(UserError, match="outside the vocabulary"):
        E.AREngine(lm, 1).check_params(RequestParams(4, logit_bias=((10_000, 1.0),)))
    for bad in ({"min_p": 1.5}, {"repetition_penalty": 0.0}, {"frequency_penalty": 3.0}, {"top_k": -1},
                {"logit_bias": ((3, 200.0),)}, {"logprobs": 21}):
        with pytest.raises(UserError):
            RequestParams(4, **bad)


@pytest.mark.parametrize("rule, proposer", [("standard", "draft"), ("standard", "corpus_ngram"), ("nsd", "draft"),
                                            ("greedy", "prompt_lookup")])
def test_speculative_engine_with_processors_at_t0_equals_ar(rule, proposer, ar_engine):
    """At temperature 0 every rule is greedy speculative decoding: with penalties, a logit
    bias and min-p the speculative engine (processed verification, drafts counted per position)
    commits the AR engine's tokens and reports the same log-probs."""
    from relf_jax.speculative.ngram_draft import build_ngram_draft

    lm, draft = ar_engine.lm, tiny_lm("ar", 1, max_seq_len=64)
    table = build_ngram_draft(PROMPTS, lm.model_cfg.vocab_size) if proposer == "corpus_ngram" else None
    params = RequestParams(14, 0.0, repetition_penalty=1.8, frequency_penalty=0.6, presence_penalty=0.4,
                             logit_bias=((45, 1.5), (6 + ord("e"), -2.0)), min_p=0.05, logprobs=3)
    engines = [ar_engine, E.SpeculativeEngine(lm, 2, method=parse_method(rule, k=3, proposer=proposer),
                                              draft=draft, ngram_table=table)]
    got = []
    for eng in engines:
        state = eng.init_state()
        state, pre = eng.prefill_insert(PROMPTS[2], params, state, 1)
        toks, lps = list(pre.tokens), list(pre.log_probs)
        while len(toks) < 14:
            state, out = eng.generate(state)
            toks += out.tokens[1]
            lps += out.log_probs[1]
        got.append((toks[:14], [lp for lp, _ in lps[:14]]))
    assert got[0][0] == got[1][0]
    np.testing.assert_allclose(got[0][1], got[1][1], atol=1e-4)


@pytest.mark.parametrize("kind", ["ar", "speculative"])
def test_a_prompt_past_half_the_context_gets_its_whole_reply(kind):
    """A prompt padded to a bucket near the context's end still decodes up to the context (the
    prefill's cache sizing must not read as a one-token budget)."""
    lm = tiny_lm("ar", max_seq_len=64)
    if kind == "ar":
        eng = E.AREngine(lm, 1)
    else:
        eng = E.SpeculativeEngine(lm, 1, method=Speculative(rule="standard", k=3, proposer=PromptLookup()))
    prompt = [2] + TOK.encode("<user> " + "abcdefgh" * 4 + " <assistant>")[:40]  # bucket 64 -> capped
    bias = tuple((t, -100.0) for t in eng.stop_ids)  # no stop token: the reply runs to max_tokens
    params = RequestParams(12, 1.0, seed=1, logit_bias=bias)
    out = run_engine(eng, [(0, prompt, params, 0)], steps=12)
    assert len(out[0]) >= 12
