"""Several processes on one machine as the hosts of one JAX job: `relf-jax launch-local`, the
environment `init_distributed` reads, and what happens when one host fails."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from relf_jax.errors import UserError
from relf_jax.runtime.local_cluster import process_env, run_local_cluster
from relf_jax.runtime.sharding import cluster_from_env
from tests._checkpoints import committed_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# each host contributes its own rows to one global array; a jitted sum over the global mesh
# needs the other host's shard, so it only comes out right through the runtime's collectives
GLOBAL_SUM = """
import json, jax, jax.numpy as jnp, numpy as np
from relf_jax.runtime.sharding import batch_sharding, init_distributed, make_mesh
assert init_distributed("auto")
mesh = make_mesh()
local = np.full((jax.local_device_count(), 3), jax.process_index() + 1, np.float32)
x = jax.make_array_from_process_local_data(batch_sharding(mesh), local)
total = float(jax.jit(jnp.sum, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))(x))
print(json.dumps({"process": jax.process_index(), "of": jax.process_count(), "devices": jax.device_count(),
                  "mesh": dict(mesh.shape), "shape": list(x.shape), "total": total}))
"""


def _env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_environment_names_the_cluster(monkeypatch):
    env = process_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --other"}, coordinator="127.0.0.1:5",
                      processes=3, process_id=2, devices_per_process=2)
    assert env["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:5" and env["JAX_NUM_PROCESSES"] == "3"
    assert env["JAX_PROCESS_ID"] == "2" and env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
    assert env["XLA_FLAGS"] == "--other --xla_force_host_platform_device_count=2"
    assert "JAX_PLATFORMS" not in process_env({}, coordinator="h:1", processes=2, process_id=0,
                                              devices_per_process=None)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cluster_from_env() == {"coordinator_address": "127.0.0.1:5", "num_processes": 3, "process_id": 2}
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    with pytest.raises(UserError, match=r"not in \[0, JAX_NUM_PROCESSES=3\)"):
        cluster_from_env()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(UserError, match="not an integer"):
        cluster_from_env()


def test_two_processes_reduce_over_one_global_mesh(capsys):
    status = run_local_cluster([], 2, 2, env=_env(), cwd=ROOT, command=[sys.executable, "-c", GLOBAL_SUM])
    out = capsys.readouterr().out
    assert status == 0, out
    rows = {}
    for line in out.splitlines():
        prefix, _, text = line.partition(" ")
        if text.startswith("{"):
            rows[prefix] = json.loads(text)
    assert set(rows) == {"[p0]", "[p1]"}
    for i in (0, 1):
        r = rows[f"[p{i}]"]
        assert r["process"] == i and r["of"] == 2 and r["devices"] == 4 and r["shape"] == [4, 3]
        assert r["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
        assert r["total"] == 3 * (2 * 1 + 2 * 2)  # both hosts' rows


@pytest.mark.parametrize("how,status", [("exit", 3), ("kill", 128 + signal.SIGKILL)])
def test_one_failing_process_stops_the_others(capsys, how, status):
    """Process 1 fails at once; process 0 would wait forever (as a host does in a collective
    whose peer is gone): launch-local returns process 1's status, having stopped process 0."""
    code = ("import os, signal, sys\n"
            "if os.environ['JAX_PROCESS_ID'] == '1':\n"
            f"    sys.exit(3) if {how!r} == 'exit' else os.kill(os.getpid(), signal.SIGKILL)\n"
            "print('waiting', flush=True)\n"
            "signal.pause()\n")
    assert run_local_cluster([], 2, env=_env(), command=[sys.executable, "-c", code]) == status
    out = capsys.readouterr().out
    assert f"process 1 exited with status {status}; stopping the others" in out


@pytest.mark.entry
def test_cli_launch_local_runs_info_on_two_hosts(capsys):
    from experiments.launch import main

    assert main(["launch-local", "--processes", "2", "--devices-per-process", "1", "--", "info"]) == 0
    out = capsys.readouterr().out
    assert '[p0]   "process": "0 of 2",' in out and '[p1]   "process": "1 of 2",' in out
    assert main(["launch-local", "--processes", "2"]) == 2
    assert "needs the command to run after --" in capsys.readouterr().err
    assert main(["launch-local", "--processes", "0", "--", "info"]) == 2
    assert "processes must be >= 1" in capsys.readouterr().err


TRAIN_ARGS = ["train", "--preset", "tiny", "data.source=chatterbot", "train.checkpoint_every=10",
              "train.eval_every=20", "train.progress=false", "train.keep_checkpoints=10", "train.log_every=1"]


def _train_cmd(workdir, steps):
    return [sys.executable, "-m", "experiments.launch", "launch-local", "--processes", "2", "--devices-per-process",
            "2", "--", *TRAIN_ARGS, "--workdir", workdir, f"train.steps={steps}"]


def _copy_data(src, dst):
    """`dst` with `src`'s prepared data and tokenizer, so two runs differ in nothing else."""
    import shutil

    os.makedirs(dst)
    shutil.copytree(os.path.join(src, "data"), os.path.join(dst, "data"))
    shutil.copy(os.path.join(src, "tokenizer.model"), dst)


