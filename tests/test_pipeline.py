import json
import os
import types

import grain
import numpy as np
import pytest

from relf_jax.data import pipeline, sources
from relf_jax.data.builders.text_files import text_files_config
from relf_jax.data.sources import DataError
from relf_jax.data.tokenizer import train_tokenizer

WORDS = "alpha beta gamma delta echo fox golf hotel india juliet kilo lima mike".split()
SEQ_LEN = 15
NUM_DOCS = 80


def _doc(i, rng):
    return f"doc{i} " + " ".join(rng.choice(WORDS, size=rng.integers(1, 25)))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="module")
def builder(tmp_path_factory, data_dir):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    path.write_text("\n".join(_doc(i, rng) for i in range(NUM_DOCS)) + "\n")
    return sources.prepare("text_files", data_dir, path=str(path))


@pytest.fixture(scope="module")
def tok(builder):
    return train_tokenizer(sources.iter_texts(builder, "train"), 200)


def _docs(builder, tok, split):
    """bos + ids + eos of every document of ``split``, in stored order."""
    return [[tok.bos_id, *tok.encode(t), tok.eos_id] for t in sources.iter_texts(builder, split)]


def _stream(batches):
    """Concatenated tokens of all rows, trailing padding removed."""
    rows = np.concatenate([b["tokens"] for b in batches]).reshape(-1)
    segments = np.concatenate([b["segment_ids"] for b in batches]).reshape(-1)
    return rows[segments != 0].tolist()


def _split_at_bos(stream, bos):
    docs = []
    for t in stream:
        if t == bos:
            docs.append([])
        docs[-1].append(t)
    return docs


def _iterator(builder, tok, **kw):
    kw = {"seq_len": SEQ_LEN, "batch_size": 1, "seed": 3, **kw}
    return pipeline.make_iterator(builder, "train", tok, **kw)


# --- builders and sources -----------------------------------------------------------------


def test_text_files_txt_paragraphs_and_jsonl(tmp_path, data_dir):
    (tmp_path / "notes.txt").write_text("first  paragraph\nstill first\n\n\nsecond one\n")
    messages = [
        {"role": "user", "content": "hi  there"},
        {"role": "assistant", "content": "hello\nfriend"},
    ]
    (tmp_path / "chats.jsonl").write_text(
        json.dumps({"text": "plain text"}) + "\n\n" + json.dumps({"messages": messages}) + "\n"
    )
    (tmp_path / "README.md").write_text("ignored")
    b = sources.prepare("text_files", data_dir, path=str(tmp_path))
    train = list(sources.iter_texts(b, "train"))
    validation = list(sources.iter_texts(b, "validation"))
    assert len(validation) == 1
    assert sorted(train + validation) == sorted(
        [
            "first paragraph still first",
            "second one",
            "plain text",
            "<user> hi there <assistant> hello friend",
        ]
    )
    # A glob names the same files, so the same cache folder.
    again = sources.prepare("text_files", data_dir, path=str(tmp_path / "*"))
    assert again.data_dir == b.data_dir


def test_text_files_one_document_per_line_and_holdout(tmp_path, data_dir):
    path = tmp_path / "log.txt"
    path.write_text("".join(f"line {i}\n" for i in range(45)))
    b = sources.prepare("text_files", data_dir, path=str(path))
    assert b.info.splits["train"].num_examples == 43
    assert sorted(sources.iter_texts(b, "validation")) == ["line 19", "line 39"]


def test_text_files_cache_follows_content(tmp_path, data_dir):
    path = tmp_path / "a.txt"
    path.write_text("one\ntwo\n")
    first = sources.prepare("text_files", data_dir, path=str(path))
    info = os.path.join(first.data_dir, "dataset_info.json")
    stamp = os.stat(info).st_mtime_ns
    assert sources.prepare("text_files", data_dir, path=str(path)).data_dir == first.data_dir
    assert os.stat(info).st_mtime_ns == stamp  # reused, not regenerated
    path.write_text("one\ntwo\nthree\n")
    assert text_files_config(path).name != first.builder_config.name
    second = sources.prepare("text_files", data_dir, path=str(path))
    assert second.info.splits["train"].num_examples == 2


