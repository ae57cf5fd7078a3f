"""Checkpoints that are complete or do not exist, on `Trainer`'s own save and load hooks.

transformers' `Trainer` writes a checkpoint file by file (weights, optimizer, scheduler, each rank's RNG state, the
trainer state) with nothing that says the folder is finished, and resumes from the highest-numbered
``checkpoint-N`` folder. A run killed during a save leaves a partial folder that the next start either cannot load
(an error naming neither file nor folder) or, worse, loads silently without a rank's RNG state. Here:

- **Save.** Every rank writes its files through `Trainer._save_checkpoint`, unchanged (same layout, DDP, DeepSpeed
  ZeRO and FSDP paths). Then a barrier, bounded and naming the ranks that did not arrive (gloo's
  `monitored_barrier`), and only then the saving process writes `checkpoint_manifest.json` last: every file of the
  folder with its size, the world size and the RNG files expected. The files are flushed to disk before the
  manifest, which is written under a temporary name and renamed: a checkpoint with a manifest is complete. Rotation
  (`save_total_limit`) runs after the manifest, so an older complete checkpoint is never deleted for a partial one.
- **Resume.** `resume_from_checkpoint=True` (and `latest_complete_checkpoint`, for scripts) takes the newest
  checkpoint whose manifest and files check out, and logs each newer one it skipped and why. A checkpoint named
  explicitly is checked the same way and a problem raises `CheckpointError` naming the checkpoint and the file.
- **Checked** for each file of the manifest: present, the recorded size, and readable as far as cheap to tell (JSON
  parses, a safetensors header matches the file's size, a torch archive's zip directory is intact). Contents are not
  hashed (sizes catch a truncated write; hashing a large optimizer state on every resume would cost minutes).

Why a manifest rather than a temporary folder renamed after the barrier: `Trainer._save_checkpoint` computes the
folder's name itself and, before returning, points `best_model_checkpoint` at it and rotates old checkpoints;
DeepSpeed writes its ``latest`` tag inside it. A manifest keeps that layout and those code paths exactly as they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import struct
import zipfile
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import logging

logger = logging.get_logger(__name__)

MANIFEST_NAME = "checkpoint_manifest.json"
TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
# Test-only: "save:<step>:<rank>" SIGKILLs that rank in the save of that step, after its weights and optimizer state
# and before its RNG state (the moment a preemption leaves a partial folder). Read at the moment, not at import.
FAULT_ENV = "HF_RLLOSS_TEST_FAULT"


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or unreadable, or a rank did not finish writing its part of it."""


