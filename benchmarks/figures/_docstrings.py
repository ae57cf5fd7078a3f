"""The docstrings the site publishes, as pages of the figures check.

The API reference publishes an object with a `::: dotted.path` line of a page under `docs/` (mkdocstrings, configured
in `mkdocs.yml`: public members only). Each path is resolved, through the package's re-exports, to the file and the
object that define it; the docstrings published with it (a module's own and its public members', a class's own and
its public methods') are read as prose: a number in one is checked like a number on a page, and a marked figure in
one is rendered like one.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIRECTIVE = re.compile(r"^:::\s*([\w.]+)", re.M)


def _module_file(dotted: str) -> Path | None:
    base = ROOT / dotted.replace(".", "/")
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _imported_from(path: Path, module: str, name: str) -> str | None:
    """The module `name` is imported from in `path` (`module` is the dotted name of `path`)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.parse(path.read_text(encoding="utf8")).body:
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            source = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            original = next(a.name for a in node.names if (a.asname or a.name) == name)
            return f"{source}.{original}"
    return None


@functools.cache
def defining(dotted: str) -> tuple[Path, str | None] | None:
    """The file that defines the object `dotted` names, and the object's name there (None for a module)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module, rest = ".".join(parts[:cut]), parts[cut:]
        path = _module_file(module)
        if path is None:
            continue
        if not rest:
            return path, None
        target = _imported_from(path, module, rest[0])
        if target and target != dotted:
            return defining(".".join([target, *rest[1:]]))
        return path, rest[0]
    return None


def published() -> dict[Path, set[str] | None]:
    """The files whose docstrings the API reference publishes, each with the names it publishes from it (None: the
    whole module)."""
    found: dict[Path, set[str] | None] = {}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for dotted in DIRECTIVE.findall(page.read_text(encoding="utf8")):
            where = defining(dotted)
            if where is None:
                continue
            path, name = where
            if name is None or found.get(path, set()) is None:
                found[path] = None
            else:
                found.setdefault(path, set()).add(name)
    return dict(sorted(found.items()))


def published_files() -> list[Path]:
    return list(published())


def _public(name: str) -> bool:
    return not name.startswith("_") or name == "__init__"  # mkdocstrings merges __init__ into its class


def docstrings(text: str, names: set[str] | None = None) -> list[tuple[str, str]]:
    """`(qualified name, docstring)` published from a module's source: the module's own and every public member's
    (`names` None), or those of the top-level objects `names` and their public members."""
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and _public(child.name):
                if not prefix and names is not None and child.name not in names:
                    continue
                name = f"{prefix}{child.name}"
                doc = ast.get_docstring(child, clean=False)
                if doc:
                    out.append((name, doc))
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{name}.")

    tree = ast.parse(text)
    module_doc = ast.get_docstring(tree, clean=False)
    if module_doc and names is None:
        out.append(("module", module_doc))
    visit(tree, "")
    return out
