"""The corpus n-gram proposer's corpus: text the user names, or the traffic served (online,
bounded, swapped in between steps without a recompile), never the built-in corpus behind the
user's back (an imported model without a corpus is a clear error)."""

import collections
import queue

import jax.numpy as jnp
import numpy as np
import pytest

from relf_jax.errors import UserError
from relf_jax.methods import NgramTable, Speculative, parse_method
from relf_jax.serving.loading import engine_for
from relf_jax.speculative import ngram_draft as nd
from relf_jax.speculative.recipes import corpus_ngram_table, corpus_rows, trained_by_relf_jax
from tests._serving import tiny_lm

TEXT = "the cat sat on the mat\nthe cat ate the rat\nthe dog sat on the log\n"


def _lookup(table, ctx):
    """The table's candidates after context `ctx` (2 tokens): {token: probability}."""
    toks, lp = nd.next_candidates(table, jnp.asarray([ctx], jnp.int32), jnp.asarray([len(ctx)]))
    return {int(t): float(np.exp(p)) for t, p in zip(np.asarray(toks[0]), np.asarray(lp[0])) if p > -np.inf}


def _row(table, ctx):
    """The table's own row for context `ctx` ({} when the table does not hold that context)."""
    keys = np.asarray(table.keys[len(ctx) - 1])
    i = np.flatnonzero(keys == nd.context_keys(np.asarray([ctx]))[0])
    if not i.size:
        return {}
    toks, lp = np.asarray(table.tokens[len(ctx) - 1][i[0]]), np.asarray(table.logp[len(ctx) - 1][i[0]])
    return {int(t): float(np.exp(p)) for t, p in zip(toks, lp) if p > -np.inf}


def _counts(rows, order=3):
    """Next-token counts after every context of order - 1 tokens, counted by hand."""
    out = collections.defaultdict(collections.Counter)
    for r in rows:
        for i in range(order - 1, len(r)):
            out[tuple(r[i - order + 1:i])][r[i]] += 1
    return out


def test_table_from_a_user_file_has_the_file_counts(tmp_path, capsys):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    lm = tiny_lm()
    tok = lm.tokenizer
    rows = corpus_rows(lm, [str(path)])
    assert rows == [tok.encode(line) + [tok.eos_id] for line in TEXT.splitlines()]
    table = corpus_ngram_table(lm, files=[str(path)])
    assert "counts 3 documents of" in capsys.readouterr().err
    counts = _counts(rows)
    assert len(counts) > 10
    for ctx, nxt in counts.items():
        total = sum(nxt.values())
        want = {t: n / total for t, n in nxt.items()}
        got = _lookup(table, list(ctx))
        assert got.keys() == want.keys(), ctx
        for t in want:
            assert got[t] == pytest.approx(want[t], rel=1e-6)
    # by hand: "e " (2 bytes) is followed by c(at) twice, m, r, d, l (after "the") and t ("ate the")
    assert _lookup(table, tok.encode("e "))[tok.encode("c")[0]] == pytest.approx(2 / 7)


def test_imported_model_without_a_corpus_is_a_clear_error(tmp_path):
    from relf_jax.data.tokenizer import HFTokenizer

    lm = tiny_lm()
    backend = pytest.importorskip("tokenizers")
    tk = backend.Tokenizer(backend.models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tk.pre_tokenizer = backend.pre_tokenizers.WhitespaceSplit()
    lm.tokenizer = HFTokenizer(tk.to_str(), bos_id=0, eos_id=0, pad_id=0)
    assert not trained_by_relf_jax(lm) and trained_by_relf_jax(tiny_lm())
    with pytest.raises(UserError, match="imported .*--ngram-corpus"):
        corpus_ngram_table(lm)
    # with a corpus it counts that text
    path = tmp_path / "c.txt"
    path.write_text("a b a b a\n")
    table = corpus_ngram_table(lm, files=[str(path)])
    assert _lookup(table, [1, 2]) == {1: 1.0}


def test_serve_an_imported_folder_with_corpus_ngram_needs_a_corpus(tmp_path):
    """`engine_for` on a HuggingFace folder: no corpus is an error; a file or "online" works."""
    transformers = pytest.importorskip("transformers")
    from tests.test_hf_interop import save_hf_folder

    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   bos_token_id=2, eos_token_id=1, pad_token_id=0)
    path, _ = save_hf_folder(tmp_path, "llama", transformers.LlamaForCausalLM, cfg)
    with pytest.raises(UserError, match="imported"):
        engine_for(path, Speculative(rule="standard", proposer=NgramTable()))
    with pytest.raises(UserError, match="needs a draft model"):  # the default proposer, no <folder>/draft
        engine_for(path, Speculative(rule="standard"))
    with pytest.raises(UserError, match="proposer corpus_ngram"):
        parse_method("standard", proposer="prompt_lookup", corpus=["online"])
    text = tmp_path / "c.txt"
    text.write_text("hello there how are you\n")
    eng = engine_for(path, Speculative(rule="standard", proposer=NgramTable(corpus=[str(text)])))
    assert eng.ngram_online is None and eng.ngram_table is not None
    eng = engine_for(path, Speculative(rule="standard", proposer=NgramTable(corpus="online", online_tokens=100)))
    assert eng.ngram_online.max_tokens == 100 and eng.ngram_table is eng.ngram_online.table


