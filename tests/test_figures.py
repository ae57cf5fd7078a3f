"""One home per figure: every measured number on a user page is rendered from a results file (`benchmarks/figures/`),
and the check that enforces it fails on a stale, unknown or unbacked figure."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.experiments import demo_seeds
from benchmarks.figures import _age, _docstrings, core

ROOT = Path(__file__).resolve().parents[1]

core.load_renderers()


def test_every_page_states_only_figures_its_results_files_hold():
    problems = core.check()
    assert not problems, "run `python -m benchmarks.tools.render_figures`, or fix:\n" + "\n".join(problems)


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


def test_results_without_a_provenance_field_are_named(tmp_path, monkeypatch):
    monkeypatch.setattr(core, "RESULTS", tmp_path)
    (tmp_path / "a.json").write_text('{"meta": {"machine": "m", "date": "2026-12-04"}, "x": 1}')
    assert core.provenance_problems("a.json") == [
        "benchmarks/results/a.json: meta has no command, git_commit, versions, load"
    ]
    command = "python -m benchmarks.experiments.demo_seeds --set vllm_engine=true --out benchmarks/results/a.json"
    meta = {"machine": "m", "date": "d", "command": command, "git_commit": "unknown", "load": "unknown"}
    meta["versions"] = {"torch": "2", "transformers": "5", "trl": "1"}
    (tmp_path / "a.json").write_text(json.dumps({"meta": meta}))
    assert core.provenance_problems("a.json") == ["benchmarks/results/a.json: meta has no versions.vllm"]
    assert core.source_text(meta).startswith(
        "m, d, load not recorded, torch 2, transformers 5, TRL 1, vLLM version not"
    )


def test_a_table_names_the_machine_date_and_command_of_its_sources():
    text, sources = core.render_table("demo_seeds")
    assert sources == ["demo_seeds.json"]
    meta = core.meta_of(core.Results()("demo_seeds.json"))
    last = text.splitlines()[-1]
    assert last.startswith("Source: `results/demo_seeds.json`") and meta["date"] in last and meta["command"] in last


def test_rows_added_to_a_sweep_name_their_own_provenance(tmp_path, monkeypatch):
    monkeypatch.setattr(core, "RESULTS", tmp_path)
    first = {"meta": {"machine": "m1", "date": "2026-12-04", "command": "sweep 0 1", "demo_command": "d"}}
    kept = demo_seeds.added_to(first | {"runs": [{"seed": 0}]}, {"meta": {"demo_command": "d"}}, [1])
    assert kept["runs"] == [{"seed": 0}] and kept["meta"] == first["meta"] and "superseded" not in kept
    with pytest.raises(SystemExit, match="--add: the results file was measured with 'd'"):
        demo_seeds.added_to(first | {"runs": []}, {"meta": {"demo_command": "other"}}, [1])

    later = {"machine": "m2", "date": "2026-12-05", "command": "sweep 1 --add"}
    (tmp_path / "a.json").write_text(json.dumps(kept | {"runs": [{"seed": 0}, {"seed": 1, "meta": later}]}))
    line = core.provenance_line(["a.json"])
    assert line.startswith("Source: `results/a.json`: m1, 2026-12-04, load not recorded") and "`sweep 0 1`" in line
    assert "; its seed 1: m2, 2026-12-05, load not recorded" in line and "`sweep 1 --add`" in line


def test_add_keeps_a_superseded_row_with_its_reason():
    existing = {"meta": {"demo_command": "d"}, "runs": [{"seed": 0, "x": 1}, {"seed": 1, "x": 2}]}
    new = {"meta": {"demo_command": "d", "command": "sweep 1 --add", "date": "2026-12-06"}}
    with pytest.raises(SystemExit, match="seeds \\[1\\] already have rows.*--reason"):
        demo_seeds.added_to(existing, new, [1])
    kept = demo_seeds.added_to(existing, new, [1], reason="the run overlapped another job")
    assert kept["runs"] == [{"seed": 0, "x": 1}]
    assert kept["superseded"] == [
        {"seed": 1, "x": 2, "superseded": {"reason": "the run overlapped another job", "by": "sweep 1 --add",
                                          "date": "2026-12-06"}}
    ]  # fmt: skip


@pytest.mark.parametrize(
    "text, found",
    [
        ("the gap was 2.7e-06 after 3 steps", ["2.7e-06"]),
        ("measured ≤ 1e-8, and at most 4e-9", ["1e-8", "4e-9"]),
        ("parity to 1e-6, within 1e-5, (1e-6), lr 3e-5, of order 1e-10, std + 1e-4", []),
        ("a ratio of 1.1234 and a value of 0.0032", ["1.1234", "0.0032"]),
        ("a 55 KB sample, 1.17x the time, 1.5 times the rate", ["55 KB", "1.17x", "1.5 times"]),
        ("arXiv 2510.11370 and version 0.115.2", []),
    ],
)
def test_the_pattern_covers_e_notation_decimals_kb_x_and_times(text, found):
    assert core.unbacked("docs/x.md", text) == found


def _sources(tmp_path, monkeypatch, name: str) -> dict:
    """A copy of one results file in a scratch results folder, for a test to edit."""
    monkeypatch.setattr(core, "RESULTS", tmp_path)
    (tmp_path / name).write_text((ROOT / "benchmarks" / "results" / name).read_text())
    return json.loads((tmp_path / name).read_text())


def test_an_edited_aggregate_fails_naming_the_figure(tmp_path, monkeypatch):
    data = _sources(tmp_path, monkeypatch, "demo_seeds.json")
    assert core.source_problems("demo_seeds.json") == []
    shown = core.render_figure("demo.heldout_after")[0]
    data["aggregate"]["heldout_after"]["max"] += 0.01
    (tmp_path / "demo_seeds.json").write_text(json.dumps(data))
    problems = [p for p in core.check_sources() if "demo_seeds.json" in p]
    assert any("aggregate heldout_after.max: stored" in p and "figure 'demo.heldout_after'" in p for p in problems)
    # the renderers show the runs' aggregate, never the stored one
    assert core.render_figure("demo.heldout_after")[0] == shown


def test_an_unparseable_command_fails_naming_the_figure(tmp_path, monkeypatch):
    data = _sources(tmp_path, monkeypatch, "demo_seeds.json")
    data["meta"]["command"] = "python -m benchmarks.experiments.demo_seeds --seeds zero"
    (tmp_path / "demo_seeds.json").write_text(json.dumps(data))
    problems = [p for p in core.check_sources() if "demo_seeds.json" in p]
    assert any(
        "does not parse with benchmarks/experiments/demo_seeds.py's parser" in p and "table 'demo_seeds'" in p
        for p in problems
    )
    data["meta"]["command"] = (
        "python -m benchmarks.experiments.demo_seeds --seeds 0 --out benchmarks/results/other.json"
    )
    (tmp_path / "demo_seeds.json").write_text(json.dumps(data))
    assert any("writes benchmarks/results/other.json, not this file" in p for p in core.check_sources())


def test_every_recorded_command_parses_with_its_scripts_parser():
    for name in core.sources():
        meta = core.meta_of(core.Results()(name))
        assert _age.command_problems(name, meta) == [], name


def test_a_changed_measured_module_marks_the_table_and_fails_naming_it(monkeypatch):
    first = subprocess.run(["git", "rev-list", "--max-parents=0", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    old = {"git_commit": first.stdout.split()[0][:10], "measures": ["hf_rlloss"]}
    assert _age.age(old) == (f"measured at `{old['git_commit']}`; the measured code changed since", True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    assert _age.age({"git_commit": head, "measures": ["hf_rlloss"]})[1] is False

    page = "docs/index.md"
    text = (ROOT / page).read_text(encoding="utf8")
    assert "table 'demo_seeds'" not in " ".join(core.check_text(page, text))
    fresh = {"git_commit": head, "git_commit_source": None}
    monkeypatch.setattr(core, "meta_of", lambda data, _meta=core.meta_of: _meta(data) | fresh)
    problems = core.check_text(page, text)
    assert f"{page}: table 'demo_seeds' differs from its results file (source lines)" in problems


def test_refresh_lists_the_stale_files():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.refresh", "--stale", "--dry-run"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert "benchmarks/results/demo_seeds.json: measured at `7e55599`; the measured code changed since" in out.stdout
    assert "    python -m benchmarks.experiments.demo_seeds --seeds 42 0 1 2" in out.stdout


def _with_a_marked_figure(text: str, inside: str) -> tuple[str, str]:
    """`text` with the figure `demo.seeds` marked after `inside`, rendered right and edited."""
    value = core.render_figure("demo.seeds")[0]
    right = f"{inside} <!-- fig:demo.seeds -->{value}<!-- /fig -->"
    return text.replace(inside, right, 1), text.replace(inside, right.replace(f"-->{value}<", f"-->{value}9<"), 1)


@pytest.mark.parametrize("kind", ["page", "table", "docstring", "recipe comment"])
def test_editing_one_figure_of_each_page_kind_fails_the_check(kind):
    if kind == "page":
        page, text, match = _a_marked_figure()
        edited = text[: match.start("body")] + match["body"] + "1" + text[match.end("body") :]
        check = core.check_text
    elif kind == "table":
        page = "docs/index.md"
        text = (ROOT / page).read_text(encoding="utf8")
        body = next(core.TABLE_RE.finditer(text))["body"]
        edited = text.replace(body, body.replace("0.68 ± 0.05", "0.69 ± 0.05", 1), 1)
        check = core.check_text
    elif kind == "docstring":
        page = "hf_rlloss/recipe_support/assets.py"
        text, edited = _with_a_marked_figure((ROOT / page).read_text(encoding="utf8"), "Convert the GGUF")
        check = core.check_docstrings
    else:
        page = "recipes/smollm2_135m/arithmetic/config_demo.yaml"
        source = (ROOT / page).read_text(encoding="utf8")
        comment = next(line for line in source.splitlines() if line.startswith("# "))
        text, edited = _with_a_marked_figure(source, comment)
        check = core.check_text
    assert check(page, text) == []
    assert check(page, edited) != [] and all(page in p for p in check(page, edited))


def test_a_number_in_a_published_docstring_fails_naming_it():
    page = "hf_rlloss/recipe_support/assets.py"
    text = (ROOT / page).read_text(encoding="utf8")
    assert core.check_docstrings(page, text) == []
    edited = text.replace("Convert the GGUF", "Convert (in 20 s) the GGUF", 1)
    assert core.check_docstrings(page, edited) == [
        f"{page} (docstring of prepare_smollm2): '20 s' is stated without a results file"
    ]
    assert Path(ROOT / page) in _docstrings.published_files()


def test_e_notation_in_a_page_fails_naming_it():
    page, text, _ = _a_marked_figure()
    assert core.check_text(page, text + "\nThe largest difference was 2.7e-06.\n") == [
        f"{page}: '2.7e-06' is stated without a results file"
    ]


def test_an_image_no_renderer_draws_is_named():
    page = "docs/agentic.md"
    text = "![a plot](agentic_demo.png) ![another](hand_drawn.png)"
    assert core.images(page, text) == ["docs/agentic_demo.png", "docs/hand_drawn.png"]
    assert "docs/agentic_demo.png" in core.PLOTS
    assert [p for p in core.image_problems(page, text) if "hand_drawn" in p] == [
        f"{page}: image docs/hand_drawn.png is drawn by no renderer (`core.plot`)"
    ]


@pytest.mark.parametrize(
    "name, edit, reader",
    [
        ("packing_idle_1proc.json", lambda d: d["rows"]["long|1"]["off"]["train_s"].update(median=9.0),
         "table 'packing.summary'"),
        ("generation_generate.json", lambda d: d["rows"]["long64"]["generate"]["shared"].update(generate_cpu_s=1.0),
         "table 'generation.generate'"),
        ("loss_step_fp32_49k.json", lambda d: d["rows"][0].update(hf_rlloss_s=4.0), "table 'loss_step'"),
        ("scaling.json", lambda d: d["memory_mb_per_1k_tokens"].update(hf_rlloss=1.0), "table 'scaling'"),
        ("staleness_v2/analysis.json", lambda d: d["primary"]["paired_t"].update(p=0.01),
         "figure 'staleness_v2.primary'"),
    ],
)  # fmt: skip
def test_an_edited_median_or_analysis_fails_and_the_pages_show_the_runs(tmp_path, monkeypatch, name, edit, reader):
    """Every stored aggregate is recomputed from the per-run rows: the repeats' samples, the runs' times, the rows of
    a sweep, the per-seed files of an experiment (copied along for `staleness_v2`)."""
    import shutil

    rendered = {kind: dict.fromkeys(names) for kind, names in (("table", core.TABLES), ("figure", core.FIGURES))}
    for kind, render in (("table", core.render_table), ("figure", core.render_figure)):
        for key in rendered[kind]:
            try:
                rendered[kind][key] = render(key)[0]
            except core.RenderError:
                pass
    monkeypatch.setattr(core, "RESULTS", tmp_path)
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path, dirs_exist_ok=True)
    assert core.source_problems(name) == []
    data = json.loads((tmp_path / name).read_text())
    edit(data)
    (tmp_path / name).write_text(json.dumps(data))
    problems = [p for p in core.check_sources() if f"benchmarks/results/{name}:" in p]
    assert problems and all(reader in p and ": stored " in p for p in problems), problems
    # the pages show what the runs give, never the edited value
    for kind, render in (("table", core.render_table), ("figure", core.render_figure)):
        for key, text in rendered[kind].items():
            if text is not None:
                assert render(key)[0] == text, key


def _demo_step_file(repeats: int) -> dict:
    """A `generation.py --kinds step` results file with `repeats` interleaved repeats (rotating order)."""
    variants = ["trl", "today", "shared"]
    runs = {v: [] for v in variants}
    for repeat in range(repeats):
        order = variants[repeat % 3 :] + variants[: repeat % 3]
        for position, v in enumerate(order):
            base = {"trl": 40.0, "today": 16.0, "shared": 14.0}[v] + repeat
            runs[v].append({
                "step_s": base * 1.5, "step_cpu_s": base, "generation_s": base / 2, "generation_cpu_s": base / 3,
                "peak_mb": 1000.0 + repeat, "reward": [0.0], "repeat": repeat,
                "started_utc": f"10:{repeat:02d}:{position:02d}", "load_average_at_start": [1.0 + repeat, 1.0, 1.0],
            })  # fmt: skip
    meta = core.meta_of(core.Results()("generation_demo_fp32.json")) | {"repeats": repeats}
    return {"meta": meta, "rows": {}, "samples": {"step/demo": runs}}


def test_the_demo_step_table_shows_every_repeat_with_its_load_and_order(tmp_path, monkeypatch):
    import shutil

    three = _demo_step_file(3)
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path, dirs_exist_ok=True)
    monkeypatch.setattr(core, "RESULTS", tmp_path)
    (tmp_path / "generation_demo_fp32.json").write_text(json.dumps(three))
    text = core.render_table("generation.demo_step")[0]
    lines = text.splitlines()
    assert lines[2] == "| step, CPU s (median of 3) | 41.00 | 17.00 | 15.00 | 0.88× | 0.37× |"
    assert lines[3].startswith("| step, wall s (median of 3) | 61.50 | 25.50 | 22.50 |")
    assert lines[6] == (
        "| repeat 1 (order: stock TRL, every row, shared): step CPU s / wall s, load at its start "
        "| 40.00 / 60.00, load 1.0 | 16.00 / 24.00, load 1.0 | 14.00 / 21.00, load 1.0 | 0.88× / 0.88× "
        "| 0.35× / 0.35× |"
    )
    assert lines[7].startswith("| repeat 2 (order: every row, shared, stock TRL): step CPU s / wall s, load at its")
    assert "| 41.00 / 61.50, load 2.0 |" in lines[7]
    assert lines[8].startswith("| repeat 3 (order: shared, stock TRL, every row)") and "load 3.0" in lines[8]
    assert core.render_figure("generation.demo_step_repeats")[0] == (
        "the median of 3 repeats, the variants interleaved in rotating order"
    )
    headline = core.render_table("headline")[0]
    assert "| whole demo step, float32, generation included (CPU time, median of 3 repeats) | 15.00 s | 41.00 s |" in (
        headline
    )


def test_a_sweep_reads_the_runs_json_summary_not_its_line(tmp_path):
    """The recipes write `run_summary.json` beside `metrics.jsonl` (`RunSummaryCallback.write`); a seed sweep keeps
    its numbers unrounded, the same numbers the `run summary:` line rounds."""
    from hf_rlloss.recipe_support.callbacks import RunSummaryCallback

    class State:
        global_step = 0

    summary, state = (
        RunSummaryCallback(k=2, heldout_note="greedy, 8 prompts", series={"turns per episode": "t"}),
        State(),
    )
    logs = [
        (0, {"eval_rewards/accuracy_reward/mean": 0.125}),
        (1, {"step_time": 1.0, "rewards/accuracy_reward/mean": 0.25, "t": 1.0}),
        (2, {"step_time": 2.0, "rewards/accuracy_reward/mean": 0.5, "t": 1.5}),
        (3, {"step_time": 4.0, "rewards/accuracy_reward/mean": 0.875, "t": 2.0}),
        (3, {"eval_rewards/accuracy_reward/mean": 0.625}),
    ]
    for step, log in logs:
        state.global_step = step
        summary.on_log(None, state, None, logs=log)
    summary.values["heldout_untrained"] = 0.0625
    path = summary.write(str(tmp_path / "run_summary.json"), "out")
    row = demo_seeds.outcome(json.loads(Path(path).read_text()))
    assert row == {
        "reward_first": 0.375, "reward_last": 0.6875, "heldout_before": 0.125, "heldout_after": 0.625,
        "step_s": 7 / 3, "turns_first": 1.25, "turns_last": 1.75, "heldout_untrained": 0.0625,
    }  # fmt: skip
    assert summary.summary("out").startswith(
        "run summary: accuracy reward 0.38 (first 2 steps) -> 0.69 (last 2 steps); turns per episode 1.25 (first 2 "
        "steps) -> 1.75 (last 2 steps); held-out accuracy (greedy, 8 prompts) 0.12 (step 0) -> 0.62 (step 3); mean "
        "step time 2.33 s over 3 steps"
    )
    summary.heldout = summary.heldout[1:]  # no evaluation at step 0: a sweep's before/after would be wrong
    with pytest.raises(ValueError, match="no held-out accuracy at step 0"):
        demo_seeds.outcome(summary.record("out"))