def _losses(workdir) -> dict:
    from relf_jax.train.metrics import read_metrics

    rows = read_metrics(os.path.join(workdir, "ar", "metrics.jsonl"))
    return {r["step"]: (r.get("loss"), r.get("eval_loss")) for r in rows}


def _children_with(parent: int, env_item: bytes) -> list[int]:
    """Processes whose parent is `parent` and whose environment holds `env_item` (Linux /proc)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if ppid == parent and env_item in env:
            out.append(int(pid))
    return out


@pytest.mark.entry
def test_two_hosts_train_like_one_and_resume_bitwise_after_one_is_killed(tmp_path, capsys):
    """2 processes x 2 devices train through `launch-local` with the loss curve of 1 process x 4
    devices (the global batch does not depend on the process count); SIGKILL of process 1 after
    the step-20 checkpoint ends the job (the launcher stops process 0); the restarted job ends
    bitwise where an uninterrupted job ends. Then the trained model samples and evaluates the
    same on a mesh over 2 processes as on one device."""
    import jax
    import numpy as np

    from relf_jax.loading import load_model

    env, steps = _env(), 40
    full, single, killed = (str(tmp_path / n) for n in ("full", "single", "killed"))
    done = subprocess.run(_train_cmd(full, steps), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    finals = [line for line in done.stdout.splitlines() if f'"step": {steps}' in line]
    assert len(finals) == 2 and finals[0].split(" ", 1)[1] == finals[1].split(" ", 1)[1]  # both hosts agree

    # one process with the same four devices: the same loss at every step
    _copy_data(full, single)
    four = {**env, "XLA_FLAGS": env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
            "JAX_PLATFORMS": "cpu"}
    one = subprocess.run([sys.executable, "-m", "experiments.launch", *TRAIN_ARGS, "--workdir", single,
                          f"train.steps={steps}"], cwd=ROOT, env=four, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = _losses(full), _losses(single)
    assert sorted(a) == sorted(b) and len([s for s in a if a[s][0] is not None]) >= steps - 1
    for step in a:
        for x, y in zip(a[step], b[step]):
            assert (x is None) == (y is None) and (x is None or abs(x - y) <= 1e-5), (step, a[step], b[step])

    _copy_data(full, killed)
    job = subprocess.Popen(_train_cmd(killed, steps), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    victims = []
    while job.poll() is None and not victims:  # polls a real condition: the step-20 checkpoint committed
        if 20 in committed_steps(killed):
            victims = _children_with(job.pid, b"JAX_PROCESS_ID=1")
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)
    out = job.communicate(timeout=120)[0]
    assert victims and job.returncode == 128 + signal.SIGKILL, out[-3000:]
    assert "process 1 exited with status 137; stopping the others" in out
    assert steps not in committed_steps(killed)

    again = subprocess.run(_train_cmd(killed, steps), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and '"resumed_from": ' in again.stdout, again.stdout[-3000:]
    a, b = load_model(full), load_model(killed)
    assert a.step == b.step == steps
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    # sampling and evaluation on a 2 x 2 global mesh give the one-process results
    status = run_local_cluster([], 2, 2, env=env, cwd=ROOT, command=[sys.executable, "-c", SAMPLE_AND_EVAL, full])
    assert status == 0
    hosts = [json.loads(line.split(" ", 1)[1]) for line in capsys.readouterr().out.splitlines()
             if line.startswith(("[p0] {", "[p1] {"))]
    want = _sample_and_evaluate(load_model(full), full)
    assert len(hosts) == 2 and len(want["texts"]) == 2 and want["report"]["validation_loss"] > 0
    for got in hosts:
        assert got["mesh"] == {"data": 4, "fsdp": 1, "tensor": 1}
        assert got["texts"] == want["texts"]
        loss = got["report"].pop("validation_loss")  # one device vs four: the sums' order differs
        assert abs(loss - want["report"].pop("validation_loss", loss)) <= 1e-5
        assert got["report"] == {k: v for k, v in want["report"].items() if k != "validation_loss"}


def _sample_and_evaluate(lm, judge) -> dict:
    """Replies to two prompts and the `eval` report (speed left out) of `lm`, judged by `judge`."""
    from relf_jax import api
    from relf_jax.methods import SamplingParams

    texts = api.generate(lm, ["hello", "what is your name"], SamplingParams(max_new_tokens=12))
    report = api.evaluate(lm, judge, SamplingParams(max_new_tokens=24), num_samples=8)
    report.pop("tokens_per_s")
    return {"texts": texts, "report": report}


# the model placed on a mesh over both processes' devices, as `relf-jax sample` / `eval` place it
SAMPLE_AND_EVAL = """
import json, sys
from relf_jax.runtime.sharding import init_distributed, model_mesh
init_distributed()
from relf_jax.loading import load_model
from tests.test_multiprocess import _sample_and_evaluate
lm = load_model(sys.argv[1]).on_mesh(model_mesh())
print(json.dumps({"mesh": dict(lm.mesh.shape), **_sample_and_evaluate(lm, sys.argv[1])}), flush=True)
"""