@pytest.mark.parametrize(
    "name, content, match",
    [
        ("missing.txt", None, "no such file"),
        ("empty.txt", "  \n\n \n", "no documents"),
        ("data.csv", "a,b\n", ".txt or .jsonl"),
        ("bad.jsonl", '{"text": "ok"}\n{oops\n', "bad.jsonl:2"),
        ("role.jsonl", json.dumps({"messages": [{"role": "system", "content": "x"}]}), "role"),
    ],
)
def test_text_files_errors(tmp_path, data_dir, name, content, match):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=match) as e:
        sources.prepare("text_files", data_dir, path=str(path))
    assert "\n" not in str(e.value)
    assert name in str(e.value)


def test_text_files_glob_without_match(tmp_path, data_dir):
    with pytest.raises(DataError, match="no .txt or .jsonl file matches"):
        sources.prepare("text_files", data_dir, path=str(tmp_path / "*.jsonl"))


def test_unknown_sources(data_dir):
    with pytest.raises(DataError, match="chatterbot, text_files"):
        sources.prepare("wikipedia", data_dir)
    with pytest.raises(DataError, match="no dataset 'surely_not_a_dataset'"):
        sources.prepare("tfds:surely_not_a_dataset", data_dir)
    with pytest.raises(DataError, match="path="):
        sources.prepare("text_files", data_dir)
    with pytest.raises(DataError, match="takes no options"):
        sources.prepare("chatterbot", data_dir, path="x")


def test_chatterbot(data_dir):
    b = sources.prepare("chatterbot", data_dir)
    train = list(sources.iter_texts(b, "train"))
    assert len(train) > 100
    assert all(t.startswith("<user> ") and "<assistant>" in t for t in train)
    assert len(list(sources.iter_texts(b, "validation"))) > 10
    assert "<user> hello <assistant> hi" in train + list(sources.iter_texts(b, "validation"))


def test_holdout_split():
    assert sources.holdout_split(list(range(5))) == ([0, 1, 2, 3], [4])
    train, val = sources.holdout_split(list(range(41)))
    assert val == [19, 39] and len(train) == 39
    assert sources.holdout_split(["only"]) == (["only"], ["only"])


# --- pipeline -----------------------------------------------------------------------------


def test_rows_are_the_shuffled_documents_concatenated(builder, tok):
    batches = list(_iterator(builder, tok, num_epochs=1))
    for b in batches:
        for key in ("tokens", "segment_ids", "positions"):
            assert b[key].shape == (1, SEQ_LEN + 1) and b[key].dtype == np.int32
    docs = _docs(builder, tok, "train")
    order = list(grain.MapDataset.range(len(docs)).shuffle(3))
    assert order != sorted(order)
    expected = [t for i in order for t in docs[i]]
    stream = _stream(batches)
    assert stream == expected  # nothing lost or repeated, in shuffled order
    # Only the last row is padded.
    assert all((b["segment_ids"] != 0).all() for b in batches[:-1])


def test_segment_ids_and_positions_follow_documents(builder, tok):
    it = _iterator(builder, tok, batch_size=4)
    for _ in range(10):
        batch = next(it)
        for tokens, seg, pos in zip(
            batch["tokens"], batch["segment_ids"], batch["positions"], strict=True
        ):
            assert seg[0] == 1 and pos[0] == 0
            starts = tokens[1:] == tok.bos_id  # a new document starts a new segment
            np.testing.assert_array_equal(seg[1:] - seg[:-1], starts.astype(np.int32))
            np.testing.assert_array_equal(pos[1:], np.where(starts, 0, pos[:-1] + 1))


def test_epochs_reshuffle_and_batches_drop_only_the_tail(builder, tok):
    batch_size = 4
    batches = list(_iterator(builder, tok, num_epochs=2, batch_size=batch_size))
    assert all(b["tokens"].shape == (batch_size, SEQ_LEN + 1) for b in batches)
    docs = _docs(builder, tok, "train")
    epochs = [
        grain.MapDataset.range(len(docs)).shuffle(3).repeat(2)[i] for i in range(2 * len(docs))
    ]
    expected = [t for i in epochs for t in docs[i]]
    stream = _stream(batches)
    assert stream == expected[: len(stream)]
    assert len(expected) - len(stream) < batch_size * (SEQ_LEN + 1)
    first, second = epochs[: len(docs)], epochs[len(docs) :]
    assert sorted(first) == sorted(second) and first != second


