"""The recipe: every YAML is valid, bad input fails before any model is loaded, and the smoke config runs end to end
under `accelerate launch` with 2 processes."""

import json
import os
import re
import sys
from dataclasses import fields
from pathlib import Path

import _launch
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import grpo  # noqa: E402

from hf_rlloss import GRPOLossConfig  # noqa: E402

RECIPES = sorted((ROOT / "recipes").rglob("config_*.yaml"))


def _valid_keys(path: Path) -> set[str]:
    """The fields of the dataclasses the YAML's recipe parses: `grpo_async.py` for `config_async*`, else `grpo.py`."""
    if path.name.startswith("config_async"):
        import grpo_async

        types = (grpo_async.AsyncScriptArguments, grpo_async.RLLossAsyncGRPOConfig, grpo_async.AsyncModelArguments)
    else:
        types = (grpo.GRPOScriptArguments, grpo.RLLossGRPOConfig, grpo.ModelConfig)
    return {f.name for t in types for f in fields(t)}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "recipes")))
def test_every_recipe_yaml_is_valid(path):
    config = yaml.safe_load(path.read_text())
    unknown = set(config) - _valid_keys(path) - {"env"}
    assert not unknown, f"{path}: unknown keys {unknown}"
    GRPOLossConfig(**config.get("rl_loss", {}))
    assert path.read_text().startswith("#"), "each recipe starts with a comment saying what it is for"


@pytest.fixture
def no_model_loading(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(grpo, "resolve_model", fail)


SMOKE = str(ROOT / "recipes/tiny/arithmetic/config_smoke.yaml")


def test_unknown_yaml_key_names_it_and_lists_valid_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(SMOKE).read_text() + "\nlearning_rat: 1.0e-5\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['learning_rat'\].*learning_rate.*valid keys: .*beta"):
        grpo.parse_args(["--config", str(bad)])


def test_unknown_cli_flag_is_rejected():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['max_stepz'\]"):
        grpo.parse_args(["--config", SMOKE, "--max_stepz", "3"])


def test_unknown_reward_fails_before_the_model(no_model_loading, tmp_path):
    script_args, training_args, model_args = grpo.parse_args(
        ["--config", SMOKE, "--output_dir", str(tmp_path), "--reward_funcs", "accuracy", "lenght"]
    )
    with pytest.raises(
        ValueError, match=r"unknown reward function\(s\) \['lenght'\]; valid: \['accuracy', 'format'\]"
    ):
        grpo.main(script_args, training_args, model_args)


def test_missing_dataset_column_fails_before_the_model(no_model_loading, tmp_path, monkeypatch):
    import datasets

    fake = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"problem": "1+1", "solution": "2"}])})
    monkeypatch.setattr(grpo.datasets, "load_dataset", lambda *a, **k: fake)
    script_args, training_args, model_args = grpo.parse_args(
        ["--config", SMOKE, "--output_dir", str(tmp_path), "--dataset_name", "my/dataset"]
    )
    with pytest.raises(ValueError, match=r"no column\(s\) \['question', 'answer'\]; its columns: \['problem', 'solu"):
        grpo.main(script_args, training_args, model_args)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("config", ["config_smoke.yaml", "config_smoke_sp.yaml"], ids=["ddp", "sp2"])
