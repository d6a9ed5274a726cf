"""The serving engines' prefix cache: the block tree's hits, misses and LRU eviction; replies
token-identical with the cache on and off (greedy, seeded T = 1, speculative at T = 0, under
eviction pressure); the usage and /metrics fields."""

import queue

import httpx
import pytest

from relf_jax.errors import UserError
from relf_jax.methods import Autoregressive, DraftModel, Speculative
from relf_jax.serving.batching import Batcher, GenerationRequest
from relf_jax.serving.chat_template import ChatTemplate
from relf_jax.serving.engine_api import RequestParams
from relf_jax.serving.engines import AREngine, ByteTokenizer, SpeculativeEngine
from relf_jax.serving.loading import ServedEngine
from relf_jax.serving.prefix_cache import BlockTree, PrefixCache, block_bytes, model_layout
from tests._serving import live_server, tiny_lm

TOK = ByteTokenizer()


def test_block_tree_finds_the_longest_cached_prefix_block_by_block():
    t = BlockTree(num_blocks=8, block=2)
    new = t.insert([1, 2, 3, 4, 5])  # two full blocks; the odd token is not cached
    assert [i for i, _ in new] == [0, 1] and t.used == 2
    a, b = (node for _, node in new)
    assert t.match([1, 2, 3, 4, 9, 9]) == [a, b]
    assert t.match([1, 2, 3, 9]) == [a]  # diverges inside the second block: the first is reused
    assert t.match([9, 2, 3, 4]) == []  # a block is keyed by its parent too
    assert t.match([1, 2, 3, 4], max_blocks=1) == [a]
    assert t.insert([1, 2, 3, 4]) == []  # already cached: nothing to write
    (i, c), = t.insert([1, 2, 7, 8])  # shares [1, 2], a new second block beside [3, 4]
    assert i == 1 and t.match([1, 2, 7, 8]) == [a, c] and t.used == 3


def test_block_tree_evicts_least_recently_used_leaves_first_and_never_the_chain_it_writes():
    t = BlockTree(num_blocks=3, block=1)
    (_, one), (_, two) = t.insert([1, 2])
    (_, five), = t.insert([5])
    t.match([1, 2])  # [1] -> [2] used now; [5] is the least recently used leaf
    (_, seven), = t.insert([7])
    assert seven == five and t.evictions == 1  # [5]'s pool entry reused
    assert t.match([5]) == [] and t.match([1, 2]) == [one, two]
    # [1] has a child, so it is not a leaf: [7] (used before [1, 2]) goes next, then [2], then [1]
    t.insert([8])
    assert t.match([7]) == [] and t.match([1, 2]) == [one, two] and t.evictions == 2
    t.insert([9, 10])  # needs two entries: [8] (older) then [2] (the leaf under [1])
    assert t.match([8]) == [] and t.match([1, 2]) == [one] and t.evictions == 4
    # a chain longer than the pool stops short rather than evict its own blocks
    t2 = BlockTree(num_blocks=2, block=1)
    assert len(t2.insert([1, 2, 3])) == 2 and len(t2.match([1, 2, 3])) == 2 and t2.evictions == 0


