"""One home per figure: the numbers on the user pages are rendered from `benchmarks/results/`, never typed.

A page marks each figure it states, and each table of figures, with the name of a renderer registered here:

    the demo's held-out accuracy rose from <!-- fig:demo.heldout_before -->0.52<!-- /fig --> ...

    <!-- table:loss_step -->
    | dtype | vocab | ... |
    <!-- /table -->

A renderer is a function of a `Results` loader that returns the text; what it read is its source, and a table ends
with a line naming each source's machine, date and command. `python benchmarks/render_figures.py` rewrites every
marked span from the results files; `--check` (and `tests/test_figures.py`) fails when a page's text differs from
its rendering, names an unknown figure, reads a results file that lacks its machine, date or command, or states a
measurement-like number (a ratio, a duration, a memory size, a percentage, a two-decimal accuracy) outside a marked
span, a code span or the page's short list of figures that are not measurements (`NOT_MEASURED`).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

# Every page a user reads, and the comment lines of the recipes (their headers describe the runs).
PAGES = ("README.md", "benchmarks/README.md", "tests/README.md", "docs/**/*.md", "recipes/**/*.yaml")
# Pages whose numbers are history by design, not claims about the current software.
NOT_CHECKED = {"CHANGELOG.md": "a dated record of each release"}

FIGURES: dict[str, Callable[[Results], str]] = {}
TABLES: dict[str, Callable[[Results], str]] = {}

FIG_RE = re.compile(r"<!-- fig:(?P<name>[\w.\-]+) -->(?P<body>.*?)<!-- /fig -->", re.S)
TABLE_RE = re.compile(r"<!-- table:(?P<name>[\w.\-]+) -->\n(?P<body>.*?)\n?<!-- /table -->", re.S)
# Measurement-like numbers: ratios, durations, memory, percentages, and accuracies or rewards written 0.xx.
_NUM = r"(?<![\w.,])\d+(?:,\d{3})*(?:\.\d+)?"
MEASUREMENT = re.compile(
    # a ratio `×` is not a shape or a count: "1×8 micro-batches", "dp=2×sp=2" and "8 × 80 GB" are not flagged
    _NUM
    + r"\s?(?:×(?!\s?\d|[A-Za-z])|%|ms\b|s\b|min\b|minutes?\b|seconds?\b|hours?\b|h\b|[kMG]i?B\b)"
    + r"|(?<![\w.,])0\.\d{2}\b"
)

# Numbers that look like measurements but are not (hardware requirements, settings, thresholds), per page, each with
# why. Keep this short: a measured figure belongs in a results file.
NOT_MEASURED: dict[str, dict[str, str]] = {
    "README.md": {"≥ 24 GB": "the GPU memory a recipe is sized for", "8 × 80 GB": "the GPUs a recipe is sized for"},
    "recipes/qwen2.5_0.5b/gsm8k/config_1gpu.yaml": {">= 24 GB": "the GPU memory the recipe is sized for"},
    "recipes/qwen2.5_1.5b/gsm8k/config_8gpu.yaml": {"80 GB": "the GPU memory the recipe is sized for"},
    "recipes/smollm2_135m/arithmetic/config_demo_vllm.yaml": {"in GiB": "the unit of a setting"},
    "docs/engines.md": {"80 GB GPU": "the GPU memory a config is sized for"},
}


class Results:
    """Loads results files by their path under `benchmarks/results/` and remembers which it read."""

    def __init__(self):
        self.read: list[str] = []

    def __call__(self, name: str):
        path = RESULTS / name
        if name not in self.read:
            self.read.append(name)
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in path.read_text(encoding="utf8").splitlines() if line.strip()]
        return json.loads(path.read_text(encoding="utf8"))


def figure(name: str):
    """Register an inline figure renderer: `fn(results) -> str`."""

    def register(fn):
        if name in FIGURES:
            raise ValueError(f"figure {name!r} is registered twice")
        FIGURES[name] = fn
        return fn

    return register


def table(name: str):
    """Register a table renderer: `fn(results) -> str` (markdown); its provenance line is appended."""

    def register(fn):
        if name in TABLES:
            raise ValueError(f"table {name!r} is registered twice")
        TABLES[name] = fn
        return fn

    return register


def load_renderers() -> None:
    """Import every module of this package but this one: each registers its figures and tables."""
    package = Path(__file__).parent
    for module in pkgutil.iter_modules([str(package)]):
        if module.name not in ("core", "__main__"):
            importlib.import_module(f"{__package__}.{module.name}")


def meta_of(data) -> dict:
    """A results file's provenance block (`meta`, or the file itself for a flat JSON object; a JSON-lines file's
    first record)."""
    if isinstance(data, list):
        data = data[0] if data else {}
    return data.get("meta", data) if isinstance(data, dict) else {}


def machine_text(meta: dict) -> str:
    machine = meta.get("machine")
    if isinstance(machine, dict):
        return machine.get("kind") or ", ".join(f"{v}" for v in machine.values())
    return str(machine) if machine else ""


def provenance_problems(name: str) -> list[str]:
    """What a results file lacks of machine, date and command."""
    meta = meta_of(Results()(name))
    missing = [key for key in ("machine", "date", "command") if not meta.get(key)]
    return [f"benchmarks/results/{name}: meta has no {', '.join(missing)}"] if missing else []


def provenance_line(sources: list[str]) -> str:
    parts = []
    for name in sources:
        data = Results()(name)
        meta = meta_of(data)
        parts.append(f"`results/{name}`: {machine_text(meta)}, {meta.get('date')}, `{meta.get('command')}`")
        for run in data.get("runs", []) if isinstance(data, dict) else []:  # rows added later (`--add`)
            if isinstance(run, dict) and isinstance(run.get("meta"), dict):
                added = run["meta"]
                when = f"{machine_text(added)}, {added.get('date')}, `{added.get('command')}`"
                parts[-1] += f"; its seed {run.get('seed')}: {when}"
    return "Source: " + "; ".join(parts) + "."


class RenderError(Exception):
    """A renderer failed (a results file missing, a key absent): the message names the renderer."""


def render_figure(name: str) -> tuple[str, list[str]]:
    results = Results()
    try:
        return FIGURES[name](results), results.read
    except Exception as err:
        raise RenderError(f"figure {name!r}: {type(err).__name__}: {err}") from err


def render_table(name: str) -> tuple[str, list[str]]:
    results = Results()
    try:
        text = TABLES[name](results).rstrip("\n")
        return f"{text}\n\n{provenance_line(results.read)}", results.read
    except Exception as err:
        raise RenderError(f"table {name!r}: {type(err).__name__}: {err}") from err


def update(text: str) -> str:
    """`text` with every marked figure and table rendered afresh (unknown names are left for `check` to report)."""

    def fig(m):
        try:
            return f"<!-- fig:{m['name']} -->{render_figure(m['name'])[0]}<!-- /fig -->"
        except (KeyError, RenderError):
            return m[0]

    def tab(m):
        try:
            return f"<!-- table:{m['name']} -->\n{render_table(m['name'])[0]}\n<!-- /table -->"
        except (KeyError, RenderError):
            return m[0]

    return FIG_RE.sub(fig, TABLE_RE.sub(tab, text))


def _strip_unchecked(text: str, yaml: bool) -> str:
    if yaml:  # a recipe: only its comments are prose
        text = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    text = TABLE_RE.sub("", text)
    text = FIG_RE.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks: commands and settings
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans: settings and identifiers
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"\]\([^)]*\)|https?://\S+", "", text)  # link targets
    text = re.sub(r"\$[^$\n]+\$", "", text)  # inline math
    return text


def unbacked(page: str, text: str) -> list[str]:
    """The measurement-like numbers `text` states outside marked figures (and the page's `NOT_MEASURED`)."""
    allowed = NOT_MEASURED.get(page, {})
    prose = _strip_unchecked(text, yaml=page.endswith(".yaml"))
    for phrase in allowed:
        prose = prose.replace(phrase, "")
    return [m[0] for m in MEASUREMENT.finditer(prose)]


def pages() -> list[Path]:
    found = {p for pattern in PAGES for p in ROOT.glob(pattern)}
    return sorted(p for p in found if str(p.relative_to(ROOT)) not in NOT_CHECKED)


def check_text(page: str, text: str) -> list[str]:
    """Every problem of one page: unknown or stale figures and tables, figures stated without a source."""
    problems = []
    for m in TABLE_RE.finditer(text):
        if m["name"] not in TABLES:
            problems.append(f"{page}: unknown table {m['name']!r}")
            continue
        try:
            if m["body"].strip() != render_table(m["name"])[0].strip():
                problems.append(f"{page}: table {m['name']!r} differs from its results file")
        except RenderError as err:
            problems.append(f"{page}: {err}")
    for m in FIG_RE.finditer(text):
        if m["name"] not in FIGURES:
            problems.append(f"{page}: unknown figure {m['name']!r}")
            continue
        try:
            rendered = render_figure(m["name"])[0]
        except RenderError as err:
            problems.append(f"{page}: {err}")
            continue
        if m["body"] != rendered:
            problems.append(f"{page}: figure {m['name']!r} says {m['body']!r}, its results file {rendered!r}")
    problems += [f"{page}: {number!r} is stated without a results file" for number in unbacked(page, text)]
    return problems


def check() -> list[str]:
    load_renderers()
    problems = []
    used = set()
    for path in pages():
        page = str(path.relative_to(ROOT))
        text = path.read_text(encoding="utf8")
        problems += check_text(page, text)
        used |= {m["name"] for m in FIG_RE.finditer(text)} | {m["name"] for m in TABLE_RE.finditer(text)}
    sources = set()
    for name, render in [(n, render_figure) for n in FIGURES] + [(n, render_table) for n in TABLES]:
        try:
            sources |= set(render(name)[1])
        except RenderError as err:
            problems.append(str(err))
    for name in sorted(sources):
        problems += provenance_problems(name)
    unused = sorted((set(FIGURES) | set(TABLES)) - used)
    problems += [f"renderer {name!r} is on no page" for name in unused]
    return problems


def write() -> list[str]:
    """Render every page in place; returns the pages that changed."""
    load_renderers()
    changed = []
    for path in pages():
        text = path.read_text(encoding="utf8")
        new = update(text)
        if new != text:
            path.write_text(new, encoding="utf8")
            changed.append(str(path.relative_to(ROOT)))
    return changed
