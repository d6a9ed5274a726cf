"""Block diffusion on packed rows: documents never see each other, the loss sits on text only,
and the decoder's commit rule picks positions from the distributions alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from relf_jax.config import make_config
from relf_jax.models import build_model
from relf_jax.models.block_diffusion import packed_training_mask, training_mask
from relf_jax.sampling import block_diffusion as bds
from relf_jax.train.objectives import block_ids, masked_diffusion_loss

V, D = 40, 4


@pytest.fixture(scope="module")
def bd():
    cfg = dataclasses.replace(make_config("tiny").model, family="bd", vocab_size=V, block_size=D)
    return cfg, nnx.split(build_model(cfg, nnx.Rngs(0)))


def test_packed_mask_keeps_documents_apart():
    seg = jnp.asarray([[1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0]])
    pos = jnp.asarray([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0, 0]])
    m = np.asarray(packed_training_mask(seg, pos, D))[0]
    L = 12
    doc = np.asarray(seg[0])
    for q in range(2 * L):
        for k in range(2 * L):
            if m[q, k] and doc[q % L] != 0:
                assert doc[q % L] == doc[k % L]  # never across documents
    # document 2's first block (positions 6..9) is its block 0: noisy query 7 sees noisy 6..9 only
    assert m[7, :L].nonzero()[0].tolist() == [6, 7, 8, 9] and not m[7, L:].any()
    # document 1's second block (positions 4, 5): noisy 4 sees noisy 4, 5 and clean 0..3
    assert m[4, :L].nonzero()[0].tolist() == [4, 5] and (m[4, L:].nonzero()[0]).tolist() == [0, 1, 2, 3]
    # one document per row reduces to the old mask
    np.testing.assert_array_equal(np.asarray(packed_training_mask(jnp.ones((1, 8), jnp.int32),
                                                                  jnp.arange(8)[None], D))[0],
                                  np.asarray(training_mask(8, D)))


def test_packed_documents_give_the_logits_they_give_alone(bd):
    """A document packed after another one gets the logits it gets alone in its row: no
    attention across segments, positions and blocks counted from its own start."""
    _cfg, (graphdef, params) = bd
    rng = np.random.default_rng(0)
    a, b = rng.integers(4, V, 8), rng.integers(4, V, 6)
    clean = jnp.asarray(np.concatenate([a, b])[None], jnp.int32)
    noisy = jnp.where(jnp.asarray(rng.random((1, 14)) < 0.5), V, clean)
    seg = jnp.asarray([[1] * 8 + [2] * 6], jnp.int32)
    # jitted: run op by op, the three forwards compile ~200 small programs
    logits = jax.jit(lambda p, *args: nnx.merge(graphdef, p).training_logits(*args))
    packed = np.asarray(logits(params, noisy, clean, seg))
    alone_b = np.asarray(logits(params, noisy[:, 8:], clean[:, 8:]))
    alone_a = np.asarray(logits(params, noisy[:, :8], clean[:, :8]))
    np.testing.assert_allclose(packed[:, 8:], alone_b, atol=1e-4)
    np.testing.assert_allclose(packed[:, :8], alone_a, atol=1e-4)


def test_block_ids_restart_per_document():
    seg = jnp.asarray([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0]])
    pos = jnp.asarray([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]])
    assert np.asarray(block_ids(seg, pos, D))[0].tolist() == [0, 0, 0, 0, 1, 2, 2, 2, 2, 3, 4, 4]


def test_loss_only_on_text(bd):
    """Padding (segment id 0) is never masked and takes no loss; each document's first token is
    never masked; what sits in the padding does not move the loss."""
    _cfg, (graphdef, params) = bd
    loss_fn = jax.jit(lambda p, batch, key: masked_diffusion_loss(nnx.merge(graphdef, p), batch, key))
    rng = np.random.default_rng(1)
    toks = rng.integers(4, V, (2, 17)).astype(np.int32)
    seg = np.asarray([[1] * 7 + [2] * 5 + [0] * 5, [1] * 16 + [0]], np.int32)
    batch = {"tokens": jnp.asarray(toks), "segment_ids": jnp.asarray(seg)}
    other = toks.copy()
    other[0, 12:] = rng.integers(4, V, 5)  # change only the padding
    key = jax.random.key(3)
    loss, aux = loss_fn(params, batch, key)
    loss2, aux2 = loss_fn(params, {**batch, "tokens": jnp.asarray(other)}, key)
    assert float(loss) == pytest.approx(float(loss2), abs=1e-6) and float(aux["tokens"]) == float(aux2["tokens"])
    # over many keys: masked counts never exceed the maskable text (not pad, not document starts)
    maskable = (7 - 1) + (5 - 1) + (16 - 1)
    counts = [float(loss_fn(params, batch, jax.random.key(i))[1]["tokens"]) for i in range(6)]
    assert max(counts) <= maskable and max(counts) > 0


def test_max_confidence_picks_positions_from_the_distributions(bd):
    """"max": the committed position depends on the logits only, not on the draw; "sampled"
    (the old rule) picks the position whose draw was likeliest, so it moves with the key."""
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(1, D, V)) * 0.5, jnp.float32)  # flat: nothing passes 0.95
    masked = jnp.ones((1, D), bool)
    want = int(np.argmax(np.asarray(jax.nn.softmax(logits, -1)).max(-1)[0]))
    picks_max, picks_sampled = set(), set()
    for i in range(20):
        c, _ = bds.confidence_commit(logits, masked, 0.95, temperature=1.0, key=jax.random.key(i), confidence="max")
        picks_max.add(int(np.asarray(c)[0].nonzero()[0][0]))
        c, _ = bds.confidence_commit(logits, masked, 0.95, temperature=1.0, key=jax.random.key(i),
                                     confidence="sampled")
        picks_sampled.add(int(np.asarray(c)[0].nonzero()[0][0]))
    assert picks_max == {want}
    assert len(picks_sampled) > 1
    with pytest.raises(ValueError):
        bds.confidence_commit(logits, masked, 0.95, confidence="nope")


def test_defaults_are_the_new_ones():
    from relf_jax.data.prepare import row_mode

    assert row_mode(make_config("cpu", ["model=bd"])) == "segments"  # packed, block-aligned rows
    assert row_mode(make_config("cpu", ["model=bd", "data.rows=documents"])) == "documents"  # the old layout
    assert make_config("cpu").sample.confidence == "max"
    assert bds.BlockDecodeSettings(block_size=4, max_blocks=1, mask_id=V, pad_id=0, stop_ids=(1,)).confidence == "max"


def test_block_aligned_segment_rows(tmp_path):
    """``rows="segments", align=d``: every document starts on a block boundary of its row, is
    whole, and is filled up with pad ids (inside its segment) to whole blocks; rows keep the
    segment contract (pad with id 0 after the documents, the last column always pad)."""
    from relf_jax.data import pipeline, sources
    from relf_jax.data.tokenizer import train_tokenizer

    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel"]
    path = tmp_path / "docs.txt"
    path.write_text("\n".join(" ".join(rng.choice(words, size=rng.integers(1, 12))) for _ in range(40)) + "\n")
    builder = sources.prepare("text_files", str(tmp_path / "tfds"), path=str(path))
    tok = train_tokenizer(sources.iter_texts(builder, "train"), 200)
    docs = [[tok.bos_id, *tok.encode(t), tok.eos_id] for t in sources.iter_texts(builder, "train")]
    batches = pipeline.eval_batches(builder, "train", tok, seq_len=16, batch_size=4, max_batches=100,
                                    rows="segments", align=D)
    seen = []
    for b in batches:
        for toks, seg, pos in zip(b["tokens"], b["segment_ids"], b["positions"]):
            assert seg[-1] == 0
            for s in set(seg.tolist()) - {0}:
                idx = np.nonzero(seg == s)[0]
                assert idx[0] % D == 0 and len(idx) % D == 0 and pos[idx].tolist() == list(range(len(idx)))
                body = toks[idx].tolist()
                while body[-1] == tok.pad_id:
                    body.pop()
                assert len(idx) == -(-len(body) // D) * D  # filled up to whole blocks, no more
                seen.append(body)
    assert max(map(len, docs)) <= 16  # every document fits a row: they come whole, in order
    assert seen == docs
    with pytest.raises(ValueError):
        pipeline.eval_batches(builder, "train", tok, seq_len=16, batch_size=4, max_batches=1, rows="packed", align=D)
