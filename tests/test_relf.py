"""ReLF end to end at tiny size: network, flow loss through the generic train loop, sampling."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from relf_jax.config import make_config
from relf_jax.errors import UserError
from relf_jax.flow.embeddings import gaussian_embeddings
from relf_jax.flow.losses import FlowLossSettings, make_flow_loss
from relf_jax.flow.singular import network_residual, singular_logits
from relf_jax.methods import Flow
from relf_jax.models import build_model
from relf_jax.train.loop import train
from tests._synthetic_batches import CountingBatches


def _cfg(*overrides):
    return make_config("tiny", ["model=relf", "train.progress=false", "train.steps=40", "train.checkpoint_every=40",
                                "train.eval_every=40", "train.warmup_steps=5", "data.seq_len=32",
                                "model.flow_embed_dim=8", *overrides])


def test_fresh_flow_network_gives_zero_residual():
    cfg = dataclasses.replace(_cfg().model, vocab_size=61)
    assert cfg.flow_embed_head  # the default head: h W + (h P) E^T, both parts zero at first
    g, p = nnx.split(build_model(cfg, nnx.Rngs(0)))
    z = jax.random.normal(jax.random.key(0), (2, 5, 8))
    table = jnp.asarray(gaussian_embeddings(61, 8, seed=1))
    f = jax.jit(lambda p: nnx.merge(g, p)(z, jnp.zeros_like(z), jnp.asarray([0.2, 0.9]), embeddings=table))(p)
    assert f.shape == (2, 5, 61) and f.dtype == jnp.float32
    assert float(jnp.abs(f).max()) == 0.0  # output layer starts at zero: the posterior is pure Bayes
    with pytest.raises(ValueError, match="flow_embed_head"):
        nnx.merge(g, p)(z, jnp.zeros_like(z), jnp.asarray([0.2, 0.9]))


def test_embedding_tied_head_adds_the_hidden_state_read_through_each_words_embedding():
    """f = h W + (h P) E^T: the embedding part is exactly the hidden state mapped by P and read
    through E (checked against a head-less model's hidden state), and training moves P."""
    cfg = dataclasses.replace(_cfg().model, vocab_size=61)
    model = _generic(build_model(cfg, nnx.Rngs(0)))
    z = jax.random.normal(jax.random.key(0), (2, 5, 8))
    sc, t = jnp.zeros_like(z), jnp.asarray([0.2, 0.9])
    table = jnp.asarray(gaussian_embeddings(61, 8, seed=1))
    h = model._hidden(z, sc, t, None)
    expected = h @ model.out[...] + (h @ model.out_emb[...]) @ table.T
    np.testing.assert_allclose(model(z, sc, t, embeddings=table), expected, rtol=1e-5, atol=1e-5)
    free = build_model(dataclasses.replace(cfg, flow_embed_head=False), nnx.Rngs(0))
    assert free.out_emb is None and model.out_emb is not None
    (_, _), grads = _loss_and_grads(build_model(cfg, nnx.Rngs(0)), context_loss=True)
    assert float(jnp.abs(grads["out_emb"][...]).sum()) > 0  # zero at first, and trained


def test_flow_loss_trains_through_the_generic_loop(tmp_path):
    cfg = _cfg()
    model_cfg = dataclasses.replace(cfg.model, vocab_size=61)
    table = jnp.asarray(gaussian_embeddings(61, 8, seed=0))
    loss = make_flow_loss(FlowLossSettings(residual_bound=10.0))
    res = train(cfg, model_cfg, loss, CountingBatches(), eval_data=[next(CountingBatches())], workdir=str(tmp_path),
                tensorboard=False, frozen={"embeddings": table})
    import json
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl") if '"loss"' in line]
    assert res.step == 40 and rows[-1]["loss"] < rows[0]["loss"] - 0.3


def test_flow_loss_variants_are_finite():
    cfg = dataclasses.replace(_cfg().model, vocab_size=61)
    g, p = nnx.split(build_model(cfg, nnx.Rngs(0)))
    batch = {k: jnp.asarray(v) for k, v in next(CountingBatches()).items()}
    frozen = {"embeddings": jnp.asarray(gaussian_embeddings(61, 8, seed=1))}
    for settings in (FlowLossSettings(), FlowLossSettings(loss="mse"), FlowLossSettings(use_singular=False),
                     FlowLossSettings(t_distribution="logit_normal", self_condition_prob=1.0)):
        loss, aux = jax.jit(lambda p: make_flow_loss(settings)(nnx.merge(g, p), batch, jax.random.key(0), frozen))(p)
        assert np.isfinite(float(loss)) and 0 <= float(aux["accuracy"]) <= 1
    # with a zero residual and t near 1 the CE is ~0: singular logits pin the true token
    z = frozen["embeddings"][batch["tokens"][:, :-1]]
    lp = jax.nn.log_softmax(singular_logits(z, jnp.full((z.shape[0],), 0.999), frozen["embeddings"]), -1)
    assert float(-jnp.take_along_axis(lp, batch["tokens"][:, :-1, None], -1).mean()) < 1e-3


def test_prompt_prefix_is_a_uniform_prefix_of_the_text():
    from relf_jax.flow.losses import prompt_prefix

    rows, length = 4000, 12
    n = np.random.default_rng(0).integers(0, length + 1, rows)
    mask = jnp.asarray(np.arange(length)[None] < n[:, None], jnp.float32)
    known = np.asarray(prompt_prefix(jax.random.key(0), mask, 0.5))
    k = known.sum(1)
    assert (known == (np.arange(length)[None] < k[:, None])).all()  # a prefix
    chosen = k > 0
    assert not chosen[n < 2].any() and (k[chosen] <= n[chosen] - 1).all()  # never the whole text
    assert abs(chosen[n >= 2].mean() - 0.5) < 0.03
    ten = chosen & (n == 10)  # k uniform over 1..9
    assert abs(k[ten].mean() - 5.0) < 0.5 and set(k[ten]) == set(range(1, 10))


def test_prompt_training_loss_skips_the_prompt_and_trains_the_known_input():
    cfg = dataclasses.replace(_cfg().model, vocab_size=61, flow_prompt_input=True)
    model = build_model(cfg, nnx.Rngs(0))
    model.out[...] = 0.1 * jax.random.normal(jax.random.key(1), model.out.shape)  # the fresh zeros pass no gradient
    g, p = nnx.split(model)
    batch = {k: jnp.asarray(v) for k, v in next(CountingBatches()).items()}
    frozen = {"embeddings": jnp.asarray(gaussian_embeddings(61, 8, seed=1))}

    def run(settings):
        def f(p):
            return make_flow_loss(settings)(nnx.merge(g, p), batch, jax.random.key(0), frozen)
        (loss, aux), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(p)
        return float(loss), float(aux["tokens"]), float(jnp.abs(grads["in_known"][...]).sum())

    loss, tokens, g_known = run(FlowLossSettings(prompt_prob=0.9))
    assert np.isfinite(loss) and tokens < batch["tokens"][:, :-1].size and g_known > 0
    loss, tokens, g_known = run(FlowLossSettings())
    assert tokens == batch["tokens"][:, :-1].size and g_known == 0.0  # no prompt: the flag is unused
    plain = build_model(dataclasses.replace(cfg, flow_prompt_input=False), nnx.Rngs(0))
    z = jnp.zeros((1, 4, 8))
    with pytest.raises(ValueError, match="prompt input"):
        plain(z, z, jnp.zeros((1,)), jnp.ones((1, 4), bool))


def _fixed_loss(model, **settings):
    """(params, f): f(params) is (loss, metrics) of the flow loss with FlowLossSettings(**settings)
    on one fixed batch."""
    g, p = nnx.split(model)
    batch = {k: jnp.asarray(v) for k, v in next(CountingBatches()).items()}
    frozen = {"embeddings": jnp.asarray(gaussian_embeddings(61, 8, seed=1))}
    loss_fn = make_flow_loss(FlowLossSettings(**settings))
    return p, lambda p: loss_fn(nnx.merge(g, p), batch, jax.random.key(0), frozen)


def _loss_and_grads(model, **settings):
    """(loss, metrics), grads of `_fixed_loss`."""
    p, f = _fixed_loss(model, **settings)
    return jax.jit(jax.value_and_grad(f, has_aux=True))(p)


def _loss(model, **settings) -> float:
    """The loss of `_fixed_loss`, forward only."""
    p, f = _fixed_loss(model, **settings)
    return float(jax.jit(lambda p: f(p)[0])(p))


def test_aux_head_adds_its_weighted_ce_and_leaves_the_residual_alone():
    cfg = dataclasses.replace(_cfg().model, vocab_size=61, flow_aux_head=True, flow_embed_head=False)
    model = build_model(cfg, nnx.Rngs(0))
    model.out_aux[...] = 0.1 * jax.random.normal(jax.random.key(2), model.out_aux.shape)
    (_, m0), g0 = _loss_and_grads(model, aux_weight=0.0)
    (loss2, m2), g2 = _loss_and_grads(model, aux_weight=2.0)
    assert "aux_ce" not in m0 and float(jnp.abs(g0["out_aux"][...]).sum()) == 0.0  # off: the head is unused
    # on: loss = the flow CE (unchanged: the aux head does not enter the posterior) + 2 x its own CE
    assert float(m2["ce"]) == pytest.approx(float(m0["ce"]), abs=1e-6)
    assert float(loss2) == pytest.approx(float(m2["ce"]) + 2.0 * float(m2["aux_ce"]), rel=1e-6)
    assert float(m2["aux_ce"]) > 0 and float(jnp.abs(g2["out_aux"][...]).sum()) > 0
    z = jax.random.normal(jax.random.key(3), (2, 5, 8))
    t = jnp.asarray([0.3, 0.7])
    graphdef, params = nnx.split(model)

    @jax.jit  # run op by op, the two forwards compile ~100 small programs
    def both(p):
        m = nnx.merge(graphdef, p)
        return m.logits_and_aux(z, jnp.zeros_like(z), t), m(z, jnp.zeros_like(z), t)

    (f, f_aux), plain_f = both(params)
    assert jnp.array_equal(f, plain_f) and f_aux.shape == f.shape
    plain = build_model(dataclasses.replace(cfg, flow_aux_head=False), nnx.Rngs(0))
    with pytest.raises(ValueError, match="auxiliary head"):
        plain.logits_and_aux(z, z, t)


def test_times_per_position():
    cfg = dataclasses.replace(_cfg().model, vocab_size=61, flow_embed_head=False)
    model = build_model(cfg, nnx.Rngs(0))
    for block in model.blocks:  # non-zero modulation, so that t reaches every block
        block.modulation[...] = 0.1 * jax.random.normal(jax.random.key(4), block.modulation.shape)
    model.out[...] = 0.1 * jax.random.normal(jax.random.key(5), model.out.shape)
    z = jax.random.normal(jax.random.key(3), (2, 5, 8))
    t = jnp.asarray([0.3, 0.7])
    per_row = model(z, jnp.zeros_like(z), t)
    # the same time at every position is the per-row model; a time per position changes the output
    same = model(z, jnp.zeros_like(z), jnp.broadcast_to(t[:, None], (2, 5)))
    assert float(jnp.abs(same - per_row).max()) < 1e-5
    tl = jnp.asarray([[0.3, 0.3, 0.9, 0.3, 0.3], [0.7] * 5])
    mixed = model(z, jnp.zeros_like(z), tl)
    assert float(jnp.abs(mixed[0] - per_row[0]).max()) > 1e-3 and float(jnp.abs(mixed[1] - per_row[1]).max()) < 1e-5
    (loss, _), grads = _loss_and_grads(model, per_position_t=1.0)  # every row: t [B, L] through the loss
    assert np.isfinite(float(loss)) and all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(grads))
    from relf_jax.flow.losses import sample_times
    assert sample_times(jax.random.key(0), (3, 4), "logit_normal").shape == (3, 4)


