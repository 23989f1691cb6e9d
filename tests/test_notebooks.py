"""The Colab notebooks run top to bottom against tiny trained workdirs (nbclient, the venv's python3 kernel)."""

from __future__ import annotations

import pytest

from tests.smoke_workdirs import smoke_workdir
from tests.train_runs import ROOT

NOTEBOOKS = ROOT / "notebooks"


def _execute(name: str, monkeypatch, **env: str):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    for key, value in {"JAX_PLATFORMS": "cpu", "JUPYTER_PLATFORM_DIRS": "1", **env}.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    images = sum("image/png" in o.get("data", {}) for o in outputs)
    return notebook, text, images


def test_notebooks_are_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        notebook = nbformat.read(path, as_version=4)
        nbformat.validate(notebook)
        assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), path
        first = notebook.cells[1].source
        assert 'find_spec("valen_jax") is None' in first and "%pip install -q -e" in first, path


@pytest.mark.slow
def test_valen_notebook_recomputes_the_report_and_plots(tmp_path_factory, monkeypatch):
    workdir = smoke_workdir(tmp_path_factory, "configs/valen.py:tiny")
    _, text, images = _execute("eval_valen.ipynb", monkeypatch, VALEN_WORKDIR=str(workdir),
                               VALEN_DATA=str(ROOT / "data/smoke/valen/train.jsonl"))
    assert "15 questions (13 labeled, question mode)" in text
    assert "recomputed" in text and "ece: report" in text
    assert images == 3  # reliability diagram, noul confusion matrix, per-domain bars


@pytest.mark.slow
def test_vflash_notebook_draws_the_answers(tmp_path_factory, monkeypatch):
    workdir = smoke_workdir(tmp_path_factory, "configs/vflash.py:tiny")
    _, text, images = _execute("eval_vflash.ipynb", monkeypatch, VFLASH_WORKDIR=str(workdir),
                               VFLASH_DATA=str(ROOT / "data/smoke/vflash/eval.jsonl"),
                               VFLASH_MAX_NEW_TOKENS="8")
    assert "16 of 16 examples" in text and "primitive parse rate" in text
    assert images == 3  # per-entry bars, answers on the images, metric-frame trajectories
