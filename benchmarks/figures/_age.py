"""How old a results file is, and whether its recorded command still runs.

A results file's `meta` names the commit it was measured at (`git_commit`). The benchmark script its command runs
declares the package modules it measures (`MEASURES`, a tuple of repository paths; a file written outside a
benchmark script declares them in its own `meta["measures"]`). When `git log <commit>..HEAD -- <modules>` lists a
commit, the measured code changed after the measurement: a table's source line says so, and
`python -m benchmarks.refresh --stale` re-runs the file's command, unless pinned outputs (`benchmarks/shared/pins.py`)
show that the changed code gave the same outputs on their recorded inputs at the file's commit and now.

The recorded command must parse with its script's own argument parser (`build_parser()` of a benchmark script,
`parse_args(argv)` of a recipe) and, where the parser has `--out`, write the very file that records it.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import importlib.util
import io
import shlex
import subprocess
import sys
import typing
from pathlib import Path

from benchmarks.shared import pins

ROOT = Path(__file__).resolve().parents[2]
UNKNOWN = "unknown"
# a commit not recorded at the run but derived afterwards: the value of `git_commit_source`, shown on the page
DERIVED = "the commit that added the file"
_SEPARATORS = {"&", "&&", ";", "|"}


def commands(command: str) -> list[list[str]]:
    """The commands of a recorded command line (several when joined by `&&`, `&` or `;`), each as its arguments
    without leading `VAR=value` settings."""
    out, current = [], []
    for token in shlex.split(command) + ["&&"]:
        if token in _SEPARATORS:
            while current and "=" in current[0] and not current[0].startswith("-"):
                current.pop(0)
            if current:
                out.append(current)
            current = []
        else:
            current.append(token)
    return out


def script_of(argv: list[str]) -> tuple[str | None, list[str]]:
    """The repository script a command runs and the arguments it passes it: a module run with `-m`
    (`python -m benchmarks.performance.loss_step` → `benchmarks/performance/loss_step.py`) or a script by its path
    (`recipes/grpo.py`)."""
    for i, token in enumerate(argv):
        if token == "-m" and i + 1 < len(argv) and argv[i + 1].startswith("benchmarks."):
            return argv[i + 1].replace(".", "/") + ".py", argv[i + 2 :]
        if token.endswith(".py"):
            return token, argv[i + 1 :]
    return None, []


def scripts(meta: dict) -> list[str]:
    return [s for s, _ in map(script_of, commands(meta.get("command") or "")) if s]


def _constant(path: Path, name: str):
    """A module-level constant of a script, read without importing it."""
    for node in ast.parse(path.read_text(encoding="utf8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def measured_modules(meta: dict) -> list[str]:
    """The package modules the file's measurement ran: `meta["measures"]`, or its scripts' `MEASURES`."""
    if meta.get("measures"):
        return list(meta["measures"])
    found: list[str] = []
    for script in scripts(meta):
        path = ROOT / script
        for module in (_constant(path, "MEASURES") or ()) if path.exists() else ():
            if module not in found:
                found.append(module)
    return found


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


@functools.cache
def changed_since(commit: str, modules: tuple[str, ...]) -> tuple[str, ...] | None:
    """The commits after `commit` that touch `modules` (None when `commit` is not in this repository's history)."""
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        return None
    return tuple(_git("log", "--format=%h", f"{commit}..HEAD", "--", *modules).stdout.split())


def age(meta: dict) -> tuple[str, bool]:
    """The source line's words on the file's commit, and whether the measured code changed since."""
    commit = meta.get("git_commit")
    if not commit or commit == UNKNOWN:
        return "commit not recorded", False
    where = f"measured at `{commit}`"
    if meta.get("git_commit_source") == DERIVED:
        where = f"measured at or before `{commit}` ({DERIVED}; none recorded at the run)"
    modules = measured_modules(meta)
    changed = changed_since(commit, tuple(modules)) if modules else ()
    if changed is None:
        return f"{where}, a commit not in this repository", False
    if changed:
        cases = pins.vouching(commit, tuple(modules), scripts(meta))
        if cases:
            pinned = ", ".join(f"`benchmarks/shared/pins/{case}.json`" for case in cases)
            return (
                f"{where}; the measured code changed since, its outputs on the recorded inputs did not ({pinned})",
                False,
            )
    return (f"{where}; the measured code changed since" if changed else where), bool(changed)


def age_problems(name: str, meta: dict) -> list[str]:
    """A file whose measured modules are not declared, or name paths that do not exist."""
    where = f"benchmarks/results/{name}"
    modules = measured_modules(meta)
    if not modules:
        return [f"{where}: no measured modules (the script's `MEASURES` or `meta.measures`)"]
    return [f"{where}: measured module {m!r} does not exist" for m in modules if not (ROOT / m).exists()]


def _load_file(path: Path, name: str):
    """The module of the file at `path`, loaded under `name` (and kept in `sys.modules`), after the siblings it
    imports by their plain names (`from grpo import ...` in `recipes/grpo_async.py`)."""
    if name in sys.modules:
        return sys.modules[name]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf8"))):
        imported = [node.module] if isinstance(node, ast.ImportFrom) and not node.level else []
        imported += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        for sibling in imported:
            if sibling and (path.parent / f"{sibling}.py").is_file() and sibling != name:
                _load_file(path.parent / f"{sibling}.py", sibling)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def _script_module(script: str):
    """A benchmark by its module name (`benchmarks.performance.loss_step`); any other script by its path."""
    if script.startswith("benchmarks/"):
        return importlib.import_module(script.removesuffix(".py").replace("/", "."))
    return _load_file(ROOT / script, Path(script).stem)


def parse(script: str, args: list[str]):
    """`args` parsed by `script`'s own parser: a `SystemExit` (with argparse's message) when they do not parse."""
    module = _script_module(script)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            if hasattr(module, "build_parser"):
                return module.build_parser().parse_args(args)
            if hasattr(module, "parse_args") and hasattr(module, "main"):  # a recipe: TrlParser with its YAML config
                hints = typing.get_type_hints(module.main)
                return module.parse_args(args, tuple(t for name, t in hints.items() if name != "return"))
        except SystemExit as err:
            raise SystemExit(stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue() else str(err)) from err
        except ValueError as err:  # a recipe's own validation of its arguments
            raise SystemExit(str(err)) from err
    raise SystemExit(f"{script} has no build_parser() to parse its command with")


def command_problems(name: str, meta: dict) -> list[str]:
    """The recorded command does not parse with its script's parser, or writes another file than this one."""
    where = f"benchmarks/results/{name}"
    problems = []
    argvs = commands(meta.get("command") or "")
    for argv in argvs:
        script, args = script_of(argv)
        if script is None or not (ROOT / script).exists():
            problems.append(f"{where}: its command runs no script of this repository: {shlex.join(argv)!r}")
            continue
        try:
            parsed = parse(script, args)
        except SystemExit as err:
            problems.append(f"{where}: its command does not parse with {script}'s parser: {err}")
            continue
        out = getattr(parsed, "out", None)
        if isinstance(out, (str, Path)) and Path(out).suffix and len(argvs) == 1:
            if (ROOT / out).resolve() != (ROOT / "benchmarks" / "results" / name).resolve():
                problems.append(f"{where}: its command writes {out}, not this file")
    return problems
