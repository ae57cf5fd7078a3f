"""The TRL releases the trainer layer accepts (`hf_rlloss.trainer.check_trl_version`): those of the package's own
requirement on `trl` (pyproject.toml, read back from the installed metadata), refused otherwise at import of
`hf_rlloss.trainer` (not of the loss layer), unless `HF_RLLOSS_ALLOW_UNTESTED_TRL=1`."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from hf_rlloss.trainer import ALLOW_UNTESTED_TRL, check_trl_version
from hf_rlloss.trainer import tested_trl_range as trl_range  # a test_* name would be collected

ROOT = Path(__file__).resolve().parents[1]
PINNED = SpecifierSet("==1.16.0")


def _pyproject_dependencies() -> list[str]:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf8"))["project"]["dependencies"]


def test_the_tested_range_is_pyprojects_requirement_and_holds_the_installed_trl():
    tested = trl_range(_pyproject_dependencies())
    assert tested == PINNED  # an exact pin: the release the suite runs
    assert tested.contains(importlib.metadata.version("trl"))
    # the installed package's metadata (pyproject.toml as installed) accepts the TRL the suite runs
    installed = trl_range()
    assert installed is None or installed.contains(importlib.metadata.version("trl"))


def test_the_range_is_read_from_the_unconditional_trl_requirement_only():
    requirements = ["torch>=2.6,<3", 'trl>=2; extra == "next"', "trl==1.16.0", "trl-extras>=1"]
    assert trl_range(requirements) == PINNED
    assert trl_range(["torch>=2.6"]) is None


def test_another_trl_is_refused_naming_it_the_range_and_the_escape_hatch(monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_TRL, raising=False)
    with pytest.raises(ImportError) as error:
        check_trl_version("1.17.0", PINNED)
    message = str(error.value)
    assert "trl 1.17.0 is installed" in message and "tested with trl==1.16.0" in message
    assert "HF_RLLOSS_ALLOW_UNTESTED_TRL=1" in message and "pip install 'trl==1.16.0'" in message
    # the installed version read from the metadata when not given
    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"trl": "1.15.2"}[name])
    with pytest.raises(ImportError, match=r"trl 1\.15\.2 is installed"):
        check_trl_version(tested=PINNED)


def test_the_escape_hatch_turns_the_error_into_a_warning(monkeypatch):
    monkeypatch.setenv(ALLOW_UNTESTED_TRL, "1")
    with pytest.warns(UserWarning, match=r"tested with trl==1\.16\.0, but trl 1\.17\.0 is installed"):
        check_trl_version("1.17.0", PINNED)


def test_a_tested_release_and_a_source_tree_without_metadata_pass_silently(monkeypatch, recwarn):
    monkeypatch.delenv(ALLOW_UNTESTED_TRL, raising=False)
    check_trl_version("1.16.0", PINNED)

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", not_installed)
    assert trl_range() is None
    check_trl_version("0.1.0")  # nothing to check against
    assert not [w for w in recwarn if ALLOW_UNTESTED_TRL in str(w.message)]


def test_importing_the_trainer_layer_refuses_another_trl_and_the_loss_layer_does_not():
    """In a fresh interpreter whose metadata says trl 0.9.0: `hf_rlloss.loss` imports; `hf_rlloss.trainer` raises
    before TRL is imported."""
    code = (
        "import importlib.metadata as m, sys\n"
        "version = m.version\n"
        "m.version = lambda name: '0.9.0' if name == 'trl' else version(name)\n"
        "m.requires = lambda name: ['trl==1.16.0']\n"
        "import hf_rlloss.loss\n"
        "try:\n"
        "    import hf_rlloss.trainer\n"
        "except ImportError as error:\n"
        "    print('refused:', error)\n"
        "print('trl imported:', 'trl' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != ALLOW_UNTESTED_TRL}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "refused: hf_rlloss's trainers are tested with trl==1.16.0, but trl 0.9.0 is installed" in out.stdout
    assert "trl imported: False" in out.stdout
