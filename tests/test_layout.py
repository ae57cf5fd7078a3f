"""The package's three layers and their import direction: parallel ← loss ← trainer ← recipe_support / recipes.

Each layer imports only the layers below it, and nothing below `trainer/` imports TRL. The top-level `__init__`
imports the trainer lazily (inside `__getattr__`), so the loss layer can be used without TRL.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_rlloss"
# Layers from the bottom up; a module of layer i may import hf_rlloss modules of layers < i only (and its own).
LAYERS = ["parallel", "loss", "trainer", "recipe_support"]
# The trainer completes TRL's model card for the Hub: the one thing of the support package on the training path.
ALLOWED_UPWARD = {"trainer": {"hf_rlloss.recipe_support.hub"}}


def _imported_modules(path: Path, module_level: bool = False) -> set[str]:
    """Absolute names of the modules a file of `hf_rlloss/` imports, relative imports resolved; with `module_level`,
    only the imports that run when the module is imported (not those inside functions)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body if module_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from ..x import y` in hf_rlloss/a/b.py → hf_rlloss.x
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from . import recipe_support`
    return names


def _within(name: str, modules: set[str]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def _layer_files(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).glob("*.py"))


def test_the_layers_are_subpackages_and_nothing_else_sits_at_the_top():
    assert {p.name for p in PACKAGE.glob("*.py")} == {"__init__.py"}
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)
    for layer in LAYERS:
        assert (PACKAGE / layer / "__init__.py").is_file()
    assert {"config.py", "context.py"} <= {p.name for p in _layer_files("loss")}  # the glob sees the package


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_imports_only_the_layers_below_it(layer):
    above = {f"hf_rlloss.{name}" for name in LAYERS[LAYERS.index(layer) + 1 :]}
    allowed = ALLOWED_UPWARD.get(layer, set())
    for path in _layer_files(layer):
        upward = {n for n in _imported_modules(path) if _within(n, above) and not _within(n, allowed)}
        assert not upward, f"{layer}/{path.name} imports {sorted(upward)} from a layer above it"


@pytest.mark.parametrize("layer", ["parallel", "loss"])
def test_no_trl_below_the_trainer(layer):
    for path in _layer_files(layer):
        trl = {n for n in _imported_modules(path) if _within(n, {"trl"})}
        assert not trl, f"{layer}/{path.name} imports {sorted(trl)}"


def test_the_package_root_imports_the_trainer_only_lazily():
    eager = _imported_modules(PACKAGE / "__init__.py", module_level=True)
    assert not {n for n in eager if _within(n, {"trl", "hf_rlloss.trainer", "hf_rlloss.recipe_support"})}


def test_the_import_scan_sees_relative_and_absolute_imports(tmp_path):
    module = PACKAGE / "loss" / "_probe_for_layout_test.py"  # must sit in the package to resolve `..`
    try:
        module.write_text("from ..recipe_support.hub import f\nfrom .. import trainer\nimport hf_rlloss.parallel\n")
        assert {"hf_rlloss.recipe_support.hub", "hf_rlloss.trainer", "hf_rlloss.parallel"} <= _imported_modules(module)
        module.write_text("import torch\nfrom .kl import k\n\ndef f():\n    from ..trainer import T\n")
        assert "hf_rlloss.trainer" in _imported_modules(module)
        assert _imported_modules(module, module_level=True) == {"torch", "hf_rlloss.loss.kl", "hf_rlloss.loss.kl.k"}
    finally:
        module.unlink(missing_ok=True)


def test_a_violation_is_caught(tmp_path, monkeypatch):
    """The direction test must fail on an arrow back: a loss module importing the trainer."""
    module = PACKAGE / "loss" / "_probe_violation.py"
    try:
        module.write_text("from ..trainer.grpo_trainer import RLLossGRPOTrainer\n")
        with pytest.raises(AssertionError, match="from a layer above"):
            test_each_layer_imports_only_the_layers_below_it("loss")
        module.write_text("import trl\n")
        with pytest.raises(AssertionError, match="imports"):
            test_no_trl_below_the_trainer("loss")
    finally:
        module.unlink(missing_ok=True)