def test_prefix_cache_sizes_its_pool_from_the_budget():
    lm = tiny_lm("ar", max_seq_len=64)
    layout = [model_layout(lm.model_cfg)]
    per = block_bytes(layout, 4)
    pc = PrefixCache(layout, 10 * per + per // 2, max_context=64, block=4)
    assert pc.tree.num_blocks == 10 and pc.budget_bytes == 10 * per and pc.bytes_in_use == 0
    with pytest.raises(UserError, match="holds no block"):
        PrefixCache(layout, per - 1, max_context=64, block=4)


class _Sink:
    def __init__(self):
        self.events = queue.SimpleQueue()

    def __call__(self, ev):
        self.events.put(ev)

    def result(self):
        ids = []
        while True:
            ev = self.events.get(timeout=120)
            ids += ev.token_ids
            if ev.finish_reason is not None:
                return ids, ev


def _turn(batcher, prompts, params):
    """Submit every prompt at once; (reply ids, usage) of each."""
    sinks = [_Sink() for _ in prompts]
    for p, prm, s in zip(prompts, params, sinks):
        batcher.submit(GenerationRequest(prompt=p, params=prm), s)
    out = []
    for s in sinks:
        ids, ev = s.result()
        assert ev.error is None, ev.error
        out.append((ids, ev.usage))
    return out


def _conversations(engine, params, turns=3):
    """Three conversations run turn by turn through a Batcher (each turn's prompt: the last
    prompt, the reply, a new user message); two share a long opening that diverges inside a
    block (the first turn runs one conversation after another, so the second finds the first's
    blocks). Returns (every turn's replies, every turn's cached prompt tokens, every turn's prompt lengths)."""
    openings = ["<user> tell me about the hills <assistant>", "<user> tell me about the sea <assistant>",
                "<user> hi <assistant>"]
    prompts = [[TOK.bos_id] + TOK.encode(o) for o in openings]
    batcher = Batcher(engine).start()
    replies, cached, lengths = [], [], []
    try:
        for turn in range(turns):
            lengths.append([len(p) for p in prompts])
            if turn == 0:  # one after another: the second opening finds the first's blocks cached
                res = [_turn(batcher, [p], [prm])[0] for p, prm in zip(prompts, params)]
            else:  # all at once
                res = _turn(batcher, prompts, params)
            replies.append([ids for ids, _ in res])
            cached.append([u["cached_tokens"] for _, u in res])
            # stop at a reply's end: the stop token is not part of the next prompt
            prompts = [p + ids + TOK.encode(f" <user> {turn} <assistant>") for p, (ids, _) in
                       zip(prompts, res)]
    finally:
        batcher.stop()
    return replies, cached, lengths


def test_ar_replies_are_identical_with_the_prefix_cache_greedy_seeded_and_under_eviction():
    lm = tiny_lm("ar", max_seq_len=64)
    engine = AREngine(lm, 2, steps_per_call=2)
    per = block_bytes([model_layout(lm.model_cfg)], 4)
    params = [RequestParams(6, 0.0), RequestParams(7, 1.0, seed=3), RequestParams(5, 1.0, top_p=0.9, seed=8)]
    want, cached_off, lengths = _conversations(engine, params)
    assert all(c == 0 for turn in cached_off for c in turn)
    for budget_blocks in (400, 12):  # roomy, and a pool that must evict
        engine.enable_prefix_cache(budget_blocks * per / 2**20, block=4)
        got, cached_on, _ = _conversations(engine, params)
        assert got == want
        pc = engine.prefix_cache.metrics()
        assert all(c % 4 == 0 for turn in cached_on for c in turn)
        assert pc["hits"] > 0 and pc["hit_tokens"] == sum(map(sum, cached_on))
        assert pc["bytes_in_use"] <= pc["bytes_budget"] == budget_blocks * per
        if budget_blocks == 400:
            assert pc["evictions"] == 0
            # every later turn reuses the full blocks of the last prompt and reply (but its last
            # token, whose keys/values the slot never computed)
            for turn in range(1, len(cached_on)):
                for c, n, reply in zip(cached_on[turn], lengths[turn - 1], want[turn - 1]):
                    assert c >= (n + len(reply) - 1) // 4 * 4
            assert cached_on[0][1] >= 16  # the second opening shares "<user> tell me about the " with the first
        else:
            assert pc["evictions"] > 0 and pc["blocks_used"] <= 12


def test_speculative_replies_with_a_draft_model_are_identical_with_the_prefix_cache():
    lm, draft = tiny_lm("ar", max_seq_len=64), tiny_lm("ar", seed=1, max_seq_len=64)
    engine = SpeculativeEngine(lm, 2, method=Speculative(rule="nsd", k=2, proposer=DraftModel(draft)), draft=draft)
    assert engine.kv_lag == 2 and len(engine.kv_layouts()) == 2  # the draft's keys/values are cached too
    params = [RequestParams(5, 0.0), RequestParams(6, 0.0), RequestParams(4, 0.0)]
    want, _, _ = _conversations(engine, params)
    engine.enable_prefix_cache(1.0, block=4)
    got, cached_on, _ = _conversations(engine, params)
    assert got == want
    assert sum(map(sum, cached_on[1:])) > 0


def test_usage_and_metrics_report_the_prefix_cache():
    engine = AREngine(tiny_lm("ar", max_seq_len=64), 2)
    engine.enable_prefix_cache(1.0, block=4)
    models = {"tiny": [ServedEngine(engine, Batcher(engine).start(), ChatTemplate(), Autoregressive(), {})]}
    first = [{"role": "user", "content": "tell me a story about a dog"}]
    with live_server(models) as base:
        body = {"model": "tiny", "messages": first, "max_tokens": 4, "temperature": 0.0}
        a = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
        assert a["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        second = first + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
        b = httpx.post(f"{base}/v1/chat/completions", json={**body, "messages": second, "stream": True,
                                                             "stream_options": {"include_usage": True}}, timeout=60)
        usage = [c for c in (np_json(line) for line in b.text.splitlines()) if c and c.get("usage")][-1]["usage"]
        # the first prompt's blocks, up to its "<assistant>" marker, are a prefix of the second's
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 16
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
    got = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
           if line.startswith("relf_prefix_cache")}
    assert got["relf_prefix_cache_hits_total"] == 1 and got["relf_prefix_cache_lookups_total"] == 2
    assert got["relf_prefix_cache_hit_tokens_total"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert 0 < got["relf_prefix_cache_bytes_in_use"] <= got["relf_prefix_cache_bytes_budget"]
    assert got["relf_prefix_cache_evictions_total"] == 0


def np_json(line):
    import json

    return json.loads(line[6:]) if line.startswith("data: {") else None


def test_a_dynamic_rope_model_refuses_the_prefix_cache():
    engine = AREngine(tiny_lm("ar", max_seq_len=64, rope_scaling="dynamic", rope_factor=2.0), 1)
    with pytest.raises(UserError, match="dynamic rope"):
        engine.enable_prefix_cache(1.0)


def test_bench_multiturn_part_runs_conversations_against_two_servers(tmp_path):
    """`bench serve --parts multiturn`'s machinery on two mock servers (which echo the last user
    turn): every conversation runs all its turns on both, per-turn TTFTs, the table and the plot."""
    from experiments.bench.serve_multiturn import MultiturnSizes, multiturn_part, plot_ttft, ttft_table

    sz = MultiturnSizes(conversations=2, turns=3, max_tokens=60, max_user_tokens=40, reps=1, prefix_cache_mb=1.0,
                        saturating_factor=4.0)
    mt = multiturn_part(["--mock"], sz, 2, TOK, str(tmp_path), seed=0)
    for load in ("batch1", "saturating"):
        for side in ("on", "off"):
            ttft = mt["ttft_ms_by_turn"][load][side]
            assert len(ttft) == 3 and all(t is not None and t > 0 for t in ttft)
        assert mt["errors"][load] == {"off": 0, "on": 0}
        assert mt["turn8_ttft_ratio_off_over_on"][load] > 0  # the last turn's (3 here)
    assert mt["identical_replies"] and mt["tokens_per_s_ratio_on_over_off"] > 0
    assert len(ttft_table(mt).splitlines()) == 2 + 3
    plot_ttft(mt, str(tmp_path / "ttft.png"))
    assert (tmp_path / "ttft.png").stat().st_size > 0
