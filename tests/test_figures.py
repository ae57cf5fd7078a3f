"""One home per figure: every measured number on a user page is rendered from a results file (`benchmarks/figures/`),
and the check that enforces it fails on a stale, unknown or unbacked figure."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from figures import core  # noqa: E402

core.load_renderers()


def test_every_page_states_only_figures_its_results_files_hold():
    problems = core.check()
    assert not problems, "run `python benchmarks/render_figures.py`, or fix:\n" + "\n".join(problems)


def _a_marked_figure() -> tuple[str, str, "re.Match"]:  # noqa: F821
    text = (ROOT / "README.md").read_text(encoding="utf8")
    match = next(core.FIG_RE.finditer(text))
    return "README.md", text, match


def test_the_check_fails_when_a_page_figure_is_edited():
    page, text, match = _a_marked_figure()
    assert core.check_text(page, text) == []
    edited = text[: match.start("body")] + match["body"] + "1" + text[match.end("body") :]
    problems = core.check_text(page, edited)
    assert len(problems) == 1 and f"figure {match['name']!r} says" in problems[0], problems


def test_the_check_fails_on_a_table_cell_edited():
    page = "docs/index.md"
    text = (ROOT / page).read_text(encoding="utf8")
    match = next(core.TABLE_RE.finditer(text))
    body = match["body"]
    cell = next(tok for tok in body.split() if tok[:1].isdigit() and "." in tok)
    edited = text[: match.start("body")] + body.replace(cell, cell + "9", 1) + text[match.end("body") :]
    assert any(f"table {match['name']!r} differs" in p for p in core.check_text(page, edited))


def test_the_check_fails_on_an_unbacked_or_unknown_figure():
    page, text, _ = _a_marked_figure()
    assert core.check_text(page, text + "\nThe step took 4.63 s.\n") == [
        f"{page}: '4.63 s' is stated without a results file"
    ]
    unknown = core.check_text(page, text + "\n<!-- fig:no.such.figure -->1<!-- /fig -->\n")
    assert unknown == [f"{page}: unknown figure 'no.such.figure'"]


@pytest.mark.parametrize(
    "text, found",
    [
        ("0.34× the time", ["0.34×"]),
        ("5.8 × faster", ["5.8 ×"]),
        ("about 6 minutes, 52 s", ["6 minutes", "52 s"]),
        ("306 MB and 1,172 MB, 4 GiB", ["306 MB", "1,172 MB", "4 GiB"]),
        ("19 % of tokens", ["19 %"]),
        ("held-out accuracy 0.52 -> 0.64", ["0.52", "0.64"]),
        ("lr 1e-6, 40 steps, G = 8, 2 CPU cores, k3, 1/16", []),
        ("`cliprange_high: 0.28`, `timeout=30 s`", []),
        ("[the page](results_0.52.md) and https://x.org/a/0.33s", []),
        ("<!-- fig:x -->0.52<!-- /fig -->", []),
        ("```bash\nsleep 5s # 0.50\n```", []),
        ("version 1.16.0 and 2.13.0", []),
    ],
)
def test_what_counts_as_a_measurement(text, found):
    assert core.unbacked("docs/x.md", text) == found


def test_yaml_pages_are_read_for_their_comments_only():
    text = "# about 6 minutes\nlearning_rate: 0.25\ncliprange_high: 0.28  # from DAPO\n"
    assert core.unbacked("recipes/x.yaml", text) == ["6 minutes"]


def test_results_without_machine_date_or_command_are_named(tmp_path, monkeypatch):
    monkeypatch.setattr(core, "RESULTS", tmp_path)
    (tmp_path / "a.json").write_text('{"meta": {"machine": "m", "date": "2026-12-04"}, "x": 1}')
    assert core.provenance_problems("a.json") == ["benchmarks/results/a.json: meta has no command"]


def test_a_table_names_the_machine_date_and_command_of_its_sources():
    text, sources = core.render_table("demo_seeds")
    assert sources == ["demo_seeds.json"]
    meta = core.meta_of(core.Results()("demo_seeds.json"))
    last = text.splitlines()[-1]
    assert last.startswith("Source: `results/demo_seeds.json`") and meta["date"] in last and meta["command"] in last


def test_rows_added_to_a_sweep_name_their_own_provenance(tmp_path, monkeypatch):
    import demo_seeds

    monkeypatch.setattr(core, "RESULTS", tmp_path)
    first = {"meta": {"machine": "m1", "date": "2026-12-04", "command": "sweep 0 1", "demo_command": "d"}}
    kept = demo_seeds.added_to(first | {"runs": [{"seed": 0}, {"seed": 1}]}, {"meta": {"demo_command": "d"}}, [1])
    assert kept["runs"] == [{"seed": 0}] and kept["meta"] == first["meta"]
    with pytest.raises(SystemExit, match="--add: the results file was measured with 'd'"):
        demo_seeds.added_to(first | {"runs": []}, {"meta": {"demo_command": "other"}}, [1])

    later = {"machine": "m2", "date": "2026-12-05", "command": "sweep 1 --add"}
    (tmp_path / "a.json").write_text(json.dumps(kept | {"runs": [{"seed": 0}, {"seed": 1, "meta": later}]}))
    line = core.provenance_line(["a.json"])
    assert line == (
        "Source: `results/a.json`: m1, 2026-12-04, `sweep 0 1`; its seed 1: m2, 2026-12-05, `sweep 1 --add`."
    )