def checkpoint_step(path: str) -> int | None:
    """The step ``N`` of a ``checkpoint-N`` folder, else `None`."""
    match = _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def list_checkpoints(run_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders of `run_dir`, oldest (lowest ``N``) first."""
    if not os.path.isdir(run_dir):
        return []
    found = [os.path.join(run_dir, name) for name in os.listdir(run_dir) if _CHECKPOINT_RE.match(name)]
    return sorted((p for p in found if os.path.isdir(p)), key=checkpoint_step)


def expected_rng_files(world_size: int) -> list[str]:
    """The RNG files `Trainer._save_rng_state` writes for `world_size` processes."""
    return ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{i}.pth" for i in range(world_size)]


def _files(folder: str) -> dict[str, int]:
    """Every file under `folder` (relative path → size), the manifest excepted."""
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel != MANIFEST_NAME and not rel.startswith(MANIFEST_NAME):
                out[rel] = os.path.getsize(path)
    return dict(sorted(out.items()))


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: str, *, global_step: int, world_size: int, rng_files: list[str]) -> dict[str, Any]:
    """Mark `folder` complete: flush its files to disk, then write the manifest under a temporary name and rename it.

    Call it once every rank's files are written (after a barrier), on the process that saves. An expected RNG file
    that this process cannot see (a node without a shared filesystem) is logged and recorded as unseen.
    """
    files = _files(folder)
    if TRAINER_STATE_NAME not in files:
        raise CheckpointError(f"{folder}: {TRAINER_STATE_NAME} missing after every rank finished its save")
    # Every rank passed the barrier after writing its RNG file, so one missing here is not visible from this process
    # (no shared filesystem): recorded, and the resume will say it cannot be exact.
    unseen = [name for name in rng_files if name not in files]
    if unseen:
        logger.warning(
            f"{folder}: {', '.join(unseen)} not visible from the saving process (no shared filesystem?): a resume "
            "from this checkpoint cannot restore those ranks' random states"
        )
        rng_files = [name for name in rng_files if name in files]
    for rel in files:
        _fsync(os.path.join(folder, rel))
    manifest = {
        "format": 1,
        "global_step": global_step,
        "world_size": world_size,
        "rng_files": rng_files,
        "unseen_rng_files": unseen,
        "files": files,
    }
    tmp = os.path.join(folder, f"{MANIFEST_NAME}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST_NAME))
    _fsync(folder)  # the rename itself
    return manifest


def _unreadable(path: str) -> str | None:
    """Why the file at `path` cannot be read (cheap structural checks by extension), or `None`."""
    name = path.lower()
    try:
        if name.endswith(".json"):
            with open(path) as f:
                json.load(f)
        elif name.endswith(".safetensors"):
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                if 8 + header_len > size:
                    return f"safetensors header of {header_len} bytes in a file of {size}"
                header = json.loads(f.read(header_len))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            if 8 + header_len + end != size:
                return f"safetensors data ends at byte {8 + header_len + end} but the file has {size}"
        elif name.endswith((".pt", ".pth", ".bin")):
            if not zipfile.is_zipfile(path):
                return "not a readable torch archive (no intact zip directory)"
            with zipfile.ZipFile(path) as archive:
                archive.infolist()
    except (OSError, ValueError, KeyError, struct.error, zipfile.BadZipFile) as err:
        return f"{type(err).__name__}: {err}"
    return None


def checkpoint_problem(folder: str, world_size: int | None = None) -> str | None:
    """What makes `folder` unusable, naming the file (`None` when it is complete and readable).

    Args:
        folder (`str`): a ``checkpoint-N`` folder.
        world_size (`int`, *optional*): the processes of the run about to resume; a different number than the
            checkpoint's is logged (RNG states cannot be restored one to one), not a problem.
    """
    manifest_path = os.path.join(folder, MANIFEST_NAME)
    if not os.path.isfile(manifest_path):
        return (
            f"no {MANIFEST_NAME}: its save did not finish (or it was written by a plain transformers Trainer; pass "
            "its path explicitly to load it unchecked)"
        )
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files, rng_files = manifest["files"], manifest["rng_files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{MANIFEST_NAME} is unreadable ({type(err).__name__}: {err})"
    for name in [TRAINER_STATE_NAME, *rng_files]:
        if name not in files:
            return f"{name} is not in its manifest"
    for rel, size in files.items():
        path = os.path.join(folder, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        actual = os.path.getsize(path)
        if actual != size:
            return f"{rel} has {actual} bytes, {size} when saved (truncated or rewritten)"
        reason = _unreadable(path)
        if reason:
            return f"{rel} is unreadable ({reason})"
    if manifest.get("unseen_rng_files"):
        logger.warning(
            f"{folder}: {', '.join(manifest['unseen_rng_files'])} were not visible when it was saved: those ranks' "
            "random states are not restored, so the run will not repeat an uninterrupted one exactly"
        )
    saved_world = manifest.get("world_size")
    if world_size is not None and saved_world is not None and saved_world != world_size:
        logger.warning(
            f"{folder} was saved by {saved_world} process(es) and is resumed by {world_size}: the RNG states cannot "
            "be restored one to one, so the run will not repeat an uninterrupted one exactly"
        )
    return None


def latest_complete_checkpoint(run_dir: str, world_size: int | None = None) -> str | None:
    """The newest complete and readable checkpoint of `run_dir` (`None` if there is none); each newer checkpoint
    skipped is logged with the reason, naming its file."""
    for folder in reversed(list_checkpoints(run_dir)):
        problem = checkpoint_problem(folder, world_size)
        if problem is None:
            return folder
        logger.warning(f"skipping checkpoint {folder}: {problem}")
    return None


def resolve_resume(resume_from_checkpoint: str | bool | None, run_dir: str, world_size: int) -> str | None:
    """`Trainer.train`'s `resume_from_checkpoint`, checked: `True` → the newest complete checkpoint of `run_dir`;
    a path → that checkpoint, or `CheckpointError` naming it and its bad file."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        found = latest_complete_checkpoint(run_dir, world_size)
        if found is None:
            skipped = ", ".join(os.path.basename(p) for p in list_checkpoints(run_dir))
            why = f": every one is incomplete or unreadable ({skipped}; see the warnings)" if skipped else ""
            raise ValueError(f"No valid checkpoint found in output directory ({run_dir}){why}")
        logger.info(f"resuming from {found}, the newest complete checkpoint")
        return found
    folder = str(resume_from_checkpoint)
    if not os.path.isdir(folder):
        raise CheckpointError(f"resume_from_checkpoint={folder!r} is not a folder")
    problem = checkpoint_problem(folder, world_size)
    if problem is not None and os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
        raise CheckpointError(f"cannot resume from checkpoint {folder}: {problem}")
    if problem is not None:  # no manifest: a folder written without this module; check what can be checked
        logger.warning(f"{folder} has no {MANIFEST_NAME}: loading it without knowing whether its save finished")
        state = os.path.join(folder, TRAINER_STATE_NAME)
        if not os.path.isfile(state):
            raise CheckpointError(f"cannot resume from checkpoint {folder}: {TRAINER_STATE_NAME} is missing")
        for rel in _files(folder):
            reason = _unreadable(os.path.join(folder, rel))
            if reason:
                raise CheckpointError(f"cannot resume from checkpoint {folder}: {rel} is unreadable ({reason})")
    return folder


def bounded_barrier(timeout_s: float, what: str) -> None:
    """Wait for every rank, at most `timeout_s`; a rank that died or hangs makes it raise `CheckpointError` naming
    the rank(s) (gloo's `monitored_barrier`; other backends use `barrier`, bounded by their own timeout)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        else:
            dist.barrier()
    except RuntimeError as err:  # gloo: "Ranks 1 failed to pass monitoredBarrier ..." or a closed connection
        raise CheckpointError(
            f"{what}: a rank died or hung before finishing its part (waited at most {timeout_s:.0f} s): {err}"
        ) from err


def dead_ranks_after(err: BaseException, timeout_s: float = 5.0) -> str | None:
    """After a collective failed with `err`, which ranks are gone, as far as gloo's `monitored_barrier` can tell in
    `timeout_s` (rank 0 learns every rank that does not answer; another rank learns whether rank 0 answers).
    `None` when `err` is not a failed collective of a gloo world of several processes."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    if dist.get_backend() != "gloo" or not any(s in str(err) for s in ("gloo", "Connection", "monitoredBarrier")):
        return None
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as probe:
        text = str(probe)
        found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
        if found:
            return f"rank(s) {found.group(1).strip()} did not answer"
        if dist.get_world_size() == 2:  # a broken pair rethrows its own error; with one peer there is no doubt
            return f"rank {1 - dist.get_rank()}, the only other rank, is gone"
        if dist.get_rank() != 0:
            return "rank 0 did not answer"
        return "which ranks could not be probed: see the launcher's log"
    return "every rank still answers: the failure was elsewhere"


def inject_fault(moment: str, step: int, rank: int) -> None:
    """Test-only: SIGKILL this process when `HF_RLLOSS_TEST_FAULT` is ``"<moment>:<step>:<rank>"``."""
    if os.environ.get(FAULT_ENV) == f"{moment}:{step}:{rank}":
        os.kill(os.getpid(), signal.SIGKILL)


def _remove(folder: str) -> None:
    """Delete a checkpoint folder, its manifest first (so that no moment shows a manifest over partial files)."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(folder, MANIFEST_NAME))
    shutil.rmtree(folder, ignore_errors=True)


class CompleteCheckpoints:
    """`Trainer` mixin: checkpoints written complete-or-absent and checked before they are loaded (see module doc).

    Put it before the `Trainer` subclass in the bases. It overrides `train` (to pick or check the checkpoint),
    `_save_checkpoint`, `_save_rng_state` (the test fault point) and the three load hooks (errors name the checkpoint).
    """

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        resume = resolve_resume(resume_from_checkpoint, self.args.output_dir, self.args.world_size)
        try:
            return super().train(resume, *args, **kwargs)
        except CheckpointError:  # already says what failed, and which rank where gloo told
            raise
        except RuntimeError as err:
            dead = dead_ranks_after(err)
            if dead is None:
                raise
            first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise RuntimeError(f"a peer process died or hung during training: {dead} ({first_line})") from err

    def _save_checkpoint(self, model, trial) -> None:
        run_dir = self._get_output_dir(trial=trial)
        folder = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        timeout = float(self.args.ddp_timeout)
        if self.args.should_save and os.path.exists(folder):
            # A folder of this step from an earlier, interrupted run (or an explicit earlier resume): invalidate it
            # before anyone writes, so that old and new files never mix under a manifest.
            logger.warning(f"replacing {folder}, left by an earlier run")
            _remove(folder)
        bounded_barrier(timeout, f"saving {folder}")
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # rotate once the new checkpoint is complete, not inside the save
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        bounded_barrier(timeout, f"saving {folder}")
        if self.args.should_save:
            rng_files = [] if self.args.save_only_model else expected_rng_files(self.args.world_size)
            if self.args.save_on_each_node:  # each node's main process lists what its node's disk holds
                rng_files = [name for name in rng_files if os.path.isfile(os.path.join(folder, name))]
            write_manifest(
                folder, global_step=self.state.global_step, world_size=self.args.world_size, rng_files=rng_files
            )
            self._remove_stale_checkpoints(run_dir)
            rotate_checkpoints(run_dir, limit, self.state.best_model_checkpoint, use_mtime=True)
        # No rank leaves the save before the checkpoint is marked complete, so a kill right after it keeps it.
        bounded_barrier(timeout, f"saving {folder}")

    def _remove_stale_checkpoints(self, run_dir: str) -> None:
        """Delete incomplete checkpoints numbered after this step: left by an interrupted earlier run, they would
        otherwise count as the newest in `save_total_limit`'s rotation and in plain `get_last_checkpoint`."""
        for folder in list_checkpoints(run_dir):
            if checkpoint_step(folder) > self.state.global_step and not os.path.isfile(
                os.path.join(folder, MANIFEST_NAME)
            ):
                logger.warning(f"removing {folder}: an incomplete checkpoint of an interrupted earlier run")
                _remove(folder)

    def _save_rng_state(self, output_dir: str) -> None:
        inject_fault("save", self.state.global_step, self.args.process_index)
        super()._save_rng_state(output_dir)

    @contextlib.contextmanager
    def _naming(self, checkpoint: str | None) -> Iterator[None]:
        try:
            yield
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"cannot load checkpoint {checkpoint}: {type(err).__name__}: {err}") from err

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        with self._naming(resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        with self._naming(checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)

    def _load_rng_state(self, checkpoint) -> None:
        with self._naming(checkpoint):
            super()._load_rng_state(checkpoint)