def test_deterministic_given_seed(builder, tok):
    a = [next(it)["tokens"] for it in [_iterator(builder, tok, batch_size=2)] for _ in range(4)]
    b = [next(it)["tokens"] for it in [_iterator(builder, tok, batch_size=2)] for _ in range(4)]
    c = [
        next(it)["tokens"]
        for it in [_iterator(builder, tok, batch_size=2, seed=4)]
        for _ in range(4)
    ]
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert not all((x == y).all() for x, y in zip(a, c, strict=True))


def test_hosts_take_their_rows_of_one_global_batch_stream(builder, tok):
    """Whatever the process count, the hosts' blocks, in process order, are the one-process
    batches, and every host's iterator is at the same position (so the loss curve and a resume
    do not depend on the number of processes)."""
    whole = _iterator(builder, tok, batch_size=4)
    hosts = [_iterator(builder, tok, batch_size=4, process_index=i, process_count=2) for i in range(2)]
    for _ in range(5):
        want = next(whole)
        parts = [next(h) for h in hosts]
        assert all(p["tokens"].shape == (2, SEQ_LEN + 1) for p in parts)
        for k in want:
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), want[k])
    assert hosts[0].get_state() == hosts[1].get_state() == whole.get_state()
    evals = [pipeline.eval_batches(builder, "validation", tok, seq_len=SEQ_LEN, batch_size=4, max_batches=3,
                                   process_index=i, process_count=2) for i in range(2)]
    alone = pipeline.eval_batches(builder, "validation", tok, seq_len=SEQ_LEN, batch_size=4, max_batches=3)
    for a, b, w in zip(*evals, alone, strict=True):
        np.testing.assert_array_equal(np.concatenate([a["tokens"], b["tokens"]]), w["tokens"])
    with pytest.raises(ValueError, match="not divisible by the 2 processes"):
        _iterator(builder, tok, batch_size=3, process_index=0, process_count=2)


def test_state_resumes_exactly(builder, tok):
    it = _iterator(builder, tok, batch_size=3)
    for _ in range(5):
        next(it)
    state = it.get_state()
    assert len(json.dumps(state)) < 200
    want = [next(it) for _ in range(3)]
    # grain's checkpoint handler stores the state as JSON: resume from the round trip.
    for restored_state in (state, json.loads(json.dumps(state))):
        fresh = _iterator(builder, tok, batch_size=3)
        fresh.set_state(restored_state)
        got = [next(fresh) for _ in range(3)]
        for w, g in zip(want, got, strict=True):
            for key in w:
                np.testing.assert_array_equal(w[key], g[key])


def _assert_resumes_at_every_row(rows, keys=("tokens",)):
    """After any number of rows, the iterator's state survives a JSON round trip (twice, the second
    time before a row is read) and the resumed iterator yields exactly the remaining rows."""
    want = list(rows)
    for k in range(len(want) + 1):
        it = iter(rows)
        for _ in range(k):
            next(it)
        state = it.get_state()
        for _ in range(2):  # restored, then saved again before reading a row: nothing is lost
            fresh = iter(rows)
            fresh.set_state(json.loads(json.dumps(state)))
            state = fresh.get_state()
        got = list(fresh)
        assert len(got) == len(want) - k
        for w, g in zip(want[k:], got, strict=True):
            for key in keys:
                np.testing.assert_array_equal(w[key], g[key])
    return want


def test_state_resumes_at_every_row(tok):
    docs = [
        np.arange(100 * i, 100 * i + n, dtype=np.int32) for i, n in enumerate([3, 16, 1, 7, 20, 2])
    ]
    _assert_resumes_at_every_row(pipeline.PackedRows(grain.MapDataset.source(docs).to_iter_dataset(), 8))


def test_eval_batches(builder, tok):
    batches = pipeline.eval_batches(
        builder, "validation", tok, seq_len=SEQ_LEN, batch_size=2, max_batches=100
    )
    assert all(b["tokens"].shape == (2, SEQ_LEN + 1) for b in batches)
    assert _stream(batches) == [t for d in _docs(builder, tok, "validation") for t in d]
    again = pipeline.eval_batches(
        builder, "validation", tok, seq_len=SEQ_LEN, batch_size=2, max_batches=1
    )
    assert len(again) == 1
    np.testing.assert_array_equal(again[0]["tokens"], batches[0]["tokens"])


