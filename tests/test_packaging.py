"""The package as an index shows it: one version, the license its metadata states, project URLs, runtime imports
declared, console scripts that answer `--help`, and an sdist that ships the package without a partial test suite.

The lower bounds of the dependency ranges are proven by `scripts/check_min_versions.sh` (a fresh environment at the
minimum versions, the built wheel, two training steps from outside the repository): minutes, so not in this suite.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the package supports 3.10, its metadata checks need 3.11

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf8"))
PROJECT = PYPROJECT["project"]
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml", "huggingface_hub": "huggingface-hub"}


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def test_one_version_everywhere():
    import hf_rlloss

    assert PROJECT["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "hf_rlloss.__version__"}
    latest = re.search(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(encoding="utf8"), flags=re.M)
    assert latest and latest.group(1) == hf_rlloss.__version__ == "0.2.0"


def test_the_license_file_is_the_license_the_metadata_states():
    assert PROJECT["license"] == "Apache-2.0" and PROJECT["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf8")
    assert text.split()[:5] == ["Apache", "License", "Version", "2.0,", "January"]
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_project_urls_and_the_site_point_to_one_repository():
    urls = PROJECT["urls"]
    assert {"Homepage", "Documentation", "Repository", "Issues", "Changelog"} <= urls.keys()
    mkdocs = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf8").replace("!!python", "#"))
    assert mkdocs["repo_url"] == urls["Repository"] and mkdocs["site_url"] == urls["Documentation"]


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names of the packages a module imports when it is imported (not inside functions or `try`)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf8")).body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_every_module_level_import_is_a_declared_dependency():
    imported = set()
    for path in (ROOT / "hf_rlloss").rglob("*.py"):
        imported |= _module_level_imports(path)
    third_party = {name for name in imported if name not in sys.stdlib_module_names and name != "hf_rlloss"}
    assert {"torch", "trl", "yaml", "pydantic"} <= third_party  # the scan sees the package
    declared = _requirement_names(PROJECT["dependencies"])
    missing = sorted(n for n in third_party if DISTRIBUTIONS.get(n, n).replace("_", "-") not in declared)
    assert not missing, f"imported by hf_rlloss but not in [project] dependencies: {missing}"


@pytest.mark.parametrize("script", sorted(PROJECT["scripts"]))
def test_every_console_script_answers_help_without_doing_its_work(script, capsys, monkeypatch):
    module, function = PROJECT["scripts"][script].split(":")
    module = importlib.import_module(module)
    for name in dir(module):  # any work it would start fails the test
        if name.startswith("prepare_") or name == "make_tiny_model":
            monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail(f"{script} --help started working"))
    with pytest.raises(SystemExit) as exit_info:
        getattr(module, function)(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {script}") and "--help" in out


@pytest.mark.slow
def test_the_sdist_ships_the_package_and_no_partial_test_suite(tmp_path):
    """An sdist with some tests but not their helpers and data cannot run them: it ships none (the repository has
    them); it ships every module, the license, the README and the changelog."""
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    with tarfile.open(tmp_path / out.stdout.strip().splitlines()[-1]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "hf_rlloss").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    assert {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml"} <= names
    assert not [n for n in names if n.startswith("tests/")], sorted(n for n in names if n.startswith("tests/"))
