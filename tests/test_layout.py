"""The package's three layers and their import direction: parallel ← loss ← trainer ← recipe_support / recipes.

Each layer imports only the layers below it, and nothing below `trainer/` imports TRL. The top-level `__init__`
imports the trainer lazily (inside `__getattr__`), so the loss layer can be used without TRL. Inside `trainer/`, the
two config/trainer pairs sit at the top, their parts in `sync/` and `async_/`, and what both use in `common/`, which
imports neither. No module imports itself back through others, and `docs/layout.md` names every module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_rlloss"
LAYOUT_PAGE = PACKAGE.parent / "docs" / "layout.md"
# Layers from the bottom up; a module of layer i may import hf_rlloss modules of layers < i only (and its own).
LAYERS = ["parallel", "loss", "trainer", "recipe_support"]


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
    return sorted((PACKAGE / layer).rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_layers_are_subpackages_and_nothing_else_sits_at_the_top():
    assert {p.name for p in PACKAGE.glob("*.py")} == {"__init__.py"}
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)
    for layer in LAYERS:
        assert (PACKAGE / layer / "__init__.py").is_file()
    assert {"config.py", "context.py"} <= {p.name for p in _layer_files("loss")}  # the glob sees the package
    assert PACKAGE / "trainer" / "common" / "forwards.py" in _layer_files("trainer")  # and the subpackages


# The trainer layer: the two TRL-style config/trainer pairs at its top, their parts below them.
TRAINER_ENTRY_POINTS = {
    "__init__.py",
    "grpo_config.py",
    "grpo_trainer.py",
    "async_grpo_config.py",
    "async_grpo_trainer.py",
}
TRAINER_PARTS = {"common": set(), "sync": {"common"}, "async_": {"common"}}  # each part: the parts it may import


def test_the_trainer_is_two_config_trainer_pairs_and_their_parts():
    trainer = PACKAGE / "trainer"
    assert {p.name for p in trainer.glob("*.py")} == TRAINER_ENTRY_POINTS
    assert {p.name for p in trainer.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(TRAINER_PARTS)
    for part in TRAINER_PARTS:
        assert (trainer / part / "__init__.py").is_file()


@pytest.mark.parametrize("part", sorted(TRAINER_PARTS))
def test_a_trainer_part_imports_no_trainer_and_no_other_part(part):
    """`common/` is what both trainers share, so it imports neither's parts; no part imports a trainer module."""
    entry_points = {f"hf_rlloss.trainer.{p.removesuffix('.py')}" for p in TRAINER_ENTRY_POINTS - {"__init__.py"}}
    others = {f"hf_rlloss.trainer.{p}" for p in set(TRAINER_PARTS) - TRAINER_PARTS[part] - {part}}
    for path in sorted((PACKAGE / "trainer" / part).rglob("*.py")):
        names = _imported_modules(path)
        wrong = {n for n in names if _within(n, others | entry_points) or n in ("hf_rlloss.trainer", "hf_rlloss")}
        assert not wrong, f"trainer/{part}/{path.relative_to(PACKAGE / 'trainer' / part)} imports {sorted(wrong)}"


ROLLOUT = PACKAGE / "trainer" / "async_" / "rollout"


def test_the_trainer_side_of_async_imports_nothing_of_the_rollout_process():
    """`async_/`'s own modules are the trainer's process (its mixins and what they read); `async_/rollout/` is what
    runs in the rollout process and imports the lag rules from `async_/staleness.py`, never the other way."""
    assert (ROLLOUT / "__init__.py").is_file() and (ROLLOUT / "tool_calling" / "__init__.py").is_file()
    rollout = {"hf_rlloss.trainer.async_.rollout"}
    for path in sorted((PACKAGE / "trainer" / "async_").glob("*.py")):
        wrong = {n for n in _imported_modules(path) if _within(n, rollout)}
        assert not wrong, f"trainer/async_/{path.name} imports {sorted(wrong)} from the rollout process"
    for path in (PACKAGE / "trainer" / "async_grpo_trainer.py", PACKAGE / "trainer" / "async_grpo_config.py"):
        assert not {n for n in _imported_modules(path) if _within(n, rollout)}, path.name


