"""`bench spec`'s verification-cost probe on a tiny model: shapes of the report, sane numbers."""

from relf_jax.checkpoint import LoadedModel
from relf_jax.config import Config
from relf_jax.speculative.cost import forward_costs


def test_forward_costs_reports_both_batches(tiny_model, tiny_model_cfg):
    graphdef, params = tiny_model
    lm = LoadedModel(cfg=Config(), model_cfg=tiny_model_cfg, graphdef=graphdef, params=params, tokenizer=None, step=0)
    out = forward_costs(lm, k=3, batches=(1, 2), context=16, reps=2)
    assert set(out) == {"b1", "b2"}
    for row in out.values():
        assert row["one_token_ms"] > 0 and row["4_tokens_ms"] > 0
        assert abs(row["ratio"] - row["4_tokens_ms"] / row["one_token_ms"]) < 1e-9