def test_online_table_counts_the_traffic_within_its_bound():
    o = nd.OnlineNgram(50, top_m=4, max_tokens=20, capacity=8)
    first = o.table
    assert _row(first, [1, 2]) == {} and _lookup(first, [1, 2]) == {0: 1.0}  # empty: a point mass
    assert o.add([1, 2, 3, 1, 2, 3, 1, 2, 4])
    assert _lookup(o.table, [1, 2]) == pytest.approx({3: 2 / 3, 4: 1 / 3})
    for i in range(10):
        o.add(list(range(10 + i, 17 + i)))
        assert o.tokens <= 20 and nd.same_shapes(first, o.table)
    assert o.tokens == 14 and len(o.rows) == 2  # the newest two rows of 7 fit in 20 tokens
    assert _row(o.table, [1, 2]) == {} and _row(o.table, [2]) == {}  # the first row has left
    assert _lookup(o.table, [23, 24]) == {25: 1.0} == _row(o.table, [23, 24])
    # more contexts than the capacity: the most frequent are kept, shapes unchanged
    assert o.add([30, 31, 32] * 4 + list(range(8)))
    assert nd.same_shapes(first, o.table) and len(o.rows) == 1
    held = np.asarray(o.table.keys[1]) != nd.EMPTY_KEY
    assert held.sum() == 8  # of 10 contexts: the 3 repeated ones, then the 5 smallest keys
    assert _row(o.table, [30, 31]) == {32: 1.0} and _row(o.table, [31, 32]) == {30: 0.75, 0: 0.25}
    assert [_row(o.table, [i, i + 1]) != {} for i in range(6)] == [True] * 5 + [False]
    assert _row(o.table, [32, 0]) == {}
    # seed rows always count; rebuilds come once the new tokens reach refresh_tokens or the
    # tokens counted last time, whichever is fewer
    s = nd.OnlineNgram(50, max_tokens=100, refresh_tokens=10, seed_rows=[[7, 8, 9]])
    assert _lookup(s.table, [7, 8]) == {9: 1.0} and s.builds == 1
    assert s.add([1, 2, 3]) and s.builds == 2  # the first traffic: at once
    assert not s.add([1, 2]) and s.add([4]) and s.builds == 3  # 3 new >= 3 counted
    assert not s.add([1] * 5) and s.add([1] * 5) and s.builds == 4  # 10 new >= 6 counted
    assert [s.add([2] * 3) for _ in range(4)] == [False, False, False, True]  # refresh_tokens = 10
    assert _lookup(s.table, [7, 8]) == {9: 1.0} and s.tokens == 28