def test_late_times_follow_their_law():
    """t = 1 - (1 - u)^2: P(t <= x) = 1 - sqrt(1 - x), half the draws above 0.75."""
    from relf_jax.flow.losses import sample_times

    t = np.asarray(sample_times(jax.random.key(3), 200_000, "late"))
    assert 0.0 <= t.min() and t.max() < 1.0
    for x in (0.25, 0.5, 0.75, 0.9, 0.99):
        assert abs(float(np.mean(t <= x)) - (1.0 - np.sqrt(1.0 - x))) < 5e-3, x
    with pytest.raises(ValueError, match="unknown t distribution"):
        sample_times(jax.random.key(0), 4, "early")


def test_clean_start_rows_draw_near_one_and_the_rest_keep_their_law():
    from relf_jax.flow.losses import training_times

    key, k_pos = jax.random.key(5), jax.random.key(6)
    s = FlowLossSettings()
    t_min = jnp.asarray([0.98] * 4000 + [0.0] * 4000, jnp.float32)
    t = np.asarray(training_times(key, k_pos, s, (8000, 3), t_min))
    near, rest = t[:4000], t[4000:]
    assert near.min() >= 0.98 and near.max() < 1.0 and abs(near.mean() - 0.99) < 1e-3
    assert rest.min() < 0.05 and abs(rest.mean() - 0.5) < 0.02  # uniform, as without a clean start
    assert np.array_equal(rest, np.asarray(training_times(key, k_pos, s, (8000, 3)))[4000:])
    # with times per position the clean rows are near 1 at every position
    tp = np.asarray(training_times(key, k_pos, FlowLossSettings(per_position_t=1.0), (8000, 3), t_min))
    assert tp.shape == (8000, 3) and tp[:4000].min() >= 0.98 and tp[4000:].min() < 0.05
    # and the loss reads the batch field: near-clean rows, a lower loss from the first step
    model = build_model(dataclasses.replace(_cfg().model, vocab_size=61, flow_blind_spot=False), nnx.Rngs(0))
    batch = {k: jnp.asarray(v) for k, v in next(CountingBatches()).items()}
    frozen = {"embeddings": jnp.asarray(gaussian_embeddings(61, 8, seed=1))}
    loss_fn = make_flow_loss(FlowLossSettings())
    plain = float(loss_fn(model, batch, jax.random.key(0), frozen)[0])
    clean = float(loss_fn(model, {**batch, "t_min": jnp.full((8,), 0.98)}, jax.random.key(0), frozen)[0])
    assert np.isfinite(clean) and clean < plain - 0.5


