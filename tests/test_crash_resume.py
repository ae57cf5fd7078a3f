"""Crash safety: a checkpoint is complete or does not exist, a bad one is skipped or named, never loaded silently,
and a run killed (SIGKILL) during a step or during a save, started again, equals an uninterrupted run."""

import functools
import json
import logging
import os

import _launch
import crash_resume_script
import pytest
import torch
from _full_matrix import full_matrix as full_matrix_mark
from safetensors.torch import save_file

from hf_rlloss.trainer.common.transformers_compat import transformers_at_least
from hf_rlloss.trainer.sync.checkpoints import (
    MANIFEST_NAME,
    CheckpointError,
    checkpoint_problem,
    latest_complete_checkpoint,
    resolve_resume,
    write_manifest,
)

# --------------------------------------------------------------------------------------------------------------------
# The checks, on checkpoint folders written by hand in Trainer's layout (2 ranks)


def _fake_checkpoint(run_dir, step, world_size=2, manifest=True):
    folder = run_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, str(folder / "model.safetensors"))
    torch.save({"state": {0: torch.ones(64)}}, folder / "optimizer.pt")
    torch.save({"last_epoch": step}, folder / "scheduler.pt")
    for rank in range(world_size):
        torch.save({"cpu": torch.random.get_rng_state()}, folder / f"rng_state_{rank}.pth")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": [{"loss": 1.0}]}))
    if manifest:
        rng = [f"rng_state_{rank}.pth" for rank in range(world_size)]
        write_manifest(str(folder), global_step=step, world_size=world_size, rng_files=rng)
    return folder


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


FILES = ["model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state_1.pth", "trainer_state.json"]


def test_a_complete_checkpoint_is_recognised_and_the_manifest_lists_every_file(tmp_path):
    folder = _fake_checkpoint(tmp_path, 3)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert sorted(manifest["files"]) == sorted(FILES + ["rng_state_0.pth"])
    assert manifest["files"]["optimizer.pt"] == (folder / "optimizer.pt").stat().st_size
    assert checkpoint_problem(str(folder), world_size=2) is None
    assert resolve_resume(True, str(tmp_path), 2) == str(folder)


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_bad_file_is_skipped_with_a_warning_or_named_when_asked_for(tmp_path, caplog, name, damage):
    good = _fake_checkpoint(tmp_path, 2)
    bad = _fake_checkpoint(tmp_path, 4)
    if damage == "truncated":
        _truncate(bad / name)
    else:
        (bad / name).unlink()
    with caplog.at_level(logging.WARNING):
        assert latest_complete_checkpoint(str(tmp_path), 2) == str(good)  # falls back to the previous one
        assert resolve_resume(True, str(tmp_path), 2) == str(good)
    assert f"skipping checkpoint {bad}: {name}" in caplog.text
    with pytest.raises(
        CheckpointError, match=f"cannot resume from checkpoint {bad}: {name} (is missing|has \\d+ bytes)"
    ):
        resolve_resume(str(bad), str(tmp_path), 2)


def test_a_file_rewritten_at_its_size_but_unreadable_is_named(tmp_path):
    folder = _fake_checkpoint(tmp_path, 2)
    path = folder / "optimizer.pt"
    path.write_bytes(b"\0" * path.stat().st_size)
    assert (
        checkpoint_problem(str(folder))
        == "optimizer.pt is unreadable (not a readable torch archive (no intact zip directory))"
    )


def test_a_checkpoint_without_manifest_is_skipped_automatically_and_checked_when_named(tmp_path, caplog):
    good = _fake_checkpoint(tmp_path, 2)
    partial = _fake_checkpoint(tmp_path, 4, manifest=False)  # a save killed before the manifest
    with caplog.at_level(logging.WARNING):
        assert resolve_resume(True, str(tmp_path), 2) == str(good)
    assert f"skipping checkpoint {partial}: no {MANIFEST_NAME}: its save did not finish" in caplog.text
    assert resolve_resume(str(partial), str(tmp_path), 2) == str(partial)  # named: loaded, with a warning
    _truncate(partial / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"{partial}: model.safetensors is unreadable"):
        resolve_resume(str(partial), str(tmp_path), 2)


