"""A run killed with SIGKILL between checkpoints and resumed ends bitwise where an
uninterrupted run ends (real subprocess, real data pipeline and async checkpoints)."""

import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests._checkpoints import committed_steps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 40  # the 2-host test in test_multiprocess.py kills and resumes a 2-process run too


def _cmd(workdir):
    return [sys.executable, "-m", "experiments.launch", "train", "--preset", "tiny", "--workdir", workdir,
            "data.source=chatterbot", f"train.steps={STEPS}", "train.checkpoint_every=10", "train.eval_every=20",
            "train.progress=false", "train.keep_checkpoints=10"]


@pytest.mark.entry
def test_sigkill_then_resume_is_bitwise_identical(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    subprocess.run(_cmd(full), cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    # same tokenizer for both runs, so only the interruption differs
    os.makedirs(killed)
    shutil.copy(os.path.join(full, "tokenizer.model"), os.path.join(killed, "tokenizer.model"))

    proc = subprocess.Popen(_cmd(killed), cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300  # polls a real condition: a committed checkpoint
    while time.monotonic() < deadline and proc.poll() is None:
        if any(s >= 20 for s in committed_steps(killed)):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.01)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert STEPS not in committed_steps(killed)

    subprocess.run(_cmd(killed), cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)

    from relf_jax.loading import load_model
    a, b = load_model(full), load_model(killed)
    assert a.step == b.step == STEPS
    la, lb = jax.tree.leaves(a.params), jax.tree.leaves(b.params)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
