"""The code passes ruff with the repository's configuration (pyproject.toml: line length and rules)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_code_passes_ruff():
    pytest.importorskip("ruff")  # in the dev extras, so CI runs this
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "relf_jax", "kernels_pallas",
                        "kernels_cpu", "experiments", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
