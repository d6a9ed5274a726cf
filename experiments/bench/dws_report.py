"""`relf-jax bench dws`, after the measurements: every predictor's cost of the test requests, their
errors against the measured costs, the report's ratios and the plots; plain arrays and dicts in,
so they run (and are tested) without a model. `experiments.bench.dws` runs the measurements.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from relf_jax.dws import cost_model as cm
from relf_jax.dws.metrics import cost_errors

# "dws": the surface predictor with the length block head (expected cost, as methods.md prices a
# surface); "dws_continue": the same with methods.md's continuation block head; "dws_median":
# the headline predictor's median cost (`CostModel.sample_costs`), the MAE-optimal point of the
# same predicted distribution (the scalar baselines regress log(1 + y), also median-like)
PREDICTORS = ("dws", "dws_continue", "dws_median", "length", "steps", "prompt_len", "oracle")
# The ceilings: each scalar baseline's cost line fed the request's *realised* scalar (reply
# length in tokens, total steps) instead of a prediction, fitted on the probes the same way.
# oracle / length_oracle is the most the DWS-over-length error ratio could reach with perfect
# predictors on this model's workload; steps_oracle likewise for total steps.
SCALAR_ORACLES = ("length_oracle", "steps_oracle")


def price_requests(model: cm.CostModel, m_test: np.ndarray, test_maps: np.ndarray, s_test: np.ndarray,
                   s_continue: np.ndarray, scalars: dict, probe_cost: np.ndarray) -> dict[str, np.ndarray]:
    """Every predictor's cost [n] of the test requests (prompt lengths m_test in blocks): the cost
    model prices the surfaces (dws: s_test, its median cost: dws_median, dws_continue:
    s_continue, oracle: the executed maps test_maps); each scalar (name -> (probe values, test
    values)) is priced by a line fitted on the probes' measured costs, a constant probe scalar of
    a SCALAR_ORACLES entry by the probes' mean cost."""
    pred_cost = {"dws": model.predict(m_test, s_test), "oracle": model.predict(m_test, test_maps),
                 "dws_continue": model.predict(m_test, s_continue),
                 "dws_median": np.median(model.sample_costs(m_test, s_test), axis=1)}
    for name, (xp, xt) in scalars.items():
        if name in SCALAR_ORACLES and np.all(xp == xp[0]):  # every probe the same length: no slope
            pred_cost[name] = np.full(len(xt), float(np.mean(probe_cost)))
        else:
            pred_cost[name] = cm.fit_scalar_cost(xp, probe_cost).predict(xt)
    return pred_cost


def cost_error_table(pred_cost: dict[str, np.ndarray], test_cost: np.ndarray) -> dict[str, dict[str, float]]:
    """`cost_errors` of each of PREDICTORS and SCALAR_ORACLES against the measured test costs."""
    return {name: cost_errors(pred_cost[name], test_cost) for name in PREDICTORS + SCALAR_ORACLES}


def error_ratios(errors: dict[str, dict[str, float]]) -> dict:
    """The report's cost MAE ratios, baseline over DWS (> 1: DWS prices better)."""
    mae = {k: v["mae"] for k, v in errors.items()}
    by_predictor = lambda base: {k: mae[base] / mae[k] for k in ("dws", "dws_continue", "dws_median")}
    return {
        "error_ratio_vs_length": mae["length"] / mae["dws"],
        "error_ratio_vs_steps": mae["steps"] / mae["dws"],
        "error_ratio_vs_prompt_len": mae["prompt_len"] / mae["dws"],
        # with every prediction perfect: the realised surface's error against each realised scalar's
        "error_ratio_ceiling": {"vs_length": mae["length_oracle"] / mae["oracle"],
                                "vs_steps": mae["steps_oracle"] / mae["oracle"]},
        # the same ratios for the continuation block head and for the median point prediction
        "error_ratio_vs_length_by_predictor": by_predictor("length"),
        "error_ratio_vs_steps_by_predictor": by_predictor("steps"),
    }


def latency_ratios(latency: dict, load: float = 0.9) -> dict[str, float]:
    """Mean latency of FCFS / SJF on length / SJF on steps over SJF on DWS at `load` (one server)."""
    mean_at = lambda policy: latency[policy][str(load)]["mean"]
    return {f"latency_ratio_{p}_over_sjf_dws": mean_at(p) / mean_at("sjf_dws")
            for p in ("fcfs", "sjf_length", "sjf_steps")}


def write_plots(base: str, s_pred: np.ndarray, s_true: np.ndarray, texts: Sequence[str], latency: dict,
                loads) -> dict:
    """<base>_surfaces.png (predicted vs executed surfaces of the 10/50/90 % costliest requests
    by executed steps) and <base>_latency.png (mean latency vs load per policy); their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx = np.argsort([m.sum() for m in s_true])
    pick = [int(idx[int(q * (len(idx) - 1))]) for q in (0.1, 0.5, 0.9)]
    fig, axes = plt.subplots(2, len(pick), figsize=(4 * len(pick), 6), squeeze=False)
    for col, i in enumerate(pick):
        for row, (arr, name) in enumerate(((s_pred[i], "predicted S"), (s_true[i], "executed cells"))):
            ax = axes[row, col]
            ax.imshow(arr, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            ax.set_title(f"{name}: {arr.sum():.1f} steps", fontsize=9)
            ax.set_xlabel("step s")
            ax.set_ylabel("block b")
        axes[0, col].text(0, -2.2, texts[i][:48], fontsize=7)
    fig.tight_layout()
    surf = base + "_surfaces.png"
    fig.savefig(surf, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, by_load in latency.items():
        ax.plot(loads, [by_load[str(x)]["mean"] for x in loads], marker="o", label=policy)
    ax.set_xlabel("load")
    ax.set_ylabel("mean end-to-end latency (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    lat = base + "_latency.png"
    fig.savefig(lat, dpi=110)
    plt.close(fig)
    return {"surfaces": surf, "latency_vs_load": lat}
