"""The prompt-only workload predictor: surface invariants, losses, coarse-to-fine training."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from relf_jax.config import make_config
from relf_jax.dws import predictor as pr
from relf_jax.dws.surface import check_surface, executed_map
from relf_jax.models import build_model

D, NB, V = 4, 5, 30


def test_predicted_surface_invariants_and_first_block_cap():
    rng = np.random.default_rng(0)
    out = {"continue_logits": jnp.asarray(rng.normal(0, 2, (16, NB - 1)), jnp.float32),
           "step_logits": jnp.asarray(rng.normal(0, 2, (16, NB, D)), jnp.float32)}
    length = jnp.arange(1, 17)
    s = np.asarray(pr.predicted_surface(out, length, D))
    for i in range(16):
        assert check_surface(s[i]) == []
        assert s[i, 0, 0] == pytest.approx(1.0)
        cap = D - (i + 1) % D if (i + 1) % D else D
        assert np.all(s[i, 0, cap:] == 0)  # the first block cannot take more steps than it has positions
    # the workload curve at h = d is the total expected steps; at h = 1 the expected blocks
    curves = np.asarray(pr.surface_curves(jnp.asarray(s), (1, D)))
    np.testing.assert_allclose(curves[:, 1], s.sum(axis=(1, 2)), rtol=1e-6)
    np.testing.assert_allclose(curves[:, 0], s[:, :, 0].sum(axis=1), rtol=1e-6)


def _blocks_needed(reply_len: int, prompt_len: int) -> int:
    cap = D - prompt_len % D if prompt_len % D else D
    return min(NB, 1 if reply_len <= cap else 1 + -(-(reply_len - cap) // D))


def test_length_block_head_gives_the_blocks_of_a_known_length():
    """A (near) one-hot length distribution at L gives P(N >= b) = 1 for exactly the blocks a
    reply of L tokens needs after a prompt of P tokens (first block: d - P mod d positions),
    lengths past the grid are excluded, and the surface keeps its invariants."""
    rows = [(p, ell) for p in range(1, 2 * D + 1) for ell in range(1, NB * D + 1)]
    prompt = jnp.asarray([p for p, _ in rows])
    logits = jnp.where(jnp.arange(1, NB * D + 1)[None, :] == jnp.asarray([ell for _, ell in rows])[:, None], 60.0, 0.0)
    p_exists = np.asarray(pr.length_block_probs(logits, prompt, D, NB))
    for i, (p, ell) in enumerate(rows):
        top = (D - p % D if p % D else D) + (NB - 1) * D
        if ell > top:  # off the grid for this prompt: excluded, the rest is uniform
            assert p_exists[i, -1] > 0
            continue
        n = _blocks_needed(ell, p)
        np.testing.assert_allclose(p_exists[i], [1.0] * n + [0.0] * (NB - n), atol=1e-6, err_msg=str((p, ell)))
    out = {"length_logits": jnp.asarray(np.random.default_rng(1).normal(0, 2, (16, NB * D)), jnp.float32),
           "step_logits": jnp.asarray(np.random.default_rng(2).normal(0, 2, (16, NB, D)), jnp.float32)}
    s = np.asarray(pr.predicted_surface(out, jnp.arange(1, 17), D))
    assert all(check_surface(x) == [] for x in s) and np.allclose(s[:, 0, 0], 1.0)


def _toy_data(n: int, seed: int) -> pr.WorkloadData:
    """Token 5 in the prompt: one 1-step block; token 6: three 4-step blocks (prompts fill a block)."""
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, 2, n)
    prompts = [[2, 5 + k, int(rng.integers(8, V)), 7] for k in kinds]
    steps = [[1] if k == 0 else [4, 4, 4] for k in kinds]
    lens = [len(s) * D for s in steps]
    return pr.WorkloadData.build(prompts, steps, lens, max_len=8, max_blocks=NB, block_size=D)


def test_workload_data_build():
    data = _toy_data(6, 0)
    assert data.tokens.shape == (6, 8) and data.executed.shape == (6, NB, D)
    for i in range(6):
        steps = [1] if data.tokens[i, 1] == 5 else [4, 4, 4]
        np.testing.assert_array_equal(data.executed[i], executed_map(steps, NB, D))
        assert data.curves[i].tolist() == [sum(min(t, h) for t in steps) for h in pr.horizons(D)]
        assert data.total_steps[i] == sum(steps)


def test_losses_finite_with_gradients():
    data = _toy_data(8, 1)
    batch = {k: jnp.asarray(v) for k, v in data.batch(np.arange(8)).items()}
    for head, block_head, losses in (("surface", "continue", (pr.curve_loss, pr.brier_loss)),
                                     ("surface", "length", (pr.curve_loss, pr.brier_loss)),
                                     ("steps", "continue", (pr.scalar_loss,))):
        mcfg = dataclasses.replace(pr.predictor_config(V, D, NB, head, d_model=16, num_layers=1, max_len=8),
                                   predictor_block_head=block_head)
        graphdef, params = nnx.split(build_model(mcfg, nnx.Rngs(0)))
        for loss_fn in losses:
            def value(p, f=loss_fn, g=graphdef):
                return f(nnx.merge(g, p), batch, jax.random.key(0))[0]

            loss, grads = jax.jit(jax.value_and_grad(value))(params)
            assert np.isfinite(float(loss))
            assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_default_predictor_is_small():
    cfg = pr.predictor_config(1024, 8, 12, "surface")
    n = sum(x.size for x in jax.tree.leaves(nnx.state(build_model(cfg, nnx.Rngs(0)), nnx.Param)))
    assert n <= 1_000_000


@pytest.mark.parametrize("block_head", ["continue", "length"])
def test_coarse_to_fine_training_learns_the_surface(tmp_path, block_head):
    cfg = make_config("tiny", ["train.learning_rate=1e-2", "train.warmup_steps=5", "train.progress=false",
                               "train.batch_size=32"], workdir=str(tmp_path))
    mcfg = dataclasses.replace(pr.predictor_config(V, D, NB, "surface", d_model=16, num_layers=1, max_len=8),
                               predictor_block_head=block_head)
    res = pr.train_predictor(cfg, mcfg, _toy_data(256, 2), str(tmp_path / "p"), coarse_steps=60, fine_steps=60)
    test = _toy_data(32, 3)
    s = pr.predict(res.graphdef, res.params, test.tokens, test.length)
    assert all(check_surface(x) == [] for x in s)
    short = test.tokens[:, 1] == 5
    err = np.abs(s.sum(axis=(1, 2)) - test.total_steps)
    assert err.mean() < 1.5, err  # true totals are 1 and 12 steps
    assert s[~short].sum(axis=(1, 2)).min() > s[short].sum(axis=(1, 2)).max()


def test_length_ce_term():
    """With the length block head the losses add LENGTH_CE_WEIGHT x the reply-length CE (its
    target clipped to the grid); weight 0 leaves the plain Brier score; the continue head has none."""
    data = _toy_data(8, 4)
    batch = {k: jnp.asarray(v) for k, v in data.batch(np.arange(8)).items()}
    mcfg = dataclasses.replace(pr.predictor_config(V, D, NB, "surface", d_model=16, num_layers=1, max_len=8),
                               predictor_block_head="length")
    graphdef, params = nnx.split(build_model(mcfg, nnx.Rngs(0)))

    @jax.jit
    def reference(p):
        out = nnx.merge(graphdef, p)(batch["tokens"], batch["length"])
        s = pr.predicted_surface(out, batch["length"], D)
        return jnp.mean((s - batch["executed"]) ** 2), jax.nn.log_softmax(out["length_logits"], axis=-1)

    def loss_of(g, p, **kw):  # jitted: run op by op it compiles ~100 small programs
        return jax.jit(lambda p: pr.brier_loss(nnx.merge(g, p), batch, jax.random.key(0), **kw))(p)

    brier, logp = (np.asarray(x) for x in reference(params))
    brier = float(brier)
    ce = -float(np.mean([logp[i, int(data.out_len[i]) - 1] for i in range(8)]))  # every toy reply fits the grid
    loss, aux = loss_of(graphdef, params)
    assert float(loss) == pytest.approx(brier + pr.LENGTH_CE_WEIGHT * ce, rel=1e-5)
    assert float(aux["length_ce"]) == pytest.approx(ce, rel=1e-5)
    assert float(loss_of(graphdef, params, length_weight=0.0)[0]) == pytest.approx(brier, rel=1e-5)
    cont = nnx.split(build_model(pr.predictor_config(V, D, NB, "surface", d_model=16, num_layers=1, max_len=8),
                                 nnx.Rngs(0)))
    assert float(loss_of(*cont)[1]["length_ce"]) == 0.0


def test_workload_cost_scores_a_batch_as_one_by_one():
    """`WorkloadCost.batch` (the serving batcher's call for requests queued together) gives each
    prompt the cost `__call__` gives it alone: padding rows and chunks change nothing."""
    from relf_jax.checkpoint import LoadedModel
    from relf_jax.dws.cost_model import CostModel
    from relf_jax.serving.engines import ByteTokenizer

    mcfg = pr.predictor_config(V, D, NB, "surface", d_model=16, num_layers=1, max_len=40)
    graphdef, params = nnx.split(build_model(mcfg, nnx.Rngs(0)))
    lm = LoadedModel(cfg=make_config("tiny"), model_cfg=mcfg, graphdef=graphdef, params=params,
                     tokenizer=ByteTokenizer(), step=0)
    W = np.random.default_rng(0).uniform(0.5, 2.0, size=(NB, D))
    cost = pr.WorkloadCost(lm, CostModel(alpha=0.1, beta=0.2, delta=0.01, m_mean=1.0, W=W))
    assert cost.widths == (16, 32, 40)
    rng = np.random.default_rng(1)
    # widths 16, 32 and 40 (prompts past max_len keep their last 40 tokens); > 16 prompts: two chunks
    prompts = [[2] + rng.integers(4, V, size=n).tolist() for n in rng.integers(0, 50, size=19)]
    alone = [cost(p) for p in prompts]
    together = cost.batch(prompts)
    # and what one call at the full width max_len gives (the width is padding the encoder masks)
    p = prompts[0]
    arr = np.zeros((1, 40), np.int32)
    arr[0, :len(p[-40:])] = p[-40:]
    surface = pr.predict(lm.graphdef, lm.params, arr, np.asarray([len(p)], np.int32))
    want = cost.model.predict(np.asarray([len(p) / D]), surface)[0]
    np.testing.assert_allclose(alone[0]["dws_cost"], want, rtol=1e-5)
    assert [a["prompt_len"] for a in alone] == [t["prompt_len"] for t in together]
    np.testing.assert_allclose([t["dws_cost"] for t in together], [a["dws_cost"] for a in alone], rtol=1e-5)
    assert len({round(a["dws_cost"], 6) for a in alone}) > 5  # the prompts do get different costs
