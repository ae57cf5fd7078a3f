"""One home per figure: the numbers on the user pages are rendered from `benchmarks/results/`, never typed.

A page marks each figure it states, and each table of figures, with the name of a renderer registered here:

    the demo's held-out accuracy rose from <!-- fig:demo.heldout_before -->0.52<!-- /fig --> ...

    <!-- table:loss_step -->
    | dtype | vocab | ... |
    <!-- /table -->

A renderer is a function of a `Results` loader that returns the text; what it read is its source, and a table ends
with a line per source naming its machine, date, load, library versions, command and commit, and saying when the
package modules its benchmark measures changed after that commit (`_age.py`). `python -m
benchmarks.tools.render_figures`
rewrites every marked span from the results files; `--check` (and `tests/test_figures.py`) fails when a page's text
differs from its rendering (a table's source line included), names an unknown figure, reads a results file that lacks
a provenance field or whose command does not parse with its script's parser, holds an aggregate that its per-run rows
do not give (`_aggregates.py`), or states a measurement-like number (a ratio, a duration, a memory size, a
percentage, a two-decimal accuracy, a value with 3 or more decimals, e-notation that is not a tolerance or a setting)
outside a marked span, a code span or the page's short list of figures that are not measurements (`NOT_MEASURED`).
The pages are the user pages, the recipes' comments and the docstrings the API reference publishes
(`_docstrings.py`).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import pkgutil
import re
from collections.abc import Callable
from pathlib import Path

from . import _age, _aggregates, _docstrings

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

# Every page a user reads, and the comment lines of the recipes (their headers describe the runs).
PAGES = ("README.md", "benchmarks/README.md", "tests/README.md", "docs/**/*.md", "recipes/**/*.yaml")
# Pages whose numbers are history by design, not claims about the current software.
# (The changelog is not published on the site: docs/changelog.md links to it.)
NOT_CHECKED = {"CHANGELOG.md": "a dated record of each release"}

FIGURES: dict[str, Callable[[Results], str]] = {}
TABLES: dict[str, Callable[[Results], str]] = {}
# images on the pages, by their path in the repository: `fn(results)` returns a matplotlib figure or PNG bytes
PLOTS: dict[str, Callable[[Results], object]] = {}
IMAGE_RE = re.compile(r"!\[[^\]]*\]\((?P<path>[^)\s]+\.png)\)")

FIG_RE = re.compile(r"<!-- fig:(?P<name>[\w.\-]+) -->(?P<body>.*?)<!-- /fig -->", re.S)
TABLE_RE = re.compile(r"<!-- table:(?P<name>[\w.\-]+) -->\n(?P<body>.*?)\n?<!-- /table -->", re.S)
# Measurement-like numbers: ratios, durations, memory, percentages, accuracies or rewards written 0.xx, values with 3
# or more decimals, and e-notation.
_NUM = r"(?<![\w.,])\d+(?:,\d{3})*(?:\.\d+)?"
E_NOTATION = re.compile(r"(?<![\w.])\d+(?:\.\d+)?[eE][-+]?\d+\b")
MEASUREMENT = re.compile(
    # a ratio `×` is not a shape or a count: "1×8 micro-batches", "dp=2×sp=2" and "8 × 80 GB" are not flagged
    _NUM
    + r"\s?(?:×(?!\s?\d|[A-Za-z])|x\b|%|ms\b|s\b|min\b|minutes?\b|seconds?\b|hours?\b|h\b|[kKMG]i?B\b)"
    + r"|"
    + _NUM
    + r"\s(?:times)\b"
    + r"|(?<![\w.,])0\.\d{2}\b"
    + r"|(?<![\w.,])\d+\.\d{3,}\b(?!\.\d)"  # 3+ decimals, not a version (1.16.0)
    + r"|"
    + E_NOTATION.pattern
)
# e-notation is a tolerance or a setting, not a measurement, right after a bound or a setting's name ("to 1e-6",
# "(1e-6)", "≤ 1e-5", "lr 3e-5", "of order 1e-10", an epsilon "std + 1e-4") unless a measurement is named there
# ("measured ≤ 1e-8", "at most 4e-9").
_TOLERANCE_BEFORE = re.compile(
    r"(?:\b(?:to|within|at|below|above|relative|lr|rate|AdamW|bound|tolerance|order)|[≤<>≥=(±≈+])[\s,]*$", re.I
)
_MEASURED_BEFORE = re.compile(r"\b(?:measured?|most|largest|max(?:imum)?|was|is)\b[^\w]*(?:≤|<|=)?\s*$", re.I)


def _is_tolerance(prose: str, m: re.Match) -> bool:
    if not E_NOTATION.fullmatch(m[0]):
        return False
    before = prose[max(0, m.start() - 30) : m.start()]
    return bool(_TOLERANCE_BEFORE.search(before)) and not _MEASURED_BEFORE.search(before)


# Numbers that look like measurements but are not (hardware requirements, settings, thresholds), per page, each with
# why. Keep this short: a measured figure belongs in a results file.
NOT_MEASURED: dict[str, dict[str, str]] = {
    "README.md": {"≥ 24 GB": "the GPU memory a recipe is sized for", "8 × 80 GB": "the GPUs a recipe is sized for"},
    "recipes/qwen2.5_0.5b/gsm8k/config_1gpu.yaml": {">= 24 GB": "the GPU memory the recipe is sized for"},
    "recipes/qwen2.5_1.5b/gsm8k/config_8gpu.yaml": {"80 GB": "the GPU memory the recipe is sized for"},
    "recipes/smollm2_135m/arithmetic/config_demo_vllm.yaml": {"in GiB": "the unit of a setting"},
    "docs/engines.md": {"80 GB GPU": "the GPU memory a config is sized for"},
    "docs/gpu.md": {"vLLM 0.30": "a vLLM version"},
    "hf_rlloss/loss/config.py": {
        "GSPO 3e-4": "GSPO's default clip range",
        "GSPO 4e-4": "GSPO's default clip range",
        "uses 0.28": "DAPO's clip-higher setting",
        "near 128 MB": "the block size the chunking aims at",
    },
    "hf_rlloss/loss/chunked_logprobs.py": {"near 128 MB": "the block size the chunking aims at"},
    "hf_rlloss/loss/rollout_is.py": {"verl used 1e-4": "verl's setting", "uses 0.04": "the M2PO paper's setting"},
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


def plot(path: str):
    """Register the renderer of the image at `path` (from the repository root): `fn(results) -> figure or bytes`."""

    def register(fn):
        if path in PLOTS:
            raise ValueError(f"plot {path!r} is registered twice")
        PLOTS[path] = fn
        return fn

    return register


def render_plot(path: str) -> tuple[bytes, list[str]]:
    """The PNG of a registered image, drawn from its results files, and the files it read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Results()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # a script's drawing may report where it wrote
            drawn = PLOTS[path](results)
        if isinstance(drawn, bytes):
            return drawn, results.read
        buffer = io.BytesIO()
        drawn.savefig(buffer, format="png", dpi=100, metadata={"Software": None})
        plt.close(drawn)
        return buffer.getvalue(), results.read
    except Exception as err:
        raise RenderError(f"plot {path!r}: {type(err).__name__}: {err}") from err