def test_clean_start_schedules_its_batches_and_resumes():
    from relf_jax.flow.recipes import CleanStart, clean_start_steps

    cfg = make_config("cpu", ["model=relf", "train.steps=1200"])
    assert cfg.flow.clean_start == 0.4 and clean_start_steps(cfg) == 480  # on by default (12-07)
    assert clean_start_steps(make_config("cpu", ["model=relf", "flow.clean_start=0"])) == 0
    for bad in ("flow.clean_start=1", "flow.clean_t=1", "flow.clean_start=-0.1"):
        with pytest.raises(Exception, match="clean_start"):
            make_config("cpu", ["model=relf", bad])
    data = CleanStart(CountingBatches(), steps=3, t_min=0.98)
    firsts = [next(data)["t_min"] for _ in range(2)]
    assert all(f.shape == (8,) and (f == np.float32(0.98)).all() for f in firsts)
    state = data.get_state()
    later = [next(data)["t_min"][0] for _ in range(3)]
    assert later == [np.float32(0.98), 0.0, 0.0]
    again = CleanStart(CountingBatches(), steps=3, t_min=0.98)
    again.set_state(state)
    assert [next(again)["t_min"][0] for _ in range(3)] == later
    assert next(again)["tokens"].tolist() == next(data)["tokens"].tolist()  # the data resumes with it
    legacy = CleanStart(CountingBatches(), steps=3, t_min=0.98)
    legacy.set_state(CountingBatches().get_state())  # saved before the clean start: resumed past it
    assert next(legacy)["t_min"][0] == 0.0