def test_smoke_recipe_with_two_processes(tmp_path, config):
    out = tmp_path / "out"
    cmd = _launch.accelerate_launch(
        ROOT / "accelerate_configs/multi_process_cpu.yaml",
        ROOT / "recipes/grpo.py",
        *["--config", str(ROOT / "recipes/tiny/arithmetic" / config), "--output_dir", str(out)],
    )
    result = _launch.run(cmd, timeout=480, cwd=ROOT, env={"HF_RLLOSS_CACHE": str(tmp_path / "cache")}, stdout=True)
    assert result.returncode == 0, result.stderr[-4000:]
    for name in ("model.safetensors", "config.json", "tokenizer.json", "README.md", "metrics.jsonl"):
        assert (out / name).exists(), name
    assert (out / "training_curves.png").stat().st_size > 10_000
    assert "hf-rlloss" in (out / "README.md").read_text()
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [log for log in logs if "loss" in log]
    assert len(steps) == 2
    for key in ("reward", "train_policy/ref_kl", "mismatch/mismatch_kl", "rollout_is/mean", "train_policy/entropy"):
        assert all(key in log for log in steps), key
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    # held-out accuracy (greedy) at the start and the end, in the metrics and the summary line
    heldout = [log["step"] for log in logs if "eval_rewards/accuracy_reward/mean" in log]
    assert heldout == [0, 2], heldout
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("run summary:")]
    assert re.search(r"held-out accuracy \(greedy, 8 prompts\) \d\.\d\d \(step 0\) -> \d\.\d\d \(step 2\)", line), line
    record = json.loads((out / "run_summary.json").read_text())  # the same numbers, for programs
    assert [e[0] for e in record["heldout"]["evaluations"]] == [0, 2] and record["step_time"]["steps"] == 2
    assert f"{record['heldout']['first']:.2f} (step 0) -> {record['heldout']['last']:.2f} (step 2)" in line


@pytest.mark.parametrize("fast_bf16", [True, False])
@pytest.mark.parametrize("fallback", [True, False])
def test_bf16_falls_back_to_float32_only_on_a_cpu_without_fast_bf16(monkeypatch, capsys, fast_bf16, fallback):
    from hf_rlloss.recipe_support import cpu_precision

    monkeypatch.setattr(cpu_precision, "cpu_has_fast_bf16", lambda: fast_bf16)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)  # restored after the test
    demo = str(ROOT / "recipes/smollm2_135m/arithmetic/config_demo.yaml")
    flags = ["--config", demo, "--bf16", "true", "--cpu_bf16_fallback", str(fallback).lower()]
    script_args, training_args, _ = grpo.parse_args(flags)
    falls_back = fallback and not fast_bf16
    assert training_args.bf16 is not falls_back
    assert training_args.use_cpu
    said = capsys.readouterr().err
    assert ("training in float32 instead" in said) is falls_back, said
    if falls_back:
        assert training_args.mixed_precision == "no"
        assert os.environ["ACCELERATE_MIXED_PRECISION"] == "no"


@pytest.mark.slow
def test_async_demo_recipe_reports_greedy_heldout_accuracy_before_and_after(tmp_path):
    """The asynchronous demo's recipe (no tools), shrunk to a tiny model: its run summary has the held-out accuracy at
    step 0 and at the end, greedy as the synchronous recipe's, and `heldout.json` has every item's result."""
    out = tmp_path / "out"
    tiny = ["--model_name_or_path", "builtin:tiny-random", "--max_steps", "2", "--heldout_size", "4",
            "--dataset_size", "32", "--per_device_train_batch_size", "4", "--num_generations", "2",
            "--max_completion_length", "8", "--bf16", "false", "--queue_maxsize", "4"]  # fmt: skip
    cmd = _launch.accelerate_launch(
        ROOT / "accelerate_configs/single_process.yaml",
        ROOT / "recipes/grpo_async.py",
        *["--config", str(ROOT / "recipes/smollm2_135m/arithmetic/config_async.yaml"), "--output_dir", str(out)],
        *tiny,
    )
    result = _launch.run(cmd, timeout=480, cwd=ROOT, env={"HF_RLLOSS_CACHE": str(tmp_path / "cache")}, stdout=True)
    assert result.returncode == 0, result.stderr[-6000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("run summary:")]
    assert re.search(r"held-out accuracy \(greedy, 4 prompts\) \d\.\d\d \(step 0\) -> \d\.\d\d \(step 2\)", line), line
    record = json.loads((out / "run_summary.json").read_text())
    assert [e[0] for e in record["heldout"]["evaluations"]] == [0, 2]
    heldout = json.loads((out / "heldout.json").read_text())
    assert sorted(heldout) == ["step_0", "step_2"]
    for evaluation in heldout.values():
        assert len(evaluation["items"]) == 4 and len(evaluation["greedy"]["correct"]) == 4
        assert evaluation["accuracy"] == evaluation["greedy"]["accuracy"]
        assert evaluation["greedy"]["turns_mean"] == 1 and evaluation["greedy"]["tool_calls_mean"] == 0
