"""The package layout the README's table describes: the loss layer never imports the recipe-support modules."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_rlloss"
SUPPORT = "hf_rlloss.recipe_support"
# The trainer completes TRL's model card for the Hub; nothing else of the support package reaches the training path.
ALLOWED = {"trainer": {f"{SUPPORT}.hub"}}


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules a file of `hf_rlloss/` (top level) imports, relative imports resolved."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