def test_the_rollout_modules_old_paths_warn_once_and_give_the_same_objects():
    """Each path of the previous release imports with one `DeprecationWarning` naming the new path, once per
    process, and each of its names is the object at its new path."""
    import importlib
    import sys
    import warnings

    from hf_rlloss.trainer.async_.deprecated_paths import MOVED

    assert len(MOVED) == 12
    for old, new in MOVED.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            __import__(old)  # as an `import` statement does
            module = importlib.import_module(old)  # imported already: no second warning
        deprecations = [w for w in caught if issubclass(w.category, DeprecationWarning)]
        assert len(deprecations) == 1, (old, [str(w.message) for w in caught])
        assert old in str(deprecations[0].message) and f"`{new[0]}`" in str(deprecations[0].message)
        assert deprecations[0].filename == __file__  # the warning points at the importing line
        first = importlib.import_module(new[0])
        for name in getattr(first, "__all__", ()):
            assert getattr(module, name) is getattr(first, name), (old, name)
        with pytest.raises(AttributeError, match=old):
            module.no_such_name  # noqa: B018
    from hf_rlloss.trainer.async_ import rollout, staleness
    from hf_rlloss.trainer.common import advantages

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from hf_rlloss.trainer.async_.cpu_rollout import (  # the facade's 11 names
            VLLM_ONLY_OPTIONS,
            HFGenerateLoop,
            HFGenerateRolloutWorker,
            NoRolloutSamplesError,
            QueueWeightTransfer,
            RolloutWorkerDiedError,
            batch_seed,
            check_weight_lag,
            group_advantages,
            least_trained_lag,
            version_for_batch,
        )
        from hf_rlloss.trainer.async_.scoring import RolloutErrorPolicy

    assert (HFGenerateLoop, HFGenerateRolloutWorker, QueueWeightTransfer) == (
        rollout.HFGenerateLoop,
        rollout.HFGenerateRolloutWorker,
        rollout.QueueWeightTransfer,
    )
    assert (NoRolloutSamplesError, RolloutWorkerDiedError, VLLM_ONLY_OPTIONS, batch_seed) == (
        rollout.NoRolloutSamplesError,
        rollout.RolloutWorkerDiedError,
        rollout.VLLM_ONLY_OPTIONS,
        rollout.batch_seed,
    )
    assert (check_weight_lag, least_trained_lag, version_for_batch) == (
        staleness.check_weight_lag,
        staleness.least_trained_lag,
        staleness.version_for_batch,
    )
    assert group_advantages is advantages.group_advantages and RolloutErrorPolicy is rollout.RolloutErrorPolicy
    from hf_rlloss.trainer.async_ import resume

    with pytest.warns(DeprecationWarning, match="hf_rlloss.trainer.async_.staleness"):
        assert resume.check_fixed_lag_setup is staleness.check_fixed_lag_setup