def test_served_requests_update_the_online_table_and_replies_stay_exact():
    """A speculative engine with an online table: each finished request is counted and the new
    table is swapped in (no recompile: same shapes); greedy replies equal the AR engine's."""
    from relf_jax.serving.batching import Batcher, GenerationRequest
    from relf_jax.serving.engine_api import RequestParams
    from relf_jax.serving.engines import AREngine, SpeculativeEngine

    lm = tiny_lm(max_seq_len=48)
    online = nd.OnlineNgram(lm.model_cfg.vocab_size, max_tokens=64, capacity=64)
    spec = SpeculativeEngine(lm, 2, method=Speculative(rule="standard", k=3, proposer=NgramTable()),
                             ngram_online=online)
    ar = AREngine(lm, 2)
    first = spec.ngram_table

    batchers = {e: Batcher(e).start() for e in (spec, ar)}

    def reply(engine, prompt):
        events = queue.SimpleQueue()
        batchers[engine].submit(GenerationRequest(prompt=prompt, params=RequestParams(max_tokens=12, temperature=0.0)),
                                events.put)
        ids = []
        while True:
            ev = events.get(timeout=120)
            ids += ev.token_ids
            if ev.finish_reason:
                return ids, ev.finish_reason

    tok = lm.tokenizer
    texts = ("hello there", "how are you", "hello there")
    prompts = [[tok.bos_id] + tok.encode(t) for t in texts]
    want = {t: reply(ar, p)[0] for t, p in zip(texts, prompts)}
    for n, (text, prompt) in enumerate(zip(texts, prompts), start=1):
        got, why = reply(spec, prompt)
        assert got == want[text] and why in ("stop", "length")
        assert online.builds == n + 1 and online.tokens <= 64
        assert spec.ngram_table is online.table and nd.same_shapes(first, spec.ngram_table)
    # the table holds exactly the counts of the kept traffic (prompt + reply rows, newest 64 tokens)
    rows = [list(r) for r in online.rows]
    assert rows[-1][:len(prompts[-1])] == prompts[-1] and sum(map(len, rows)) == online.tokens
    for ctx, nxt in _counts(rows).items():
        total = sum(nxt.values())
        assert _row(spec.ngram_table, list(ctx)) == pytest.approx({t: n / total for t, n in nxt.items()})
    assert tok.encode("l")[0] in _row(spec.ngram_table, tok.encode("he"))
    for b in batchers.values():
        b.stop()
    with pytest.raises(ValueError, match="shapes"):
        spec.update_ngram_table(nd.build_ngram_draft([[1, 2, 3]], lm.model_cfg.vocab_size))


def test_serve_flag_parses():
    from experiments.launch import build_parser

    args = build_parser().parse_args(["serve", "--workdir", "w", "--generator", "standard", "--proposer",
                                      "corpus_ngram", "--ngram-corpus", "a.txt", "dir/", "online",
                                      "--ngram-online-tokens", "4096"])
    assert args.ngram_corpus == ["a.txt", "dir/", "online"] and args.ngram_online_tokens == 4096
    assert build_parser().parse_args(["serve", "--workdir", "w"]).ngram_corpus is None


def test_a_padded_table_proposes_what_the_plain_one_does():
    """Capacity only pads (rows that never match): with room for every context, the proposals
    equal the unpadded table's, through the direct-address index (V = 40) and the binary search
    (V = 5000) alike."""
    rng = np.random.default_rng(0)
    for vocab in (40, 5000):
        rows = [rng.integers(0, 12, size=30) for _ in range(8)]
        plain = nd.build_ngram_draft(rows, vocab, top_m=4)
        padded = nd.build_ngram_draft(rows, vocab, top_m=4, capacity=plain.keys[1].shape[0] + 7)
        assert padded.keys[1].shape[0] == plain.keys[1].shape[0] + 7
        ctx = jnp.asarray(rng.integers(0, 14, size=(64, 2)), jnp.int32)
        valid = jnp.asarray(rng.integers(0, 3, size=64))
        for a, b in zip(nd.next_candidates(plain, ctx, valid), nd.next_candidates(padded, ctx, valid)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_live_server_on_an_imported_folder_counts_its_traffic(tmp_path):
    """`relf-jax serve --model HF_DIR --generator standard --proposer corpus_ngram --ngram-corpus
    online`, in process: a chat request through the OpenAI client is answered, and its prompt
    and reply are in the engine's table afterwards."""
    transformers = pytest.importorskip("transformers")
    openai = pytest.importorskip("openai")
    from relf_jax.serving.loading import build_models
    from tests._serving import live_server
    from tests.test_hf_interop import save_hf_folder

    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   bos_token_id=2, eos_token_id=1, pad_token_id=0)
    path, _ = save_hf_folder(tmp_path, "llama", transformers.LlamaForCausalLM, cfg)
    method = Speculative(rule="standard", proposer=NgramTable(corpus=["online"], online_tokens=256))
    models = build_models(path, [method], model_name="m", slots=2, warmup=False)
    engine = models["m"][0].engine
    assert engine.ngram_online.builds == 1 and engine.ngram_online.tokens == 0
    with live_server(models) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="m", prompt="hello there how are you", max_tokens=6, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    online = engine.ngram_online
    assert online.builds == 2 and 0 < online.tokens <= 256 and engine.ngram_table is online.table
    prompt = engine.tokenizer.encode("hello there how are you")
    row = [int(t) for t in online.rows[0]]  # the prompt's ids (after a BOS, if the model adds one), then the reply
    start = row.index(prompt[0])
    assert start <= 1 and row[start:start + len(prompt)] == prompt and len(row) > start + len(prompt)
    assert _row(engine.ngram_table, prompt[:2]) == {prompt[2]: 1.0}
