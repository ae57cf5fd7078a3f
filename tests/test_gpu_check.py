"""`make gpu-check` (`scripts/gpu_check.py`) without a GPU: the plan it would run, each step's command parsed by that
step's own argument parser; what it says and writes without CUDA; the results file of a step with its provenance.
Also what the GPU user is told: the demo's GPU config, the CPU-run notice, and quantized loading refused by name."""

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


gpu_check = _load("gpu_check", ROOT / "scripts" / "gpu_check.py")
colocate = _load("gpu_vllm_colocate", ROOT / "scripts" / "gpu_vllm_colocate.py")


def test_the_plan_is_parsed_by_each_steps_own_parser():
    steps = {step.name: step for step in gpu_check.plan()}
    assert list(steps) == [
        "cuda_tests", "loss_step_h1536", "loss_step_h3584", "gpu_step", "engines_cuda", "vllm_colocate_cuda"
    ]  # fmt: skip
    parsed = {name: gpu_check.parse_with_own_parser(step) for name, step in steps.items()}
    assert parsed["cuda_tests"].markexpr == "gpu" and parsed["cuda_tests"].file_or_dir == ["tests/test_gpu.py"]
    assert parsed["cuda_tests"].xmlpath.endswith("cuda_tests.xml")
    assert steps["cuda_tests"].env == {"HF_RLLOSS_GPU_CHECK_DEVICE": "cuda"}
    for hidden in (1536, 3584):
        loss = parsed[f"loss_step_h{hidden}"]
        assert (loss.device, loss.dtype, loss.tokens, loss.vocab, loss.hidden) == ("cuda", "bf16", [16384], [151936],
                                                                                  hidden)  # fmt: skip
        assert loss.methods == ["hf_rlloss", "trl_chunked", "gemm_floor"] and loss.repeats == 3
    step = parsed["gpu_step"]
    assert (step.device, step.model, step.length, step.steps, step.repeats) == ("cuda", "qwen2_0.5b_random", 512, 6, 3)
    assert parsed["engines_cuda"].device == "cuda" and parsed["engines_cuda"].engines == ["zero3", "fsdp2"]
    colocate_args = parsed["vllm_colocate_cuda"]
    assert colocate_args.trainers == ["hf_rlloss", "trl"] and colocate_args.device == "cuda"
    assert gpu_check.BUDGET_S == sum(step.timeout_s for step in steps.values()) <= 600  # within 10 minutes


def test_the_rehearsal_plan_runs_the_same_programs_at_tiny_sizes():
    cuda, cpu = gpu_check.plan(device="cuda"), gpu_check.plan(device="cpu")
    assert [s.name for s in cuda] == [s.name for s in cpu] and [s.parser for s in cuda] == [s.parser for s in cpu]
    for step in cpu:
        parsed = gpu_check.parse_with_own_parser(step)
        assert getattr(parsed, "device", "cpu") == "cpu"
    assert next(s for s in cpu if s.name == "cuda_tests").env == {"HF_RLLOSS_GPU_CHECK_DEVICE": "cpu"}


@pytest.mark.parametrize("step_name, bad", [("loss_step_h1536", "--dtype-x"), ("cuda_tests", "--junitxmll")])
def test_a_command_its_parser_refuses_fails_the_dry_run(step_name, bad):
    step = next(s for s in gpu_check.plan() if s.name == step_name)
    argv = tuple(bad if a in ("--dtype", "--junitxml") else a for a in step.argv)
    with pytest.raises((SystemExit, pytest.UsageError)):
        gpu_check.parse_with_own_parser(gpu_check.Step(**{**step.__dict__, "argv": argv}))


