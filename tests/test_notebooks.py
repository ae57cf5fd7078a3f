"""The notebooks in `notebooks/` run top to bottom (nbclient, a real Jupyter kernel, offline, CPU) and pass the
asserts of their last cell; in git they are stored without outputs."""

import os
from pathlib import Path

import nbformat
import pytest
from _full_matrix import SLOW_LAUNCH

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_notebooks_exist_and_are_stored_without_outputs():
    assert [p.name for p in NOTEBOOKS] == ["01_subclassing_the_trainer.ipynb", "02_the_loss_layer.ipynb"]
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert code and all(not cell.outputs and cell.execution_count is None for cell in code), path.name
        assert "assert" in code[-1].source, f"{path.name}: the last cell asserts what the notebook shows"


@pytest.mark.slow
@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=SLOW_LAUNCH) if p.stem.startswith("01_") else p for p in NOTEBOOKS],
    ids=lambda p: p.stem,
)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    # The kernel inherits this environment: this checkout's hf_rlloss, offline, temporary files under tmp_path.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("HF_RLLOSS_CACHE", str(tmp_path / "cache"))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    assert any("image/png" in out.get("data", {}) for out in outputs), "the plots render inline"
    last = "".join(out.get("text", "") for out in nb.cells[-1].outputs)
    assert "all checks passed" in last