def test_blind_spot_residual_never_reads_its_own_position():
    cfg = dataclasses.replace(_cfg().model, vocab_size=61, flow_blind_spot=True, flow_embed_head=False)
    model = build_model(cfg, nnx.Rngs(0))
    for block in [*model.blocks, *model.blocks_bwd]:  # non-zero modulation and head: a generic network
        block.modulation[...] = 0.1 * jax.random.normal(jax.random.key(4), block.modulation.shape)
    model.out[...] = 0.1 * jax.random.normal(jax.random.key(5), model.out.shape)
    z = jax.random.normal(jax.random.key(3), (2, 6, 8))
    sc = jax.random.normal(jax.random.key(6), (2, 6, 8))
    t = jnp.asarray([0.3, 0.7])
    moved_at = (0, 3, 5)
    # one forward of the unchanged rows and, for each i, the rows with position i's inputs moved
    zs = jnp.concatenate([z, *(z.at[:, i].add(1.0) for i in moved_at)])
    scs = jnp.concatenate([sc, *(sc.at[:, i].add(1.0) for i in moved_at)])
    g, p = nnx.split(model)
    out = jax.jit(lambda p: nnx.merge(g, p)(zs, scs, jnp.tile(t, 1 + len(moved_at))))(p).reshape(
        1 + len(moved_at), *z.shape[:2], -1)
    f = out[0]
    for i, moved in zip(moved_at, out[1:]):  # changing position i's inputs changes every residual but its own
        assert float(jnp.abs(moved[:, i] - f[:, i]).max()) < 1e-5
        others = jnp.delete(jnp.abs(moved - f), i, axis=1)
        assert float(others.max(axis=(0, 2)).min()) > 1e-4
    # the context loss is the CE of the bounded residual alone (singular logits off in training)
    ctx, plain, paper = (_loss(model, context_loss=True, self_condition_prob=0.0),
                         _loss(model, use_singular=False, self_condition_prob=0.0),
                         _loss(model, self_condition_prob=0.0))
    assert ctx == pytest.approx(plain, rel=1e-6) and abs(ctx - paper) > 1e-3
    # self-conditioning guesses X1_hat as the sampler does: with the singular logits
    ctx_sc, plain_sc = (_loss(model, context_loss=True, self_condition_prob=1.0),
                        _loss(model, use_singular=False, self_condition_prob=1.0))
    assert abs(ctx_sc - plain_sc) > 1e-4


def test_relf_cli_train_and_sample(tmp_path, capsys):
    from experiments.launch import main
    from relf_jax.flow.generate import flow_prompt_mode, sample_relf
    from relf_jax.loading import load_model

    wd = str(tmp_path)
    # trained with clean prompts in half its rows: the model gets the prompt input, prompted
    # sampling holds the prompt clean
    assert main(["train", "--preset", "tiny", "--workdir", wd, "model=relf", "data.source=chatterbot",
                 "train.steps=5", "train.progress=false", "flow.prompt_prob=0.5"]) == 0
    lm = load_model(wd, "relf")
    assert lm.model_cfg.flow_prompt_input and flow_prompt_mode(lm) == "clean"
    s = sample_relf(lm, 4, nfe=4, length=16, batch_size=4)
    assert len(s.texts) == 4 and s.target_forwards == 16
    prompts = ["<user> hello <assistant>", "<user> how are you today <assistant>"]
    for mode in ("clean", "renoise"):  # the shapes of the CLI call below: one compilation each
        r = sample_relf(lm, prompts=prompts, nfe=4, sampler="stochastic", batch_size=2, prompt_mode=mode)
        assert len(r.texts) == 2 and r.target_forwards == 8
        assert all(lm.tokenizer.bos_id not in ids and lm.tokenizer.eos_id not in ids for ids in r.token_ids)
    with pytest.raises(UserError, match="no room"):
        sample_relf(lm, prompts=["<user> " + "word " * 40], nfe=2, length=8, batch_size=1)
    assert main(["sample", "--workdir", wd, "model=relf", "nfe=4", "sampler=stochastic", "sample.num_samples=2",
                 "sample.batch_size=2", "--prompt", "<user> hello <assistant>"]) == 0
    assert "network calls" in capsys.readouterr().err


def test_one_reflow_round_lowers_straightness(tmp_path):
    from relf_jax.flow.reflow import PairBatches, make_reflow_loss, measure_straightness, rollout_pairs

    cfg = _cfg("train.steps=60")
    model_cfg = dataclasses.replace(cfg.model, vocab_size=61)
    table = jnp.asarray(gaussian_embeddings(61, 8, seed=0))
    settings = FlowLossSettings(residual_bound=10.0)
    base = train(cfg, model_cfg, make_flow_loss(settings), CountingBatches(), workdir=str(tmp_path / "base"),
                 tensorboard=False, frozen={"embeddings": table})
    z0, toks = rollout_pairs(base.graphdef, base.params, table, jax.random.key(7), n=64, length=32,
                             settings=settings, nfe=32, batch=16)
    before = measure_straightness(base.graphdef, base.params, table, z0, toks, settings=settings)
    cfg2 = _cfg("train.steps=150", "train.learning_rate=3e-3")
    round1 = train(cfg2, model_cfg, make_reflow_loss(settings, data_weight=0.2),
                   PairBatches(z0, toks, CountingBatches(), batch_size=8), workdir=str(tmp_path / "r1"),
                   tensorboard=False, frozen={"embeddings": table}, init_params=base.params)
    after = measure_straightness(round1.graphdef, round1.params, table, z0, toks, settings=settings)
    print(f"straightness before {before:.3f} after {after:.3f}")
    assert after < 0.9 * before, (before, after)