def test_the_gpu_demo_config_is_the_demo_on_the_gpu():
    demo = yaml.safe_load((ROOT / "recipes/smollm2_135m/arithmetic/config_demo.yaml").read_text())
    gpu = yaml.safe_load((ROOT / gpu_check.DEMO_GPU_CONFIG).read_text())
    assert (demo.pop("use_cpu"), gpu.pop("use_cpu")) == (True, False)
    assert gpu.pop("output_dir") != demo.pop("output_dir")
    assert gpu == demo  # every other key equal: one step of it measures the demo's settings
    script_args, training_args, _ = gpu_check.parse_demo_config(cuda=torch.cuda.is_available())
    assert training_args.use_cpu is False and script_args.dataset_name == "builtin:arithmetic"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_cuda_it_says_so_prints_the_plan_and_exits_0(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(gpu_check, "nvidia_smi_gpus", lambda: [])
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert "[gpu-check] no CUDA device (torch" in out and "nothing to run, nothing written" in out
    assert all(f"{i}. {s.name}:" in out for i, s in enumerate(gpu_check.plan(), 1))
    assert not (tmp_path / "results").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the torch-blind path")
def test_a_gpu_that_nvidia_smi_lists_and_torch_cannot_use_fails_the_check(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(gpu_check, "nvidia_smi_gpus", lambda: ["0, NVIDIA H100 80GB HBM3"])
    assert gpu_check.main([]) == 2
    out = capsys.readouterr().out
    assert "FAILED: nvidia-smi lists 1 GPU(s) (0, NVIDIA H100 80GB HBM3) but torch" in out
    assert "cannot use them" in out and not (tmp_path / "results").exists()


def test_one_gpu_is_pinned():
    assert gpu_check.pinned_gpu({}) == "0"
    assert gpu_check.pinned_gpu({"CUDA_VISIBLE_DEVICES": "3,5"}) == "3"
    assert gpu_check.pinned_gpu({"CUDA_VISIBLE_DEVICES": "GPU-1a2b"}) == "GPU-1a2b"


def test_a_step_past_its_time_is_killed_with_every_process_it_started(monkeypatch, tmp_path):
    """The step starts a grandchild in a session of its own (as torchrun starts its workers) and hangs: at the
    deadline both are killed, and the step is recorded as timed out."""
    import psutil

    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "results")
    pids = tmp_path / "pids"
    code = (
        "import os, subprocess, sys, time; "
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True); "
        f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{g.pid}}'); time.sleep(300)"
    )
    step = gpu_check.Step("hang", "hangs", ("python", "-c", code), "n/a", "none.json", 4)
    start = time.monotonic()
    line = gpu_check.run_step(step, sys.executable, sys.executable, 100, {}, tmp_path)
    assert time.monotonic() - start < 30
    written = json.loads((tmp_path / "results" / "hang.json").read_text())
    assert line["status"] == "failed" and written["returncode"] == "timeout"
    child, grandchild = map(int, pids.read_text().split())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in (child, grandchild)):
        time.sleep(0.1)
    alive = [p for p in (child, grandchild) if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive, f"left running: {alive}"


def test_a_failed_step_never_reports_an_earlier_runs_output(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "results")
    (tmp_path / "old.json").write_text(json.dumps({"rows": ["from an earlier run"]}))
    step = gpu_check.Step("stale", "fails", ("python", "-c", "raise SystemExit(3)"), "n/a", "old.json", 60)
    gpu_check.run_step(step, sys.executable, sys.executable, 100, {}, tmp_path)
    written = json.loads((tmp_path / "results" / "stale.json").read_text())
    assert written["status"] == "failed" and written["result"] is None


@pytest.mark.slow  # every step's program at tiny sizes on the CPU: the pytest run, the loss steps, the trainers
def test_the_cpu_rehearsal_runs_every_step_end_to_end(tmp_path):
    """`--device cpu`: each step's real program runs, writes its output and passes; the vLLM step runs where vLLM is
    installed (tests/test_vllm.py rehearses it in the vLLM environment) and says why it is skipped elsewhere."""
    results = tmp_path / "results"
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--device", "cpu", "--results", str(results),
           "--work", str(tmp_path / "work")]  # fmt: skip
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((results / "summary.json").read_text())
    status = {line["step"]: line["status"] for line in summary["steps"]}
    expected = {s.name: "passed" for s in gpu_check.plan(device="cpu")}
    if not gpu_check.vllm_importable(sys.executable):
        expected["vllm_colocate_cuda"] = "skipped"
    assert status == expected, proc.stdout[-3000:]
    tests = json.loads((results / "cuda_tests.json").read_text())["result"]
    assert tests["counts"]["passed"] >= 6 and tests["counts"]["failed"] == tests["counts"]["error"] == 0
    for name in ("loss_step_h1536", "loss_step_h3584"):
        rows = json.loads((results / f"{name}.json").read_text())["result"]["rows"]
        assert {"hf_rlloss_s", "trl_chunked_s", "gemm_floor_s"} <= set(rows[0]), rows
    engines = json.loads((results / "engines_cuda.json").read_text())["result"]
    assert engines["problems"] == [] and engines["results"]["zero3"]["engine"]["zero_stage"] == 3
    assert engines["results"]["fsdp2"]["engine"]["dtensor_params"]
    step = json.loads((results / "gpu_step.json").read_text())["result"]
    assert set(step["rows"]) == {"trl", "hf_rlloss", "hf_rlloss_shared_prefix"}
    assert step["rows"]["hf_rlloss"]["packing"] == "shared_prefix"  # auto on the CPU
    assert all(len(run["step_times_s"]) == 2 for runs in step["runs"].values() for run in runs)