def test_no_complete_checkpoint_is_an_error_listing_the_skipped_ones(tmp_path):
    _fake_checkpoint(tmp_path, 2, manifest=False)
    with pytest.raises(ValueError, match=r"every one is incomplete or unreadable \(checkpoint-2; see the warnings\)"):
        resolve_resume(True, str(tmp_path), 2)


def test_an_rng_file_the_saving_process_cannot_see_is_recorded_and_warned_about(tmp_path, caplog):
    folder = _fake_checkpoint(tmp_path, 2, manifest=False)
    (folder / "rng_state_1.pth").unlink()  # e.g. written on another node's disk, without a shared filesystem
    with caplog.at_level(logging.WARNING):
        write_manifest(str(folder), global_step=2, world_size=2, rng_files=["rng_state_0.pth", "rng_state_1.pth"])
        assert checkpoint_problem(str(folder), world_size=2) is None
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["rng_files"] == ["rng_state_0.pth"] and manifest["unseen_rng_files"] == ["rng_state_1.pth"]
    assert "rng_state_1.pth not visible from the saving process" in caplog.text
    assert "rng_state_1.pth were not visible when it was saved" in caplog.text


def test_the_manifest_is_refused_without_the_trainer_state(tmp_path):
    folder = _fake_checkpoint(tmp_path, 2, manifest=False)
    (folder / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError, match="trainer_state.json missing after every rank finished its save"):
        write_manifest(str(folder), global_step=2, world_size=2, rng_files=["rng_state_0.pth", "rng_state_1.pth"])
    assert not (folder / MANIFEST_NAME).exists()


# --------------------------------------------------------------------------------------------------------------------
# Killed runs, started again (forked ranks over gloo, no launcher: a rank whose peer died must leave by itself)

_NOT_COMPARED = ("time", "runtime", "per_second")


def _assert_same_run(reference, resumed):
    assert [log["step"] for log in resumed["logs"]] == [log["step"] for log in reference["logs"]] == [1, 2, 3, 4]
    for ref, got in zip(reference["logs"], resumed["logs"]):
        keys = [k for k, v in ref.items() if isinstance(v, float) and not any(s in k for s in _NOT_COMPARED)]
        for key in ("loss", "reward", "completions/mean_length", "grad_norm", "train_policy/ref_kl"):
            assert key in keys, key
        for key in keys:
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-12), (ref["step"], key)
    for name, value in reference["params"].items():
        torch.testing.assert_close(resumed["params"][name], value, atol=1e-6, rtol=0)


def _dies(result, killed_rank, message=None):
    """The killed rank died by SIGKILL; every other rank left non-zero by itself within 20 s of it."""
    assert result["codes"][killed_rank] == -9, result["logs"][killed_rank][-3000:]
    for rank, code in enumerate(result["codes"]):
        if rank != killed_rank:
            assert code not in (0, None), result["logs"][rank][-3000:]
            assert result["seconds"][rank] - result["seconds"][killed_rank] < 20
            if message:
                assert message in result["logs"][rank], result["logs"][rank][-3000:]


full_matrix = full_matrix_mark("the full engine matrix")