def test_reflow_loss_weights_and_the_no_pairs_control():
    from relf_jax.flow.reflow import PairBatches, make_reflow_loss

    cfg = dataclasses.replace(_cfg().model, vocab_size=61)
    g, p = nnx.split(build_model(cfg, nnx.Rngs(0)))
    frozen = {"embeddings": jnp.asarray(gaussian_embeddings(61, 8, seed=1))}
    rng = np.random.default_rng(0)
    z0 = rng.standard_normal((16, 32, 8)).astype(np.float32)
    pairs = PairBatches(z0, rng.integers(0, 61, (16, 32)).astype(np.int32), CountingBatches(), batch_size=4)
    batch = {k: jnp.asarray(v) for k, v in next(pairs).items()}
    key = jax.random.key(3)
    settings = FlowLossSettings(residual_bound=10.0)

    def run(loss_fn, k=key):
        return jax.jit(lambda p: loss_fn(nnx.merge(g, p), batch, k, frozen))(p)

    control, aux = run(make_reflow_loss(settings, data_weight=1.0, pair_weight=0.0))
    data, _ = run(make_flow_loss(settings), jax.random.split(key, 3)[2])  # the data term's own key
    assert "pair_ce" not in aux and float(control) == pytest.approx(float(data), rel=1e-6)
    one, aux1 = run(make_reflow_loss(settings, data_weight=0.2, pair_weight=1.0))
    two, _ = run(make_reflow_loss(settings, data_weight=0.2, pair_weight=2.0))
    assert float(two - one) == pytest.approx(float(aux1["pair_ce"]), rel=1e-5)
    assert float(one) == pytest.approx(float(aux1["pair_ce"] + 0.2 * aux1["data_ce"]), rel=1e-5)
    with pytest.raises(ValueError, match="not both 0"):
        make_reflow_loss(settings, data_weight=0.0, pair_weight=0.0)


def test_relf_cli_refusals_compile_once_and_reflow_rounds(tmp_path, capsys):
    """One tiny ReLF model trained through the CLI (shared by three checks, one compile):
    resuming it with settings that change the network is refused with a reason; `sample_relf`
    compiles once across calls; the `reflow` command's plumbing at toy sizes (that a round
    straightens the coupling is test_one_reflow_round_lowers_straightness's check)."""
    import json

    import relf_jax as rj
    from experiments.launch import main
    from relf_jax.flow.generate import relf_tokens, sample_relf, sampler_settings
    from relf_jax.loading import load_model

    wd = str(tmp_path)
    assert main(["train", "--preset", "tiny", "--workdir", wd, "model=relf", "data.source=chatterbot",
                 "train.steps=2", "train.progress=false", "data.seq_len=16"]) == 0
    # resuming it with clean-prompt training would change the network: refused, with a reason
    assert main(["train", "--preset", "tiny", "--workdir", wd, "model=relf", "data.source=chatterbot",
                 "train.steps=3", "train.progress=false", "data.seq_len=16", "flow.prompt_prob=0.5"]) == 2
    assert "without clean prompts" in capsys.readouterr().err
    assert main(["train", "--preset", "tiny", "--workdir", wd, "model=relf", "data.source=chatterbot",
                 "train.steps=3", "train.progress=false", "data.seq_len=16", "flow.aux_weight=1"]) == 2
    assert "without an auxiliary head" in capsys.readouterr().err
    assert main(["train", "--preset", "tiny", "--workdir", wd, "model=relf", "data.source=chatterbot",
                 "train.steps=3", "train.progress=false", "data.seq_len=16", "flow.blind_spot=false"]) == 2
    assert "resume it with flow.blind_spot=true" in capsys.readouterr().err  # the default reads its context
    lm = load_model(wd, "relf")
    before = relf_tokens._cache_size()
    for seed in range(3):
        sample_relf(lm, 2, nfe=3, batch_size=2, seed=seed)
    assert relf_tokens._cache_size() - before == 1
    # the time grid is a decoding choice (Flow.grid, sample_relf(grid=)), the model's flow.grid by default
    assert sampler_settings(lm, Flow()).grid == lm.cfg.flow.grid
    assert sampler_settings(lm, Flow(grid="cosine")).grid == "cosine"
    sample_relf(lm, 2, nfe=3, batch_size=2, seed=0, grid="cosine")
    assert relf_tokens._cache_size() - before == 2

    assert main(["reflow", "--workdir", wd, "--rounds", "2", "--pairs", "4", "--steps", "2"]) == 0
    rounds = json.loads((tmp_path / "reflow.json").read_text())
    assert [r["round"] for r in rounds] == [1, 2]
    assert [r["settings"]["steps"] for r in rounds] == [2, 2] and [r["settings"]["num_pairs"] for r in rounds] == [4, 4]
    assert all(r["straightness_after"] > 0 and r["straightness_before"] > 0 for r in rounds)
    lm = rj.load(str(tmp_path / "relf_reflow2"))
    assert lm.step == 2
    assert len(rj.generate(lm, None, rj.SamplingParams(n=2, batch_size=2), method=rj.Flow(nfe=2))) == 2

    # `relf_core.topic_knowledge` on it and an AR model of the same workdir (the same tokenizer):
    # one row for AR, one per ReLF time, written to its file; a model with another tokenizer is refused
    from experiments.bench.relf_core import topic_knowledge

    assert main(["train", "--preset", "tiny", "--workdir", wd, "data.source=chatterbot", "train.steps=2",
                 "train.progress=false", "data.seq_len=16"]) == 0
    report = topic_knowledge(str(tmp_path / "topic.json"), wd, [wd], n=3, times=(0.5, 1.0), unigram_rows=20)
    reader = f"bag-of-tokens reader on {wd}'s Z"
    assert [r["model"] for r in report["rows"]] == ["ar p(x_i | x_<i)", f"{wd} p(x_i | Z_-i), t = 0.5",
                                                     f"{reader}, t = 0.5", f"{wd} p(x_i | Z_-i), t = 1",
                                                     f"{reader}, t = 1"]
    for r in report["rows"]:
        share = r["posterior_on_true_topic" if r["model"].startswith(reader) else "true_topic_share"]
        assert r["chance"] == 1 / 8 and (np.isnan(share) or 0 <= share <= 1)
    assert json.loads((tmp_path / "topic.json").read_text())["num_conversations"] == 3
    other = str(tmp_path / "other")
    assert main(["train", "--preset", "tiny", "--workdir", other, "model=relf", "data.source=chatterbot",
                 "train.steps=1", "train.progress=false", "data.seq_len=16", "data.vocab_size=200"]) == 0
    with pytest.raises(UserError, match="another tokenizer"):
        topic_knowledge(str(tmp_path / "topic2.json"), wd, [other], n=3, times=(1.0,))