def test_document_rows_hold_one_document_each_then_padding(builder, tok):
    L = 6  # some documents are longer, some shorter
    docs = _docs(builder, tok, "validation")
    batches = pipeline.eval_batches(builder, "validation", tok, seq_len=L, batch_size=4, max_batches=100,
                                    rows="documents")
    rows = [r for b in batches for r in b["tokens"]][: len(docs)]
    assert len(rows) == len(docs)
    for row, doc in zip(rows, docs):
        assert row.shape == (L + 1,)
        cut = doc[: L + 1]
        assert row[: len(cut)].tolist() == cut
        assert (row[len(cut):] == tok.pad_id).all()
    assert any(len(d) > L + 1 for d in docs) and any(len(d) < L + 1 for d in docs)
    assert (batches[0]["segment_ids"] == 1).all()  # the pad tail is a target too
    np.testing.assert_array_equal(batches[0]["positions"][0], np.arange(L + 1))


def test_document_rows_shuffle_and_resume(builder, tok):
    it = _iterator(builder, tok, batch_size=3, rows="documents")
    first = [next(it) for _ in range(4)]
    starts = {int(r[0]) for b in first for r in b["tokens"]}
    assert starts == {tok.bos_id}
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(2)]
    fresh = _iterator(builder, tok, batch_size=3, rows="documents")
    fresh.set_state(state)
    for w, g in zip(want, [next(fresh) for _ in range(2)], strict=True):
        np.testing.assert_array_equal(w["tokens"], g["tokens"])
    with pytest.raises(ValueError, match="rows must be one of"):
        _iterator(builder, tok, rows="bogus")


def test_empty_or_missing_split_raises(builder, tok):
    with pytest.raises(DataError, match="no split 'test'"):
        pipeline.validate_nonempty(builder, "test")
    assert len(pipeline.validate_nonempty(builder, "train[:10]")) == 10
    empty = types.SimpleNamespace(name="empty", as_data_source=lambda split: [])
    with pytest.raises(DataError, match="split 'train' of empty is empty"):
        _iterator(empty, tok)


def _segment_docs(batches):
    """The documents of segment rows, in order: each (row, segment id) run of text."""
    out = []
    for b in batches:
        for tokens, seg in zip(b["tokens"], b["segment_ids"]):
            for s in range(1, int(seg.max()) + 1):
                out.append(tokens[seg == s].tolist())
    return out


def test_segment_rows_pack_whole_documents_with_segment_ids(builder, tok):
    L = 24  # some documents are longer than a row, many fit two to a row
    docs = _docs(builder, tok, "train")
    assert any(len(d) > L for d in docs) and sum(len(d) <= L // 2 for d in docs) > 2
    batches = pipeline.eval_batches(builder, "train", tok, seq_len=L, batch_size=3, max_batches=1000,
                                    rows="segments")
    pieces = []
    for d in docs:  # a document longer than a row is cut into full-row pieces
        pieces += [d[i:i + L] for i in range(0, len(d), L)]
    assert _segment_docs(batches) == pieces  # every token once, in order, whole documents
    rows = [r for b in batches for r in zip(b["tokens"], b["segment_ids"], b["positions"])]
    assert max(int(seg.max()) for _, seg, _ in rows) >= 2  # several documents share a row
    for tokens, seg, pos in rows:
        assert tokens.shape == seg.shape == pos.shape == (L + 1,)
        assert seg[-1] == 0  # the last column is always pad: tokens[:, :-1] holds all the text
        text = seg != 0
        n = int(text.sum())
        assert text[:n].all() and not text[n:].any()  # text first, then pad
        assert (tokens[~text] == tok.pad_id).all() and (pos[~text] == 0).all()
        starts = np.flatnonzero(np.diff(seg[:n], prepend=0))
        np.testing.assert_array_equal(pos[:n], np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n))))
    seg = batches[0]["segment_ids"]
    np.testing.assert_array_equal(np.where(seg != 0, np.asarray(pipeline.segment_positions(seg)), 0),
                                  batches[0]["positions"])


