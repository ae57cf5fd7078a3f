"""Execute the notebooks and store the executed copies, outputs included, in `docs/notebooks/` for the site.

`notebooks/` keeps them without outputs (what the tests run); the site renders these copies without executing them,
so its build stays fast. `tests/test_docs.py` checks that each copy's code is the notebook's and that it ran to its
final asserts: rerun this after editing a notebook.

    python notebooks/execute_for_docs.py
"""

import os
import re
import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "notebooks"
TARGET = ROOT / "docs" / "notebooks"


def execute(path: Path, workdir: Path) -> nbformat.NotebookNode:
    """Runs `path` top to bottom in a fresh kernel, offline, with this checkout's `hf_rlloss` (as the tests do)."""
    env = {
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "TMPDIR": str(workdir),
        "HF_RLLOSS_CACHE": str(workdir / "cache"),
    }
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)  # the kernel inherits this process's environment
    try:
        nb = nbformat.read(path, as_version=4)
        resources = {"metadata": {"path": str(workdir)}}
        NotebookClient(nb, timeout=600, kernel_name="python3", resources=resources).execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return nb


# Progress bars (tqdm, transformers' shard writing and weight loading) and tqdm's notice that ipywidgets is absent are
# noise on a static page; every other stderr output (warnings) is kept.
_PROGRESS = re.compile(r"^\s*$|it/s\]|s/it\]|TqdmWarning|from \.autonotebook import tqdm")


def drop_progress_bars(nb: nbformat.NotebookNode) -> None:
    """Removes from `nb` the stderr outputs whose every line is a progress bar (in place)."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [
                out
                for out in cell.outputs
                if not (
                    out.output_type == "stream"
                    and out.name == "stderr"
                    and all(_PROGRESS.search(line) for line in out.text.replace("\r", "\n").splitlines())
                )
            ]


def main() -> int:
    TARGET.mkdir(parents=True, exist_ok=True)
    for path in sorted(SOURCE.glob("*.ipynb")):
        with tempfile.TemporaryDirectory() as tmp:
            nb = execute(path, Path(tmp))
        drop_progress_bars(nb)
        nbformat.write(nb, TARGET / path.name)
        print(f"{path.relative_to(ROOT)} -> {(TARGET / path.name).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