def test_a_reflow_round_is_reused_only_under_its_own_settings(tmp_path):
    from relf_jax.checkpoint import Checkpointer
    from relf_jax.flow.recipes import check_round_settings

    spec = {"data_weight": 1.0, "pair_weight": 1.0, "num_pairs": 512, "rollout_nfe": 64, "steps": 600}
    check_round_settings(str(tmp_path / "none"), None, spec, "relf_reflow")  # nothing there: fine
    for name, meta, record in (("new", {"reflow": spec}, None), ("old", {}, {"settings": spec})):
        ckpt = Checkpointer(str(tmp_path / name), async_save=False)
        ckpt.save(600, {"w": np.zeros(2, np.float32)}, meta=meta)
        ckpt.close()
        check_round_settings(str(tmp_path / name), record, spec, "relf_reflow")  # same settings
        with pytest.raises(UserError, match="data_weight=1.0.*not data_weight=0.2"):
            check_round_settings(str(tmp_path / name), record, {**spec, "data_weight": 0.2}, "relf_reflow")
    # a round whose settings were never written cannot be told apart: refused
    with pytest.raises(UserError, match="unknown settings.*another --name"):
        check_round_settings(str(tmp_path / "old"), {"round": 1}, spec, "relf_reflow")


def _generic(model):
    """Non-zero modulation and output head: a generic network rather than a fresh one."""
    blocks = [*model.blocks, *((*model.blocks_bwd, *model.query_blocks) if model.blind_spot else [])]
    for i, block in enumerate(blocks):
        block.modulation[...] = 0.1 * jax.random.normal(jax.random.key(40 + i), block.modulation.shape)
    model.out[...] = 0.1 * jax.random.normal(jax.random.key(5), model.out.shape)
    if model.out_emb is not None:
        model.out_emb[...] = 0.1 * jax.random.normal(jax.random.key(6), model.out_emb.shape)
    if getattr(model, "bag", None) is not None:
        model.bag[2][...] = 0.1 * jax.random.normal(jax.random.key(7), model.bag[2].shape)
    return model


@pytest.mark.parametrize("blind_spot, query_layers, bag", [(False, 0, False), (True, 0, False), (True, 2, False),
                                                         (True, 0, True)])
def test_packed_segments_never_attend_across(blind_spot, query_layers, bag):
    cfg = dataclasses.replace(_cfg().model, vocab_size=61, flow_blind_spot=blind_spot,
                              num_layers=2 + query_layers, flow_query_layers=query_layers, flow_bag_input=bag)
    g, p = nnx.split(_generic(build_model(cfg, nnx.Rngs(0))))
    table = jnp.asarray(gaussian_embeddings(61, 8, seed=1))
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    z = jax.random.normal(jax.random.key(3), (2, 8, 8))
    sc = jax.random.normal(jax.random.key(6), (2, 8, 8))
    t = jnp.asarray([0.4, 0.4])
    moved_z = z.at[0, 3:].add(1.0)  # segment 2 (and the pad) of row 0
    fn = jax.jit(lambda p, z, sc, s: nnx.merge(g, p)(z, sc, t, None, s, embeddings=table))
    f, moved = fn(p, z, sc, seg), fn(p, moved_z, sc.at[0, 3:].add(1.0), seg)
    assert float(jnp.abs(moved[0, :3] - f[0, :3]).max()) == 0.0  # segment 1 never sees segment 2
    assert float(jnp.abs(moved[0, 3:7] - f[0, 3:7]).max()) > 1e-4
    # a segment computes what it would alone in its own row, from position 0 (positions restart)
    alone = fn(p, jnp.pad(z[:1, 3:7], ((0, 0), (0, 4), (0, 0))), jnp.pad(sc[:1, 3:7], ((0, 0), (0, 4), (0, 0))),
               jnp.asarray([[1, 1, 1, 1, 0, 0, 0, 0]], jnp.int32))
    np.testing.assert_allclose(alone[0, :4], f[0, 3:7], atol=1e-5)
    # no segment ids: one segment, as before
    np.testing.assert_allclose(fn(p, z, sc, None)[1], f[1], atol=1e-6)


def test_flow_loss_on_packed_rows_is_spent_on_text_only():
    cfg = dataclasses.replace(_cfg().model, vocab_size=61, flow_blind_spot=True)
    g, p = nnx.split(_generic(build_model(cfg, nnx.Rngs(0))))
    frozen = {"embeddings": jnp.asarray(gaussian_embeddings(61, 8, seed=1))}
    tokens = jax.random.randint(jax.random.key(1), (2, 13), 3, 61)
    seg = jnp.asarray([[1] * 5 + [2] * 4 + [0] * 4, [1] * 12 + [0]], jnp.int32)
    loss_fn = make_flow_loss(FlowLossSettings(context_loss=True))

    def run(tok):
        return jax.jit(lambda p: loss_fn(nnx.merge(g, p), {"tokens": tok, "segment_ids": seg}, jax.random.key(0),
                                         frozen))(p)

    loss, m = run(tokens)
    assert float(m["tokens"]) == 5 + 4 + 12  # the text positions, no pad
    other_pad = tokens.at[0, 9:].set(7).at[1, 12].set(9)  # the pad positions' ids do not matter
    np.testing.assert_allclose(float(run(other_pad)[0]), float(loss), rtol=1e-6)
    assert abs(float(run(tokens.at[0, 6].set(8))[0]) - float(loss)) > 1e-5  # a text token does


