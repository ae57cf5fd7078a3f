"""The documentation: the site builds with `mkdocs build --strict` (no broken link, anchor, page or docstring
reference), the README stays a short introduction, and what the pages name exists."""

import ast
import html as html_lib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 200


def _nav_pages(nav) -> list[str]:
    """The page paths of an mkdocs `nav` (nested lists of `title: page` mappings, sections and bare paths)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    raise TypeError(f"unexpected nav entry {nav!r}")


def _nav() -> list[str]:
    return _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf8"))["nav"])


@pytest.mark.slow
def test_site_builds_in_strict_mode(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2.0, not a build warning
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", "mkdocs.yml", "--site-dir", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.perf_counter() - start
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-6000:]
    assert "WARNING" not in log, log[-6000:]
    # every page of the navigation was rendered (use_directory_urls: page.md -> page/index.html)
    for page in _nav():
        stem = Path(page).with_suffix("")
        html = site / (stem.parent if stem.name == "index" else stem) / "index.html"
        assert html.is_file(), f"{page} was not rendered"
    # the API reference holds the docstrings, the notebooks their outputs
    _check_api_reference(site)
    notebook = (site / "notebooks" / "01_subclassing_the_trainer" / "index.html").read_text(encoding="utf8")
    assert "all checks passed" in notebook and "data:image/png;base64" in notebook
    assert "all checks passed" in (site / "notebooks" / "02_the_loss_layer" / "index.html").read_text(encoding="utf8")
    _check_in_page_anchors(site)
    print(f"mkdocs build --strict: {seconds:.1f} s")


def _check_in_page_anchors(site: Path) -> None:
    """Every `href="#x"` of a rendered page (its table of contents included) has an element `id="x"` on that page:
    mkdocs --strict checks links between pages, not the anchors a plugin (the notebooks') writes itself."""
    for page in site.rglob("index.html"):
        html = page.read_text(encoding="utf8")
        ids = set(re.findall(r'id="([^"]+)"', html))
        dead = sorted({a for a in re.findall(r'href="#([^"]+)"', html) if a not in ids})
        assert not dead, f"{page.relative_to(site)}: links to anchors the page does not have: {dead[:5]}"


def _check_api_reference(site: Path) -> None:
    """Each public name documented once, where users import it (`hf_rlloss.X`); pydantic fields listed; no raw HF
    docstring syntax, no `logger` entry; the recipe support included."""
    pages = {p.parent.name: p.read_text(encoding="utf8") for p in (site / "api").glob("*/index.html")}
    html = "\n".join(pages.values())
    for name in _public_names():
        assert html.count(f'id="hf_rlloss.{name}"') == 1, f"hf_rlloss.{name} is not documented exactly once"
    config = pages["loss_config"]
    assert "policy_loss_cfg" in config and "loss_agg_mode" in config and "Fields:" in config  # griffe-pydantic
    for raw in ("[`~", "*optional*", "[`RLLossGRPOConfig`]"):
        assert raw not in html, f"raw HF docstring syntax {raw!r} in the API reference"
    assert not re.search(r'id="[\w.]*\.logger"', html), "a logger has an entry"
    assert 'id="hf_rlloss.recipe_support.assets.make_tiny_model"' in pages["recipe_support"]
    # cross-references are links: to an entry of the reference, and to a page of the site
    assert 'href="../trainers/#hf_rlloss.RLLossGRPOConfig"' in html or 'href="#hf_rlloss.RLLossGRPOConfig"' in html
    assert 'href="../../design/' in pages["trainers"]
    # signatures are wrapped: no line of a rendered signature wider than the page
    for signature in re.findall(r'<div class="doc-signature[^"]*">(.*?)</div>', html, flags=re.S):
        text = html_lib.unescape(re.sub(r"<[^>]+>", "", signature))
        assert max(len(line) for line in text.splitlines()) <= 110, text


def test_every_page_in_the_nav_exists_and_every_page_is_in_the_nav():
    pages = _nav()
    assert len(pages) == len(set(pages)), "a page is listed twice"
    for page in pages:
        assert (DOCS / page).is_file(), f"mkdocs.yml's nav names docs/{page}, which does not exist"
    on_disk = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*") if p.suffix in (".md", ".ipynb")}
    assert on_disk - set(pages) == {"README.md"}, "a page that no nav entry reaches (README.md is GitHub's)"


REPO_URL = "https://github.com/hf-rlloss/hf-rlloss"  # pyproject.toml's [project.urls] Repository


def test_readme_is_a_short_introduction_whose_links_resolve():
    # The README is the package's description on an index too: every link is absolute, and one into the repository
    # names a file that exists.
    text = (ROOT / "README.md").read_text(encoding="utf8")
    assert len(text.splitlines()) <= README_MAX_LINES, "the README introduces; the manual is in docs/"
    assert f'Repository = "{REPO_URL}"' in (ROOT / "pyproject.toml").read_text(encoding="utf8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"https?://", link)]
    assert not relative, f"relative links break on an index page: {relative}"
    into_repo = [link for link in links if link.startswith(f"{REPO_URL}/blob/main/")]
    assert any("/docs/" in link for link in into_repo), "the README links into the documentation"
    for link in into_repo:
        target = link.removeprefix(f"{REPO_URL}/blob/main/").split("#", 1)[0]
        assert (ROOT / target).exists(), f"README links to {link}, whose file does not exist"


def _commands(text: str) -> list[str]:
    """The commands of a page's ```bash blocks, one per line, continuation lines (`\\`) joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)\n```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+", " ", line.split(" #", 1)[0]).strip()
            if command:
                commands.append(command)
    return commands


DEMO = ["git clone https://github.com/hf-rlloss/hf-rlloss.git && cd hf-rlloss", "make demo"]
TESTS = ["make test"]  # what .ci/run runs
CODE_WIDTH = 76  # characters a code box of the site shows at 1280 px without scrolling (Material, default font)


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_quickstart_commands_are_there_in_order_and_fit(page):
    text = (ROOT / page).read_text(encoding="utf8")
    commands = _commands(text)
    for sequence in (DEMO, TESTS):
        positions = [commands.index(command) for command in sequence]  # ValueError: a command is missing
        assert positions == sorted(positions), f"{page}: {sequence} out of order"
    blocks = re.findall(r"```(?:bash|python)\n(.*?)\n```", text, flags=re.S)
    long = [line for block in blocks for line in block.splitlines() if len(line) > CODE_WIDTH]
    assert not long, f"{page}: code lines wider than the page's code box: {long}"


def test_the_command_reader_joins_continuations_and_drops_comments():
    text = "```bash\npip install torch==2.13.0   # first\naccelerate launch a \\\n    --config b\n```"
    assert _commands(text) == ["pip install torch==2.13.0", "accelerate launch a --config b"]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb")))
def test_rendered_notebook_is_an_executed_copy_of_the_notebook(name):
    source = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    copy = nbformat.read(DOCS / "notebooks" / name, as_version=4)
    stale = "rerun `python notebooks/execute_for_docs.py`"
    assert [(c.cell_type, c.source) for c in copy.cells] == [(c.cell_type, c.source) for c in source.cells], stale
    code = [cell for cell in copy.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code), stale
    outputs = [out for cell in code for out in cell.outputs]
    assert not [out for out in outputs if out.output_type == "error"]
    assert "all checks passed" in "".join(out.get("text", "") for out in code[-1].outputs)
    assert not re.search(r"/(root|home|tmp|work)/", json.dumps([out for out in outputs if "text" in out])), (
        "an output shows a local path"
    )


def _public_names() -> list[str]:
    tree = ast.parse((ROOT / "hf_rlloss" / "__init__.py").read_text(encoding="utf8"))
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__")
    return [element.value for element in node.value.elts]


def test_api_reference_lists_every_public_name():
    index = (DOCS / "api" / "index.md").read_text(encoding="utf8")
    missing = [name for name in _public_names() if f"[`{name}`][" not in index]
    assert not missing, f"add to docs/api/index.md's table: {missing}"


def _defined_names(path: Path) -> set[str]:
    """Top-level names a module defines or imports (static: nothing is imported)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def _resolves(dotted: str) -> bool:
    """`hf_rlloss.a.b.name` names modules of the package, then (optionally) a name the last module defines."""
    path = ROOT / "hf_rlloss"
    for part in dotted.split(".")[1:]:
        if path.is_dir() and (path / part).is_dir():
            path = path / part
        elif path.is_dir() and (path / f"{part}.py").is_file():
            path = path / f"{part}.py"
        else:  # the first name that is not a module: the module must define it (its attributes are not checked)
            return part in _defined_names(path / "__init__.py" if path.is_dir() else path)
    return True


def test_module_paths_named_in_docs_and_docstrings_exist():
    # After the layout change a stale `hf_rlloss/sequence_parallel.py` or `hf_rlloss.metrics` would still read well.
    texts = [
        ROOT / "README.md",
        ROOT / "benchmarks" / "README.md",
        *DOCS.rglob("*.md"),
        *ROOT.glob("hf_rlloss/**/*.py"),
    ]
    # hf_rlloss.__getattr__ imports them on first use
    lazy = {"RLLossGRPOTrainer", "RLLossGRPOConfig", "RLLossAsyncGRPOTrainer", "RLLossAsyncGRPOConfig"}
    stale = []
    for path in texts:
        text = path.read_text(encoding="utf8")
        for file in re.findall(r"\bhf_rlloss/[\w/]+\.py\b", text):
            if not (ROOT / file).is_file():
                stale.append(f"{path.relative_to(ROOT)}: {file}")
        for dotted in re.findall(r"\bhf_rlloss(?:\.[A-Za-z_]\w*)+", text):
            if dotted.split(".")[1] not in lazy and not _resolves(dotted):
                stale.append(f"{path.relative_to(ROOT)}: {dotted}")
    assert not stale, "names that do not exist in the package:\n" + "\n".join(sorted(set(stale)))


# What a user page must not say: how it was made (agents, sessions, helpers, merges, issues and their numbers) or a
# scratch path of the machine it was written on. The pages speak of the software and its measurements only.
PROCESS_WORDS = re.compile(
    r"\b(?:agents?|sessions?|helpers?|merge[sd]?|merging|issues?(?:'s)?)\b|(?<![\w&/])#\d+\b|/tmp/|/work/",
    flags=re.IGNORECASE,
)


def _user_pages() -> list[Path]:
    return sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md", *DOCS.rglob("*.md")])


def _process_words(text: str) -> list[str]:
    """Each line of `text` that names how the page was made, with its line number (web addresses are not read: a
    link to an upstream project's issue tracker is a reference)."""
    lines = enumerate(text.splitlines(), 1)
    words = [(n, line) for n, line in lines if PROCESS_WORDS.search(re.sub(r"https?://\S+", "", line))]
    return [f"{n}: {line.strip()[:100]}" for n, line in words]


def test_user_pages_speak_of_the_software_only():
    found = {str(p.relative_to(ROOT)): _process_words(p.read_text(encoding="utf8")) for p in _user_pages()}
    found = {page: lines for page, lines in found.items() if lines}
    assert not found, "pages that name how they were made or a scratch path:\n" + json.dumps(found, indent=1)


@pytest.mark.parametrize(
    "line",
    [
        "while six other agents shared it",
        "Re-run on the idle machine after the merge",
        "the issue's arithmetic",
        "as filed in #28",
        "curves: /tmp/asy/demo/out/training_curves.png",
        "No GPU was lent in this session",
        "written by a helper",
    ],
)
def test_the_page_check_catches_process_words(line):
    assert _process_words(f"A table.\n{line}\n") == [f"2: {line}"]


def test_the_page_check_leaves_technical_text_alone():
    text = (
        "The arithmetic `G(P + C_max)`; `hf_rlloss/loss/kl.py`; [#anchors](x.md#kl-2); [TRL](https://x.org/issues/1)."
    )
    assert _process_words(text) == []


def _python_example(page: Path, heading: str) -> str:
    """The first ```python block after `heading` on `page`."""
    text = page.read_text(encoding="utf8")
    return re.search(r"```python\n(.*?)\n```", text[text.index(heading) :], flags=re.S).group(1)


@pytest.mark.slow
def test_the_getting_started_python_example_trains_offline(tmp_path, monkeypatch, capsys):
    """The example a newcomer copies runs as printed, with no network: a tiny model built locally, two steps."""
    code = _python_example(DOCS / "index.md", "## Train from Python, offline")
    assert "make_tiny_model()" in code and "max_steps=2" in code
    monkeypatch.chdir(tmp_path)  # its output_dir is relative
    monkeypatch.setenv("HF_RLLOSS_CACHE", str(tmp_path / "cache"))  # make_tiny_model's folder
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    exec(compile(code, "docs/index.md", "exec"), {"__name__": "__getting_started__"})
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if re.fullmatch(r"step \d: reward -?\d+\.\d\d, loss -?\d+\.\d{4}", line)]
    assert [line.split(":")[0] for line in steps] == ["step 1", "step 2"], lines
    assert (tmp_path / "cache" / "tiny-random-0" / "config.json").is_file()


def test_ci_runs_the_readme_test_command():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf8").splitlines()]
    assert TESTS[0] in ci, f".ci/run must run the README's test command {TESTS[0]!r}"


# How a page was developed ("the fix", "before ... now") or where it was measured in the maintainers' words ("here"):
# the pages describe the software as it is, and the machine of a measurement is in its results file.
HISTORY_WORDS = re.compile(
    r"\b(?:the (?:compile )?fix\b(?! point)|what was wrong|in the previous version"
    r"|the previous version of (?:the|this) (?:code|package|page|trainer|documentation)"
    r"|today'?s?\b|the project's \d-core machine|untested here|(?:measured|run|ran|tested) here\b|on this machine"
    r"|the old (?:code|path|version))",
    flags=re.IGNORECASE,
)


def _history_words(text: str) -> list[str]:
    lines = enumerate(text.splitlines(), 1)
    return [
        f"{n}: {line.strip()[:100]}" for n, line in lines if HISTORY_WORDS.search(re.sub(r"https?://\S+", "", line))
    ]


def test_user_pages_describe_the_software_as_it_is():
    found = {str(p.relative_to(ROOT)): _history_words(p.read_text(encoding="utf8")) for p in _user_pages()}
    found.pop("CHANGELOG.md")  # a dated record of changes by design
    found = {page: lines for page, lines in found.items() if lines}
    assert not found, "pages that speak of their history or of the test machine:\n" + json.dumps(found, indent=1)


@pytest.mark.parametrize(
    "line, flagged",
    [
        ("A second run after the compile fix", True),
        ("## What was wrong", True),
        ("0.87x today's step time", True),
        ("Untested here: the CUDA path", True),
        ("the worker has copied the previous version of the weights", False),
        ("the fix point of the iteration", False),
    ],
)
def test_the_history_check(line, flagged):
    assert bool(_history_words(line)) == flagged