def draw(path: str) -> None:
    """Write one registered image from its results files."""
    load_renderers()
    (ROOT / path).write_bytes(render_plot(path)[0])


def images(page: str, text: str) -> list[str]:
    """The repository paths of the PNG images a page shows."""
    base = (ROOT / page).parent
    return [str((base / m["path"]).resolve().relative_to(ROOT)) for m in IMAGE_RE.finditer(text)]


def image_problems(page: str, text: str) -> list[str]:
    problems = []
    for path in images(page, text):
        if path not in PLOTS:
            problems.append(f"{page}: image {path} is drawn by no renderer (`core.plot`)")
            continue
        try:
            drawn = render_plot(path)[0]
        except RenderError as err:
            problems.append(f"{page}: {err}")
            continue
        if not (ROOT / path).exists() or (ROOT / path).read_bytes() != drawn:
            problems.append(f"{page}: image {path} differs from its drawing from the results files")
    return problems


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


LOAD_KEYS = ("load_average_at_start", "load_average_at_end", "uptime", "load")
LIBRARIES = {"torch": "torch", "transformers": "transformers", "trl": "TRL"}


def _uses_vllm(meta: dict) -> bool:
    return "vllm" in (meta.get("command") or "").lower()


def provenance_problems(name: str) -> list[str]:
    """What a results file lacks of machine, date, command, commit, library versions and load; a field that was not
    recorded and cannot be measured again is present with the value "unknown" (the source line then says so)."""
    meta = meta_of(Results()(name))
    missing = [key for key in ("machine", "date", "command", "git_commit", "versions") if not meta.get(key)]
    if not any(meta.get(key) for key in LOAD_KEYS):
        missing.append("load")
    versions = meta.get("versions")
    if isinstance(versions, dict):
        wanted = [*LIBRARIES, "vllm"] if _uses_vllm(meta) else list(LIBRARIES)
        missing += [f"versions.{lib}" for lib in wanted if not versions.get(lib)]
    problems = [f"benchmarks/results/{name}: meta has no {', '.join(missing)}"] if missing else []
    if meta.get("command"):
        problems += _age.command_problems(name, meta) + _age.age_problems(name, meta)
    return problems