def _import_graph() -> dict[str, set[str]]:
    """Module → the package's modules it imports (anywhere in the file, type-checking imports too), packages'
    `__init__` left out: a package importing its own modules is not a cycle."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"}
    graph = {}
    for name, path in files.items():
        targets = set()
        for imported in _imported_modules(path):
            while imported and imported not in files:  # `pkg.module.Name` → `pkg.module`
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_cycle():
    graph = _import_graph()
    assert "hf_rlloss.trainer.common.packing" in graph and graph["hf_rlloss.trainer.grpo_trainer"]  # the scan works
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_search_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def _modules_missing_from_layout(text: str) -> list[str]:
    files = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    return [str(p.relative_to(PACKAGE.parent)) for p in files if f"`{p.relative_to(PACKAGE.parent)}`" not in text]


def test_the_layout_page_names_every_module_and_only_existing_ones():
    text = LAYOUT_PAGE.read_text()
    assert not _modules_missing_from_layout(text), f"docs/layout.md lacks {_modules_missing_from_layout(text)}"
    named = set(re.findall(r"`(hf_rlloss/[\w/]+(?:\.py|/))`", text))
    assert len(named) > 30  # the pattern reads the page's paths
    stale = sorted(n for n in named if not (PACKAGE.parent / n).exists())
    assert not stale, f"docs/layout.md names modules that do not exist: {stale}"


def test_a_module_missing_from_the_layout_page_is_caught():
    text = LAYOUT_PAGE.read_text().replace("`hf_rlloss/loss/kl.py`", "`kl.py`")
    assert _modules_missing_from_layout(text) == ["hf_rlloss/loss/kl.py"]


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_imports_only_the_layers_below_it(layer):
    above = {f"hf_rlloss.{name}" for name in LAYERS[LAYERS.index(layer) + 1 :]}
    for path in _layer_files(layer):
        upward = {n for n in _imported_modules(path) if _within(n, above)}
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
        module.write_text("from ..recipe_support.tools import f\nfrom .. import trainer\nimport hf_rlloss.parallel\n")
        expected = {"hf_rlloss.recipe_support.tools", "hf_rlloss.trainer", "hf_rlloss.parallel"}
        assert expected <= _imported_modules(module)
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


def test_the_loss_layers_names_stay_importable_where_they_were():
    """The loss layer's stages are files (`config`, `kwargs`, `context`, `grpo_context`); `loss.context` still gives
    every name it gave, and the package the same objects."""
    from hf_rlloss import loss
    from hf_rlloss.loss import context, grpo_context, kwargs

    assert context.GRPOLossContext is grpo_context.GRPOLossContext is loss.GRPOLossContext
    assert context.train_policy_metrics is grpo_context.train_policy_metrics is loss.train_policy_metrics
    assert context.BaseRLLossKwargs is kwargs.BaseRLLossKwargs is loss.BaseRLLossKwargs
    assert context.prepare_kwargs is kwargs.prepare_kwargs and context.BaseRLLossContext is loss.BaseRLLossContext
    with pytest.raises(AttributeError, match="no_such_name"):
        context.no_such_name  # noqa: B018


# ------------------------------------------------------------------------------------------------------------------
# Sizes and seams: no function over 80 lines, no class over 450, no private name imported from another module

FUNCTION_LINES = 80  # from the `def` line to the last, its docstring included
CLASS_LINES = 450
# Over the limit, each with the reason it stays; the test fails once one fits, so that its entry is removed
TOO_LONG_FOR_NOW: dict[str, str] = {}  # `path::name` of a function allowed over the limit, with why (none)


def _too_long(root: Path) -> dict[str, int]:
    """`path::name` (relative to `root`'s parent) of each function of `root`'s modules over `FUNCTION_LINES` lines
    and each class over `CLASS_LINES`, with its lines."""
    limits = {ast.FunctionDef: FUNCTION_LINES, ast.AsyncFunctionDef: FUNCTION_LINES, ast.ClassDef: CLASS_LINES}
    found = {}
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if type(node) in limits and node.end_lineno - node.lineno + 1 > limits[type(node)]:
                found[f"{path.relative_to(root.parent).as_posix()}::{node.name}"] = node.end_lineno - node.lineno + 1
    return found


def _private_imports(root: Path, packages: set[str] | None = None) -> list[str]:
    """`path:line name` of each private name (`_x`, not `__x__`) a module of `root` imports from another module: a
    relative import, or one from `packages` (default: `root`'s own package). A private submodule (`from . import
    _age`, a file `_age.py`) is a module, not a name, and is not counted."""
    packages = {root.name} if packages is None else packages
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in packages):
                base = path.parents[node.level - 1] if node.level else root.parent
                folder = base.joinpath(*(node.module or "").split(".")) if node.module else base
                private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
                private = [name for name in private if not (folder / f"{name}.py").is_file()]
                found += [f"{path.relative_to(root.parent).as_posix()}:{node.lineno} {name}" for name in private]
    return found


def test_no_function_over_80_lines_and_no_class_over_450():
    found = _too_long(PACKAGE)
    new = {name: lines for name, lines in found.items() if name not in TOO_LONG_FOR_NOW}
    assert not new, f"split these (functions <= {FUNCTION_LINES} lines, classes <= {CLASS_LINES}): {new}"
    fitting = sorted(set(TOO_LONG_FOR_NOW) - set(found))
    assert not fitting, f"these fit now: remove them from TOO_LONG_FOR_NOW: {fitting}"


def test_no_module_imports_a_private_name_of_another():
    assert not _private_imports(PACKAGE), "make the name public where it is defined, or move it"


# The same limits wherever the repository's Python lives: the benchmarks, the recipes and the scripts; and the tests
# reach the package and the benchmarks through public names only.
SCRIPT_ROOTS = ("benchmarks", "recipes", "scripts")


def check_sizes(root: Path) -> None:
    """Fail naming each function of `root` over `FUNCTION_LINES` lines (each class over `CLASS_LINES`)."""
    found = _too_long(root)
    assert not found, f"split these (functions <= {FUNCTION_LINES} lines, classes <= {CLASS_LINES}): {found}"


def check_seams(root: Path) -> None:
    """Fail naming each private name a module of `root` imports from another module: of its own folder (a sibling
    imported by its plain name, as the recipes do), of `benchmarks/` or of the package."""
    siblings = {p.stem for p in root.rglob("*.py")}
    found = _private_imports(root, {root.name, "benchmarks", "hf_rlloss"} | siblings)
    assert not found, f"make the name public where it is defined, or test through the public one: {found}"


@pytest.mark.parametrize("root", SCRIPT_ROOTS)
def test_no_function_over_80_lines_in_the_benchmarks_recipes_and_scripts(root):
    check_sizes(PACKAGE.parent / root)


@pytest.mark.parametrize("root", SCRIPT_ROOTS)
def test_no_private_name_imported_across_modules_in_the_benchmarks_recipes_and_scripts(root):
    check_seams(PACKAGE.parent / root)


def test_the_tests_import_no_private_name_of_the_package_or_the_benchmarks():
    tests = PACKAGE.parent / "tests"
    found = _private_imports(tests, {"benchmarks", "hf_rlloss"})
    assert not found, f"give the test a public name, or test through the public API: {found}"


def test_a_long_function_in_benchmarks_and_a_private_import_in_recipes_are_caught(tmp_path):
    benchmarks, recipes = tmp_path / "benchmarks", tmp_path / "recipes"
    (benchmarks / "performance").mkdir(parents=True)
    recipes.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES))  # with the `def` line: one over
    (benchmarks / "performance" / "probe.py").write_text(f"def fits():\n    return 0\n\n\ndef run():\n{body}")
    (recipes / "grpo.py").write_text("def _helper():\n    return 0\n")
    (recipes / "probe.py").write_text("from grpo import _helper\nfrom hf_rlloss.trainer.grpo_trainer import _hidden\n")
    with pytest.raises(AssertionError, match=r"benchmarks/performance/probe\.py::run': 81"):
        check_sizes(benchmarks)
    with pytest.raises(AssertionError, match=r"recipes/probe\.py:1 _helper', 'recipes/probe\.py:2 _hidden'"):
        check_seams(recipes)
    check_sizes(recipes)  # the checks read what they are given: nothing else is flagged
    check_seams(benchmarks)


def test_a_long_function_a_long_class_and_a_private_import_are_caught(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES - 1))  # with the `def` line: the limit
    (package / "fits.py").write_text(f"def f():\n{body}\n\nclass C:\n" + "    y = 0\n" * (CLASS_LINES - 1))
    (package / "long.py").write_text(f"def g():\n{body}    z = 0\n\n\nclass D:\n" + "    y = 0\n" * CLASS_LINES)
    (package / "seam.py").write_text("from .long import _hidden, g\nfrom pkg.fits import _other\n")
    assert _too_long(package) == {"pkg/long.py::g": FUNCTION_LINES + 1, "pkg/long.py::D": CLASS_LINES + 1}
    assert _private_imports(package) == ["pkg/seam.py:1 _hidden", "pkg/seam.py:2 _other"]


# ------------------------------------------------------------------------------------------------------------------
# benchmarks/ and tests/: a package by kind, imported one way (tests → benchmarks → hf_rlloss), no path hacks

ROOT = PACKAGE.parent
BENCHMARKS = ROOT / "benchmarks"
TESTS = ROOT / "tests"
# benchmarks/: scripts by kind, what they and the tests share, the renderers of the pages' figures, the results files
BENCHMARK_KINDS = {"performance", "experiments", "tools", "shared", "figures", "results"}
SCRIPT_KINDS = ("performance", "experiments", "tools")  # each module a script: `python -m benchmarks.<kind>.<name>`
BENCHMARK_TOP = {"__init__.py", "refresh.py"}  # `python -m benchmarks.refresh`
FLAT_ALLOWED: dict[str, str] = {}  # nothing sits flat in benchmarks/ but BENCHMARK_TOP


def _benchmark_files() -> list[Path]:
    files = sorted(p for p in BENCHMARKS.rglob("*.py") if "results" not in p.relative_to(BENCHMARKS).parts)
    return [p for p in files if p.name not in FLAT_ALLOWED or p.parent != BENCHMARKS]


def _dotted(path: Path) -> str:
    return (
        _module_name(path) if path.is_relative_to(PACKAGE) else ".".join(path.relative_to(ROOT).with_suffix("").parts)
    )


def _benchmark_graph(files: list[Path] | None = None) -> dict[str, set[str]]:
    """benchmarks module → the benchmarks modules it imports (anywhere in the file), packages' `__init__` left out."""
    files = files or _benchmark_files()
    names = {_dotted(p).removesuffix(".__init__") for p in files}
    graph = {}
    for path in files:
        if path.name == "__init__.py":
            continue
        targets = set()
        for imported in _imported_modules(path):
            while imported and imported not in names:
                imported = imported.rpartition(".")[0]
            if imported and imported != _dotted(path) and imported != "benchmarks":
                targets.add(imported)
        graph[_dotted(path)] = targets
    return graph


def _test_module_names() -> set[str]:
    return {p.stem for p in TESTS.glob("*.py")}


def _sys_path_edits(path: Path) -> list[int]:
    """Lines of `path` that touch `sys.path`."""
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys"
    ]


def test_benchmarks_is_a_package_of_kinds_and_one_listed_flat_script():
    assert {p.name for p in BENCHMARKS.iterdir() if p.is_dir() and p.name != "__pycache__"} == BENCHMARK_KINDS
    flat = {p.name for p in BENCHMARKS.glob("*.py")}
    assert BENCHMARK_TOP <= flat <= BENCHMARK_TOP | set(FLAT_ALLOWED), sorted(flat - BENCHMARK_TOP - set(FLAT_ALLOWED))
    for kind in BENCHMARK_KINDS - {"results"}:
        assert (BENCHMARKS / kind / "__init__.py").is_file(), kind


def test_no_benchmark_edits_sys_path():
    edits = {str(p.relative_to(ROOT)): _sys_path_edits(p) for p in _benchmark_files()}
    assert not {path: lines for path, lines in edits.items() if lines}


def test_benchmarks_import_no_test_module_and_shared_imports_only_shared():
    """tests → benchmarks, never back; `shared/` is what both import, so it imports nothing else of benchmarks/, and
    nothing imports a script of `tools/` or `refresh` (entry points only)."""
    tests = _test_module_names() | {"tests"}
    for path in _benchmark_files():
        wrong = {n for n in _imported_modules(path) if n.split(".")[0] in tests}
        assert not wrong, f"{path.relative_to(ROOT)} imports test modules {sorted(wrong)}"
    for module, targets in _benchmark_graph().items():
        if module.startswith("benchmarks.shared."):
            assert all(t.startswith("benchmarks.shared") for t in targets), (module, targets)
        entry = {t for t in targets if t.startswith("benchmarks.tools") or t == "benchmarks.refresh"}
        assert not entry, f"{module} imports the entry points {sorted(entry)}"


def test_no_import_cycle_in_benchmarks_or_tests():
    graph = _benchmark_graph()
    assert "benchmarks.performance.scaling" in graph and graph["benchmarks.performance.scaling"] == {
        "benchmarks.performance.loss_step",
        "benchmarks.shared.provenance",
    }  # the scan resolves `from benchmarks.x import y`
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    names = _test_module_names()
    tests = {p.stem: {n.split(".")[0] for n in _imported_modules(p)} & (names - {p.stem}) for p in TESTS.glob("*.py")}
    assert tests["_models"] == {"_trainer_utils"}  # plain-name imports of the tests' own modules
    assert _cycle(tests) is None, " -> ".join(_cycle(tests))


def test_tests_import_benchmarks_by_package_and_helpers_import_no_test():
    """The tests reach benchmarks/ through its packages (`from benchmarks.shared import stats`), and the helper modules
    (`tests/_*.py`) sit below the tests: none imports a `test_*` module."""
    kinds = {f"benchmarks.{kind}" for kind in BENCHMARK_KINDS - {"results"}}
    for path in sorted(TESTS.glob("*.py")):
        imported = _imported_modules(path)
        wrong = {
            n for n in imported if n.split(".")[0] == "benchmarks" and n != "benchmarks" and not _within(n, kinds)
        }
        assert not wrong, f"tests/{path.name} imports {sorted(wrong)}"
        assert not _sys_path_edits(path) or "benchmarks" not in path.read_text().split("sys.path", 1)[1][:80], path
        if path.name.startswith("_"):
            tests = {n for n in imported if n.split(".")[0].startswith("test_")}
            assert not tests, f"tests/{path.name} imports the test modules {sorted(tests)}"


def test_every_benchmark_script_runs_as_a_module_and_both_pages_list_it():
    layout, readme = LAYOUT_PAGE.read_text(), (BENCHMARKS / "README.md").read_text()
    scripts = [p for kind in SCRIPT_KINDS for p in sorted((BENCHMARKS / kind).glob("*.py")) if p.name != "__init__.py"]
    assert len(scripts) >= 16
    for path in [*scripts, BENCHMARKS / "refresh.py"]:
        command = f"python -m {_dotted(path)}"
        assert 'if __name__ == "__main__":' in path.read_text(), f"{path.relative_to(ROOT)} is not a script"
        assert command in layout, f"docs/layout.md does not list `{command}`"
        assert command in readme, f"benchmarks/README.md does not list `{command}`"
    for path in sorted((BENCHMARKS / "shared").glob("*.py")) + sorted((BENCHMARKS / "figures").glob("*.py")):
        if path.name != "__init__.py":
            assert f"`{path.relative_to(ROOT)}`" in layout, f"docs/layout.md does not name {path.relative_to(ROOT)}"


def test_a_benchmark_that_imports_a_test_helper_or_edits_sys_path_is_caught():
    probe = BENCHMARKS / "performance" / "_probe_for_layout_test.py"
    try:
        probe.write_text("import sys\nsys.path.insert(0, 'tests')\nimport _trainer_utils\n")
        with pytest.raises(AssertionError, match="_probe_for_layout_test"):
            test_no_benchmark_edits_sys_path()
        with pytest.raises(AssertionError, match="imports test modules"):
            test_benchmarks_import_no_test_module_and_shared_imports_only_shared()
        probe.write_text("from benchmarks.experiments import demo_seeds\n")
        (BENCHMARKS / "shared" / "_probe_for_layout_test.py").write_text(
            "import benchmarks.performance._probe_for_layout_test\n"
        )
        with pytest.raises(AssertionError, match="benchmarks.shared._probe_for_layout_test"):
            test_benchmarks_import_no_test_module_and_shared_imports_only_shared()
    finally:
        probe.unlink(missing_ok=True)
        (BENCHMARKS / "shared" / "_probe_for_layout_test.py").unlink(missing_ok=True)