def test_a_step_writes_its_results_file_with_provenance(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "results")
    raw = tmp_path / "raw.json"
    code = f"import json; json.dump({{'rows': [1.5]}}, open({str(raw)!r}, 'w'))"
    step = gpu_check.Step("fake", "a fake step", ("python", "-c", code), "n/a", raw.name, 60)
    meta = gpu_check.provenance("python scripts/gpu_check.py --only fake", sys.executable)
    line = gpu_check.run_step(step, sys.executable, sys.executable, 100, meta, tmp_path)
    assert line == {"step": "fake", "status": "passed", "file": str(tmp_path / "results" / "fake.json")}
    written = json.loads((tmp_path / "results" / "fake.json").read_text())
    assert written["result"] == {"rows": [1.5]} and written["returncode"] == 0 and written["wall_s"] >= 0
    assert written["command"].startswith("python -c ")
    m = written["meta"]
    assert len(m["git_commit"]) == 40 and isinstance(m["git_tree_changed"], bool)
    assert m["versions"]["torch"] == torch.__version__
    assert {"transformers", "trl", "accelerate", "vllm"} <= set(m["versions"])
    assert {"torch_cuda", "cuda_available", "nvidia_smi"} <= set(m["gpu"]) and m["machine"]["cores"] >= 1
    assert m["command"] == "python scripts/gpu_check.py --only fake" and m["date_utc"]
    assert written["load_average_before"] is not None


def test_a_failing_step_is_recorded_failed_with_its_log(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "results")
    step = gpu_check.Step("boom", "fails", ("python", "-c", "raise SystemExit('broken on purpose')"), "n/a", "x", 60)
    line = gpu_check.run_step(step, sys.executable, sys.executable, 100, {}, tmp_path)
    written = json.loads((tmp_path / "results" / "boom.json").read_text())
    assert line["status"] == written["status"] == "failed" and "broken on purpose" in written["log_tail"]


