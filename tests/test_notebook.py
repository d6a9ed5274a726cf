"""examples/quickstart.ipynb runs top to bottom (quick sizes) in a fresh Jupyter kernel."""

import os

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.entry
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    monkeypatch.setenv("RELF_JAX_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("RELF_JAX_NOTEBOOK_WORKDIR", str(tmp_path / "run"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(os.path.join(ROOT, "examples", "quickstart.ipynb"), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "tokens per target forward" in outputs
    assert "AR" in outputs and "ReLF-16" in outputs
    assert "params.safetensors" in outputs and "model.safetensors" in outputs
    if _has_transformers():
        diff = [line for line in outputs.splitlines() if line.startswith("max |logit difference|")]
        assert diff and float(diff[0].rsplit(" ", 1)[1]) < 1e-4
    assert os.path.exists(tmp_path / "run" / "export" / "relf.safetensors")


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True