def load_text(meta: dict) -> str:
    """The machine's load during the run, as recorded (1-minute load averages)."""
    start, end = meta.get("load_average_at_start"), meta.get("load_average_at_end")
    if isinstance(meta.get("uptime"), list):
        found = [re.search(r"load average: ([\d.]+)", u) for u in meta["uptime"]]
        loads = [float(m[1]) for m in found if m]
        start, end = (loads[0], loads[-1]) if loads else (None, None)
        start, end = [start], [end]
    if isinstance(start, list) and start and start[0] is not None:
        if isinstance(end, list) and end and len(meta.get("uptime") or []) > 1:
            return f"load {start[0]:.1f} → {end[0]:.1f}"
        return f"load {start[0]:.1f} at the start"
    if isinstance(end, list) and end:
        return f"load {end[0]:.1f} at the end"
    load = meta.get("load")
    return f"load: {load}" if load and load != _age.UNKNOWN else "load not recorded"


def versions_text(meta: dict) -> str:
    versions = meta.get("versions")
    if not isinstance(versions, dict):
        return "library versions not recorded"
    libraries = dict(LIBRARIES, **({"vllm": "vLLM"} if versions.get("vllm") or _uses_vllm(meta) else {}))
    return ", ".join(
        f"{label} {versions[lib]}"
        if versions.get(lib, _age.UNKNOWN) != _age.UNKNOWN
        else f"{label} version not recorded"
        for lib, label in libraries.items()
    )


def source_text(meta: dict) -> str:
    """One source's provenance: machine, date, load, versions, command and commit (stale when marked so)."""
    age, _ = _age.age(meta)
    return (
        f"{machine_text(meta)}, {meta.get('date')}, {load_text(meta)}, {versions_text(meta)}; "
        f"`{meta.get('command')}`; {age}"
    )


def provenance_line(sources: list[str]) -> str:
    """A table's source lines: one per results file it read (and per row added to a file later)."""
    lines = []
    for name in sources:
        data = Results()(name)
        line = f"Source: `results/{name}`: {source_text(meta_of(data))}"
        for run in data.get("runs", []) if isinstance(data, dict) else []:  # rows added later (`--add`)
            if isinstance(run, dict) and isinstance(run.get("meta"), dict):
                line += f"; its seed {run.get('seed')}: {source_text(run['meta'])}"
        lines.append(line + ".")
    return "\n\n".join(lines)


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


# Tables that a test renders and compares with the page (their home is the test's run): marker -> the test.
TEST_RENDERED = {
    "architecture-matrix": "tests/test_architectures.py",
    "architecture-findings": "tests/test_architectures.py",
}


def _strip_unchecked(text: str, yaml: bool) -> str:
    if yaml:  # a recipe: only its comments are prose
        text = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    for marker in TEST_RENDERED:
        text = re.sub(rf"<!-- {marker}:begin -->.*?<!-- {marker}:end -->", "", text, flags=re.S)
    text = TABLE_RE.sub("", text)
    text = FIG_RE.sub("", text)
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks: commands and settings
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans: settings and identifiers
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"\]\([^)]*\)|https?://\S+", "", text)  # link targets
    text = re.sub(r"\$[^$\n]+\$", "", text)  # inline math
    text = re.sub(r"arXiv:? ?\d{4}\.\d{4,5}", "", text)  # paper identifiers
    return text