@pytest.mark.parametrize("evidence, query_layers, bag", [(False, 0, False), (True, 0, False), (False, 2, False),
                                                         (False, 0, True)])
def test_default_relf_reads_its_context_exactly_by_gradient(evidence, query_layers, bag):
    """The default network's output at i has zero gradient w.r.t. Z_i and a non-zero one w.r.t.
    its neighbours (segment-packed row: nothing from the other segment either); so has the
    network that also reads each position's own evidence (a function of Z_j alone), the one
    with query layers over both streams, and the one with a leave-one-out bag input."""
    cfg = make_config("tiny", ["model=relf"]).model
    assert cfg.flow_blind_spot
    cfg = dataclasses.replace(cfg, vocab_size=61, flow_evidence_input=evidence, flow_bag_input=bag,
                              num_layers=cfg.num_layers + query_layers, flow_query_layers=query_layers)
    model = _generic(build_model(cfg, nnx.Rngs(0)))
    assert len(model.query_blocks) == query_layers and len(model.blocks) == len(model.blocks_bwd) == 1
    g, p = nnx.split(model)
    z = jax.random.normal(jax.random.key(3), (1, 7, cfg.flow_embed_dim))
    sc = jnp.zeros_like(z)
    seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 2]], jnp.int32)
    table = jnp.asarray(gaussian_embeddings(61, cfg.flow_embed_dim, seed=2, norm=3.0))
    if evidence:
        with pytest.raises(ValueError, match="evidence"):
            nnx.merge(g, p)(z, sc, jnp.asarray([0.5]), None, seg)
    f = lambda z: network_residual(nnx.merge(g, p), z, sc, jnp.asarray([0.5]), None, seg, table)[0]
    jac = jax.jit(jax.jacrev(lambda z: f(z).sum(-1)))(z)[:, 0]  # [L (out), L (in), d]
    size = jnp.abs(jac).sum(-1)  # [out, in]
    assert float(jnp.diagonal(size).max()) == 0.0  # never its own input
    same = (seg[0][:, None] == seg[0][None, :]) & ~jnp.eye(7, dtype=bool)
    assert float(jnp.where(same, size, 0.0).min(where=same, initial=1.0)) > 0  # every neighbour in its segment
    assert float(jnp.where(seg[0][:, None] != seg[0][None, :], size, 0.0).max()) == 0.0  # nothing across


def test_the_default_config_is_the_context_reading_relf():
    from relf_jax.data.prepare import row_mode
    from relf_jax.flow.recipes import flow_loss_settings

    cfg = make_config("cpu", ["model=relf"])
    assert cfg.flow.blind_spot and cfg.model.flow_blind_spot
    assert cfg.model.flow_embed_head  # the residual head reads the fixed embeddings too (12-07)
    assert flow_loss_settings(cfg).context_loss  # trained as p(x_i | Z_{-i})
    assert row_mode(cfg) == "segments"  # several whole conversations per row, loss on text
    plain = make_config("cpu", ["model=relf", "flow.blind_spot=false"])
    assert not flow_loss_settings(plain).context_loss
    # the even-layer rule binds the default ReLF only
    with pytest.raises(Exception, match="even number"):
        make_config("cpu", ["model=relf", "model.num_layers=3"])
    assert make_config("cpu", ["model.num_layers=3"]).model.num_layers == 3
    # query layers are an option (bench relf core's "query" variant): they cost 1.4-1.6x a forward
    assert cfg.model.flow_query_layers == 0
    from experiments.bench.relf_variants import CORE_VARIANTS
    query = make_config("cpu", ["model=relf", *CORE_VARIANTS["query"]]).model
    assert query.flow_query_layers == 2 and query.num_layers - query.flow_query_layers == 2
    # with full key/value heads in the ReLF network only; the AR model of the same config keeps its own
    assert query.resolved_flow_kv_heads == query.num_heads == 4 and query.num_kv_heads == cfg.model.num_kv_heads
    assert cfg.model.resolved_flow_kv_heads == cfg.model.num_kv_heads == 2
    with pytest.raises(Exception, match="flow_kv_heads"):
        make_config("cpu", ["model=relf", "model.flow_kv_heads=3"])
    with pytest.raises(Exception, match="flow_query_layers"):  # 4 - 1 layers cannot split into two streams
        make_config("cpu", ["model=relf", "model.flow_query_layers=1"])
    # the leave-one-out bag input: on by default (12-07, eighth session), the blind-spot network's own
    assert cfg.model.flow_bag_input and build_model(dataclasses.replace(cfg.model, vocab_size=61),
                                                    nnx.Rngs(0)).bag is not None
    plain_model = dataclasses.replace(plain.model, vocab_size=61, flow_blind_spot=False)
    assert build_model(plain_model, nnx.Rngs(0)).bag is None
    assert make_config("cpu", ["model=relf", "model.num_layers=3", "flow.blind_spot=false"])