def test_segment_rows_resume_at_every_row():
    docs = [np.arange(100 * i, 100 * i + n, dtype=np.int32) for i, n in enumerate([3, 16, 1, 7, 20, 2, 8, 5])]
    rows = pipeline.SegmentRows(grain.MapDataset.source(docs).to_iter_dataset(), 8, pad_id=-1)
    want = list(rows)
    stream = [t for r in want for t in r["tokens"][r["segment_ids"] != 0]]
    assert stream == [t for d in docs for t in d]
    assert [int(r["segment_ids"].max()) for r in want] == [1, 1, 1, 2, 1, 1, 2, 1, 1]
    _assert_resumes_at_every_row(rows, ("tokens", "segment_ids"))


def _lookahead_rows(docs, text_len, lookahead):
    return pipeline.SegmentRows(grain.MapDataset.source(docs).to_iter_dataset(), text_len, pad_id=-1,
                                lookahead=lookahead)


def test_segment_rows_lookahead_fills_tails_with_every_document_once():
    """``lookahead`` > 1: a row starts with the oldest document not yet emitted and its tail takes
    the longest later document that fits; every document still appears exactly once and whole, no
    more than ``lookahead - 1`` places early, and the rows hold less pad than in stream order."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 13, size=200).tolist() + [30, 3, 17]  # two longer than a row (cut in pieces)
    docs = [np.arange(1000 * i, 1000 * i + n, dtype=np.int32) for i, n in enumerate(lengths)]
    L = 16
    pieces = {i: [d[j:j + L].tolist() for j in range(0, len(d), L)] for i, d in enumerate(docs)}
    text = {}
    for la in (1, 4, 32):
        rows = list(_lookahead_rows(docs, L, la))
        seen = []
        for r in rows:
            seg, pos = r["segment_ids"], r["positions"]
            assert seg.shape == (L + 1,) and seg[-1] == 0
            n = int((seg != 0).sum())
            assert (seg[:n] != 0).all() and (r["tokens"][n:] == -1).all()  # text first, then pad
            for s in range(1, int(seg.max()) + 1):
                assert pos[seg == s].tolist() == list(range(int((seg == s).sum())))
                seen.append(r["tokens"][seg == s].tolist())
        order = [piece[0] // 1000 for piece in seen]
        assert sorted(seen) == sorted(p for ps in pieces.values() for p in ps)  # every piece once, whole
        starts = [i for k, i in enumerate(order) if i not in order[:k]]  # documents by their first piece
        for k, i in enumerate(starts):  # at most lookahead - 1 places ahead of the oldest not yet started
            assert i - min(set(range(len(docs))) - set(starts[:k])) < la
        if la == 1:
            assert [p for i in sorted(pieces) for p in pieces[i]] == seen  # stream order
        text[la] = sum(map(len, seen)) / (len(rows) * L)
        assert sum(map(len, seen)) == sum(lengths)
    assert text[1] < text[4] < text[32]
    assert text[32] > 0.97


@pytest.mark.parametrize("lookahead", [3, 16])
def test_segment_rows_lookahead_resume_at_every_row(lookahead):
    """The window's state (parent position, offset in a long document, which later documents are
    out already) survives a JSON round trip at every row: the resumed rows are the rest exactly."""
    rng = np.random.default_rng(2)
    docs = [np.arange(100 * i, 100 * i + n, dtype=np.int32) for i, n in enumerate(rng.integers(0, 12, size=40))]
    docs[5] = np.arange(500, 500 + 20, dtype=np.int32)  # a long one: full-row pieces, then its rest
    want = _assert_resumes_at_every_row(_lookahead_rows(docs, 8, lookahead), ("tokens", "segment_ids", "positions"))
    assert sorted(t for r in want for t in r["tokens"][r["segment_ids"] != 0]) == sorted(t for d in docs for t in d)
    assert any(int(r["segment_ids"].max()) >= 3 for r in want)


def test_pack_lookahead_config():
    from relf_jax.config import ConfigError, make_config

    assert make_config("cpu", ["model=relf"]).data.pack_lookahead == 64  # the default fills row tails
    with pytest.raises(ConfigError, match="pack_lookahead"):
        make_config("cpu", ["data.pack_lookahead=0"])
    with pytest.raises(ValueError, match="lookahead"):
        _lookahead_rows([np.arange(3, dtype=np.int32)], 8, 0)
