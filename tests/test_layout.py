"""The package layout the README's table describes: the loss layer imports neither the trainer, TRL nor the
recipe-support modules; the trainer imports of those only the Hub card."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_rlloss"
SUPPORT = "hf_rlloss.recipe_support"
# The trainer completes TRL's model card for the Hub; nothing else of the support package reaches the training path.
ALLOWED = {"trainer": {f"{SUPPORT}.hub"}}
# The loss layer (README "Project layout"): usable on tensors without TRL and without the trainer's modules.
LOSS_LAYER = [
    "__init__",
    "aggregation",
    "chunked_logprobs",
    "config",
    "context",
    "distributed",
    "fields",
    "kl",
    "metrics",
    "policy_losses",
    "rollout_is",
    "sequence_parallel",
]
TRAINER_SIDE = {"trl", "hf_rlloss.trainer", "hf_rlloss.trainer_config"}


def _imported_modules(path: Path, module_level: bool = False) -> set[str]:
    """Absolute names of the modules a file of `hf_rlloss/` (top level) imports, relative imports resolved; with
    `module_level`, only the imports that run when the module is imported (not those inside functions)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body if module_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from .x import y` in hf_rlloss/z.py
                base = "hf_rlloss" + (f".{base}" if base else "")
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from . import recipe_support`
    return names


def _within(name: str, modules: set[str]) -> bool:
    return any(name == m or name.startswith(m + ".") for m in modules)


def test_loss_layer_never_imports_recipe_support():
    modules = sorted(PACKAGE.glob("*.py"))
    assert {"config", "context", "trainer"} <= {p.stem for p in modules}  # the glob sees the package
    for path in modules:
        allowed = ALLOWED.get(path.stem, set())
        support = {n for n in _imported_modules(path) if _within(n, {SUPPORT})}
        assert all(_within(n, allowed) for n in support), f"{path.name} imports {sorted(support)}"


def test_the_import_scan_sees_relative_and_absolute_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from .recipe_support.hub import f\nfrom . import recipe_support\nimport hf_rlloss.kl\n")
    assert {f"{SUPPORT}.hub", SUPPORT, "hf_rlloss.kl"} <= _imported_modules(source)
    source.write_text("import torch\n\ndef f():\n    from .trainer import T\n")
    assert "hf_rlloss.trainer" in _imported_modules(source)
    assert _imported_modules(source, module_level=True) == {"torch"}


def test_loss_layer_imports_neither_trl_nor_the_trainer():
    for stem in LOSS_LAYER:
        # the package's `__init__` imports the trainer lazily, inside `__getattr__`: not when the loss layer is used
        imported = _imported_modules(PACKAGE / f"{stem}.py", module_level=stem == "__init__")
        trainer_side = {n for n in imported if _within(n, TRAINER_SIDE)}
        assert not trainer_side, f"{stem}.py imports {sorted(trainer_side)}"