@pytest.mark.slow
@pytest.mark.parametrize(
    "world_size,sp_size",
    [
        (1, 1),
        pytest.param(2, 1, marks=pytest.mark.distributed),
        pytest.param(2, 2, marks=[full_matrix, pytest.mark.distributed]),
    ],
    ids=["1proc", "2proc", "2proc-sp2"],
)
def test_killed_during_a_save_and_during_a_step_the_restarted_run_equals_an_uninterrupted_one(
    tmp_path, world_size, sp_size
):
    if world_size > 1 and not transformers_at_least("5.18"):
        pytest.skip("transformers < 5.18 loads a multi-process CPU run's optimizer to 'cpu:N', which torch cannot "
                    "restore (its Trainer maps to plain 'cpu' from 5.18)")  # fmt: skip
    launch = functools.partial(crash_resume_script.launch, world_size=world_size, sp_size=sp_size)
    reference = launch(str(tmp_path / "reference"))
    assert reference["codes"] == [0] * world_size, reference["logs"][0][-3000:]

    out = tmp_path / "killed"
    last = world_size - 1  # the rank killed: a peer of rank 0 when there are two
    # 1. killed in the save of step 2, after its weights and optimizer state, before its RNG state
    killed = launch(str(out), fault=f"save:2:{last}")
    _dies(killed, last, "Ranks 1 failed to pass monitoredBarrier" if world_size == 2 else None)
    assert (out / "checkpoint-1" / MANIFEST_NAME).is_file() and not (out / "checkpoint-2" / MANIFEST_NAME).exists()
    # 2. started again: resumes from checkpoint-1 (skipping the partial checkpoint-2), killed during step 3
    killed = launch(str(out), kill_step=3, kill_rank=last)
    _dies(killed, last, "a peer process died or hung during training: rank 1" if world_size == 2 else None)
    assert f"skipping checkpoint {out / 'checkpoint-2'}: no {MANIFEST_NAME}" in killed["logs"][0]
    assert (out / "checkpoint-2" / MANIFEST_NAME).is_file() and not (out / "checkpoint-3").exists()
    # 3. started again: resumes from checkpoint-2 and finishes
    final = launch(str(out))
    assert final["codes"] == [0] * world_size, final["logs"][0][-3000:]
    load = lambda run: torch.load(tmp_path / run / "result.pt", weights_only=False)  # noqa: E731
    _assert_same_run(load("reference"), load("killed"))
    assert sorted(os.listdir(out / "checkpoint-4")) == sorted(os.listdir(tmp_path / "reference" / "checkpoint-4"))


# --------------------------------------------------------------------------------------------------------------------
# The same under DeepSpeed ZeRO-3 and FSDP2 (accelerate launch, 2 processes; the launcher stops the survivor)


def _accelerate(tmp_path, engine, out, *args, env=None):
    config = _launch.cpu_accelerate_config(engine, tmp_path)
    extra = ["--cpu-fsdp"] if engine == "fsdp2" else []
    cmd = _launch.accelerate_launch(config, _launch.ROOT / "tests/crash_resume_script.py", str(out), *extra, *args)
    return _launch.run(cmd, timeout=600, cwd=tmp_path, env=env)


@full_matrix
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_killed_runs_under_sharded_engines_restart_equal_to_an_uninterrupted_one(tmp_path, engine):
    reference = _accelerate(tmp_path, engine, tmp_path / "reference")
    assert reference.returncode == 0, reference.stderr[-4000:]
    out = tmp_path / "killed"
    killed = _accelerate(tmp_path, engine, out, env={"HF_RLLOSS_TEST_FAULT": "save:2:1"})
    assert killed.returncode != 0
    assert (out / "checkpoint-1" / MANIFEST_NAME).is_file() and not (out / "checkpoint-2" / MANIFEST_NAME).exists()
    killed = _accelerate(tmp_path, engine, out, "--kill-step", "3", "--kill-rank", "1")
    assert killed.returncode != 0
    assert f"skipping checkpoint {out / 'checkpoint-2'}: no {MANIFEST_NAME}" in killed.stderr
    final = _accelerate(tmp_path, engine, out)
    assert final.returncode == 0, final.stderr[-4000:]
    load = lambda run: torch.load(tmp_path / run / "result.pt", weights_only=False)  # noqa: E731
    _assert_same_run(load("reference"), load("killed"))