def test_resuming_with_other_query_layers_or_key_value_heads_is_refused(tmp_path, monkeypatch):
    import dataclasses

    from relf_jax.errors import UserError
    from relf_jax.flow import recipes

    (tmp_path / "checkpoints").mkdir()
    cfg = make_config("cpu", ["model=relf"]).model
    saved = dataclasses.asdict(dataclasses.replace(cfg, flow_query_layers=2, flow_kv_heads=4))
    monkeypatch.setattr(recipes, "latest_meta", lambda model_dir: {"model": saved})
    recipes.check_resumable(str(tmp_path), dataclasses.replace(cfg, flow_query_layers=2, num_kv_heads=4))
    with pytest.raises(UserError, match="with 2 query layers; resume it with model.flow_query_layers=2"):
        recipes.check_resumable(str(tmp_path), dataclasses.replace(cfg, flow_kv_heads=4))
    with pytest.raises(UserError, match="with 4 key/value heads; resume it with model.flow_kv_heads=4"):
        recipes.check_resumable(str(tmp_path), dataclasses.replace(cfg, flow_query_layers=2))
    # a checkpoint written before the fields existed: no query layers, model.num_kv_heads heads
    saved = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("flow_query_layers", "flow_kv_heads")}
    recipes.check_resumable(str(tmp_path), cfg)
    # the paper's plain network has no query layers to compare
    saved = dataclasses.asdict(dataclasses.replace(cfg, flow_blind_spot=False))
    recipes.check_resumable(str(tmp_path), dataclasses.replace(cfg, flow_blind_spot=False, flow_query_layers=2))
    # a checkpoint written before the bag input existed has none: resuming it under the new default
    # is refused with the setting to use
    saved = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "flow_bag_input"}
    with pytest.raises(UserError, match="without a leave-one-out bag input; resume it with model.flow_bag_input=false"):
        recipes.check_resumable(str(tmp_path), cfg)
    recipes.check_resumable(str(tmp_path), dataclasses.replace(cfg, flow_bag_input=False))


def test_segment_length_prior_draws_and_travels_with_safetensors(tmp_path):
    from relf_jax.checkpoint import EMBEDDINGS_FILE, LENGTHS_FILE, LoadedModel
    from relf_jax.data.tokenizer import train_tokenizer
    from relf_jax.export import safetensors_io
    from relf_jax.flow.lengths import draw_segment_lengths, flow_lengths, segment_rows

    counts = np.zeros(9, np.int64)
    counts[[3, 5, 8]] = [10, 30, 5]
    rng = np.random.default_rng(0)
    drawn = draw_segment_lengths(counts, rng, 2000)
    assert set(drawn.tolist()) == {3, 5, 8} and abs(np.mean(drawn == 5) - 30 / 45) < 0.04
    long_prompt = draw_segment_lengths(counts, rng, 50, min_len=6)
    assert set(long_prompt.tolist()) == {8}  # longer than the prompt
    assert draw_segment_lengths(counts, rng, 1, min_len=9).tolist() == [8]  # none fits: the longest
    np.testing.assert_array_equal(segment_rows(np.asarray([2, 4]), 5),
                                  [[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    # a model trained on segment rows keeps its prior through a safetensors round trip
    cfg = make_config("tiny", ["model=relf"])
    tok = train_tokenizer(["one two three", "two three four five"] * 20, 40)
    mc = dataclasses.replace(cfg.model, vocab_size=tok.vocab_size)
    g, p = nnx.split(build_model(mc, nnx.Rngs(0)))
    model_dir = tmp_path / "relf"
    model_dir.mkdir()
    np.save(model_dir / EMBEDDINGS_FILE, np.ones((mc.vocab_size, mc.flow_embed_dim), np.float32))
    np.save(model_dir / LENGTHS_FILE, counts)
    lm = LoadedModel(cfg=cfg, model_cfg=mc, graphdef=g, params=p, tokenizer=tok, step=1,
                     model_dir=str(model_dir))
    np.testing.assert_array_equal(flow_lengths(lm), counts)
    back = safetensors_io.load_safetensors(safetensors_io.save_safetensors(lm, str(tmp_path / "m.safetensors")))
    np.testing.assert_array_equal(flow_lengths(back), counts)
    no_prior = dataclasses.replace(lm, model_dir=str(tmp_path))
    assert flow_lengths(no_prior) is None  # a model trained on whole rows


def test_relf_engine_writes_one_segment_of_a_drawn_length_for_a_segment_trained_model():
    from relf_jax.serving import engines as E
    from relf_jax.serving.engine_api import RequestParams
    from tests._serving import tiny_lm

    tok = E.ByteTokenizer()
    prompt = [2] + tok.encode("<user> hi <assistant>")
    lm = tiny_lm("relf")
    length = lm.cfg.data.seq_len
    counts = np.zeros(length + 1, np.int64)
    counts[[len(prompt) + 3, len(prompt) + 5]] = 1  # a prior with two lengths, both past the prompt
    lm = dataclasses.replace(lm, extras={**lm.extras, "flow.lengths": counts})
    eng = E.ReLFEngine(lm, 2, method=Flow(nfe=3))
    seen = set()
    for seed in range(6):
        state = eng.insert(eng.prefill(prompt, RequestParams(64, seed=seed)), eng.init_state(), 1)
        seg_len = int(np.asarray(state.segment_len)[1])
        seen.add(seg_len)
        state, out = eng.generate(state)
        assert out.done[1] and len(out.tokens[1]) <= seg_len - len(prompt)  # nothing past the segment
        again = eng.insert(eng.prefill(prompt, RequestParams(64, seed=seed)), eng.init_state(), 0)
        assert int(np.asarray(again.segment_len)[0]) == seg_len  # drawn from the request's seed
    assert seen == {len(prompt) + 3, len(prompt) + 5}
    whole = E.ReLFEngine(tiny_lm("relf"), 1, method=Flow(nfe=3))  # no prior: the whole row, as before
    assert int(np.asarray(whole.insert(whole.prefill(prompt, RequestParams(64, seed=0)), whole.init_state(),
                                       0).segment_len)[0]) == length