def test_the_vllm_step_without_vllm_is_skipped_saying_why(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(gpu_check, "vllm_importable", lambda python: False)
    step = next(s for s in gpu_check.plan() if s.needs_vllm)
    line = gpu_check.run_step(step, sys.executable, "/envs/vllm/bin/python", 100, {}, tmp_path)
    written = json.loads((tmp_path / "results" / f"{step.name}.json").read_text())
    assert line["status"] == "skipped" and "/envs/vllm/bin/python cannot import vllm" in written["reason"]


def test_the_junit_summary_counts_each_outcome(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="t" name="a" time="1.5"/>'
        '<testcase classname="t" name="b" time="0"><skipped message="needs kernels"/></testcase>'
        '<testcase classname="t" name="c" time="2"><failure message="1e-3 &gt; 1e-5"/></testcase>'
        "</testsuite></testsuites>"
    )
    summary = gpu_check.junit_summary(xml)
    assert summary["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert summary["tests"][1] == {"test": "t::b", "outcome": "skipped", "seconds": 0.0, "message": "needs kernels"}


def test_the_vllm_colocate_check_finds_missing_steps_and_the_ratio():
    good = {"steps": [{"loss": 0.1}] * 3, "step_s": 1.5}
    assert colocate.check({"hf_rlloss": good, "trl": {**good, "step_s": 1.0}}, 3) == []
    assert colocate.ratio({"hf_rlloss": good, "trl": {**good, "step_s": 1.0}}) == 1.5
    problems = colocate.check({"hf_rlloss": {"steps": [{"loss": float("nan")}]}, "trl": {"returncode": 1}}, 3)
    assert problems == [
        "hf_rlloss: 1 logged steps, expected 3",
        "hf_rlloss: a non-finite loss",
        "trl: 0 logged steps, expected 3",
    ]
    assert colocate.ratio({"hf_rlloss": good, "trl": {"returncode": 1}}) is None


def test_the_vllm_colocate_trainers_get_the_same_settings(tmp_path):
    from trl import GRPOConfig

    from hf_rlloss import RLLossGRPOConfig

    ours, trl = (colocate._arguments(t, 3, str(tmp_path), 0.3) for t in ("hf_rlloss", "trl"))
    assert ours == trl and ours["use_vllm"] and ours["vllm_mode"] == "colocate" and not ours["use_cpu"]
    cpu = colocate._arguments("hf_rlloss", 3, str(tmp_path), 0.3, device="cpu")
    assert cpu["use_cpu"] and not cpu["bf16"]
    config = RLLossGRPOConfig(**cpu)
    assert GRPOConfig(**cpu).loss_type == config.loss_type == "dapo" and not config.vllm_importance_sampling_correction


# ------------------------------------------------------------------------------------------------------------------
# What the GPU user is told


def test_the_recipe_says_it_trains_on_the_cpu_when_a_gpu_is_there():
    grpo = _load("grpo_recipe", ROOT / "recipes" / "grpo.py")
    notice = grpo.cpu_run_notice(use_cpu=True, cuda_available=True)
    assert "trains on the CPU (use_cpu: true) although a CUDA GPU is available" in notice
    assert "--use_cpu false" in notice and "config_demo_gpu.yaml" in notice
    assert grpo.cpu_run_notice(use_cpu=True, cuda_available=False) is None
    assert grpo.cpu_run_notice(use_cpu=False, cuda_available=True) is None


@pytest.mark.parametrize("key", ["load_in_4bit", "load_in_8bit"])
def test_quantized_loading_is_refused_by_name(key, tmp_path):
    from hf_rlloss import RLLossGRPOConfig
    from hf_rlloss.trainer import RLLossAsyncGRPOConfig

    for cls in (RLLossGRPOConfig, RLLossAsyncGRPOConfig):
        with pytest.raises(ValueError, match=rf"model_init_kwargs\['{key}'\]=True is not supported"):
            cls(output_dir=str(tmp_path), use_cpu=True, bf16=False, model_init_kwargs={key: True})
    grpo = _load("grpo_recipe", ROOT / "recipes" / "grpo.py")
    config = str(ROOT / "recipes/tiny/arithmetic/config_smoke.yaml")
    with pytest.raises(ValueError, match=rf"{key}: quantized loading is not supported by this recipe"):
        grpo.parse_args(["--config", config, f"--{key}", "true"])


def test_argparse_is_left_as_it_was():
    assert argparse.ArgumentParser.parse_known_args.__qualname__ == "ArgumentParser.parse_known_args"