def unbacked(page: str, text: str) -> list[str]:
    """The measurement-like numbers `text` states outside marked figures (and the page's `NOT_MEASURED`)."""
    allowed = NOT_MEASURED.get(page, {})
    prose = _strip_unchecked(text, yaml=page.endswith(".yaml"))
    for phrase in allowed:
        prose = prose.replace(phrase, "")
    return [m[0] for m in MEASUREMENT.finditer(prose) if not _is_tolerance(prose, m)]


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
            rendered = render_table(m["name"])[0].strip()
            if m["body"].strip() != rendered:
                body, _, sources = m["body"].strip().partition("\n\nSource: ")
                what = "source lines" if body == rendered.partition("\n\nSource: ")[0] else "figures"
                problems.append(f"{page}: table {m['name']!r} differs from its results file ({what})")
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


def _docstring_pages() -> list[tuple[str, Path, set[str] | None]]:
    return [(str(path.relative_to(ROOT)), path, names) for path, names in _docstrings.published().items()]


def check_docstrings(page: str, text: str, names: set[str] | None = None) -> list[str]:
    """`check_text` of every docstring a published module's source publishes (`_docstrings.docstrings`)."""
    problems = []
    for name, doc in _docstrings.docstrings(text, names):
        problems += [p.replace(f"{page}: ", f"{page} (docstring of {name}): ", 1) for p in check_text(page, doc)]
    return problems


def readers(problems: list[str] | None = None, plots: bool = True) -> dict[str, list[str]]:
    """Every results file a renderer reads, with the renderers that read it (render errors go to `problems`)."""
    found: dict[str, list[str]] = {}
    kinds = [("figure", FIGURES, render_figure), ("table", TABLES, render_table)]
    kinds += [("plot", PLOTS, render_plot)] if plots else []
    for kind, names, render in kinds:
        for name in names:
            try:
                for source in render(name)[1]:
                    found.setdefault(source, []).append(f"{kind} {name!r}")
            except RenderError as err:
                if problems is not None:
                    problems.append(str(err))
    return found


def sources() -> list[str]:
    """The results files the figures and tables read."""
    return sorted(readers(plots=False))


def source_problems(source: str) -> list[str]:
    """What is wrong with one results file: its provenance, its command, its stored aggregate."""
    return provenance_problems(source) + _aggregates.problems(source, Results()(source))


def check_sources() -> list[str]:
    """`source_problems` of every results file the figures and tables read, each naming its readers."""
    load_renderers()
    return [
        f"{p} (read by {', '.join(names)})"
        for source, names in readers(plots=False).items()
        for p in source_problems(source)
    ]


def check() -> list[str]:
    load_renderers()
    problems = []
    used = set()
    for path in pages():
        page = str(path.relative_to(ROOT))
        text = path.read_text(encoding="utf8")
        problems += check_text(page, text) + image_problems(page, text)
        used |= {m["name"] for m in FIG_RE.finditer(text)} | {m["name"] for m in TABLE_RE.finditer(text)}
        used |= set(images(page, text))
    for page, path, names in _docstring_pages():
        text = path.read_text(encoding="utf8")
        problems += check_docstrings(page, text, names)
        used |= {m["name"] for m in FIG_RE.finditer(text)}
    for source, names in sorted(readers(problems).items()):
        problems += [f"{p} (read by {', '.join(names)})" for p in source_problems(source)]
    unused = sorted((set(FIGURES) | set(TABLES) | set(PLOTS)) - used)
    problems += [f"renderer {name!r} is on no page" for name in unused]
    return problems


def write() -> list[str]:
    """Render every page (and published docstring) in place; returns the pages that changed."""
    load_renderers()
    changed = []
    for path in pages() + [path for _, path, _ in _docstring_pages()]:
        text = path.read_text(encoding="utf8")
        new = update(text)
        if new != text:
            path.write_text(new, encoding="utf8")
            changed.append(str(path.relative_to(ROOT)))
    for path in PLOTS:
        drawn = render_plot(path)[0]
        if not (ROOT / path).exists() or (ROOT / path).read_bytes() != drawn:
            (ROOT / path).write_bytes(drawn)
            changed.append(path)
    return changed
