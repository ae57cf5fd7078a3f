"""Launched by tests/test_crash_resume.py: a tiny GRPO run, a checkpoint every step, resumed automatically from the
newest complete checkpoint of its output folder, optionally killed (SIGKILL) at a chosen moment.

    python tests/crash_resume_script.py OUT [--kill-step N --kill-rank R] [--cpu-fsdp]   (or accelerate launch)

Completions are sampled by `generate` from the model itself, so the run depends on every rank's RNG state: a resume
that restored the wrong state (or none) would diverge. `--kill-step N` kills rank R during optimizer step N, after
its first micro-batch's backward; a kill during a save is set with `HF_RLLOSS_TEST_FAULT=save:<step>:<rank>`
(`hf_rlloss.trainer.sync.checkpoints`). A run that finishes writes `result.pt` (rank 0): its step logs and parameters.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _launch import free_port  # noqa: E402
from _trainer_utils import (  # noqa: E402
    BASE_ARGS,
    finish_distributed,
    make_dataset,
    make_model,
    make_tokenizer,
    reward_digit,
    reward_length,
    trainable_snapshot,
)
from transformers import TrainerCallback  # noqa: E402

from hf_rlloss import RLLossGRPOConfig, RLLossGRPOTrainer  # noqa: E402
from hf_rlloss.parallel.sequence import destroy_process_groups  # noqa: E402
from hf_rlloss.trainer.sync.checkpoints import FAULT_ENV, list_checkpoints  # noqa: E402

MAX_STEPS = 4


class KillDuringStep(TrainerCallback):
    """SIGKILL rank `rank` in the middle of optimizer step `step` (after its first micro-batch)."""

    def __init__(self, step: int, rank: int):
        self.step, self.rank = step, rank

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step and args.process_index == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


def train_run(out: str, kill_step: int | None = None, kill_rank: int = 0, sp_size: int = 1) -> None:
    """One run into `out`: resumed from its newest complete checkpoint if it has one; rank 0 writes `result.pt`.
    `sp_size` 2 splits every sequence over the two ranks (sequence parallelism)."""
    torch.set_num_threads(1)
    tok = make_tokenizer()
    args = RLLossGRPOConfig(
        output_dir=out,
        **{
            **BASE_ARGS,
            "per_device_train_batch_size": 2,
            "gradient_accumulation_steps": 2,
            "save_strategy": "steps",
            "save_steps": 1,
            "save_total_limit": 2,
            "max_steps": MAX_STEPS,
            "learning_rate": 1e-2,
            "max_completion_length": 6,
            "ddp_timeout": 60,
            "sp_size": sp_size,
        },
        rl_loss={"policy_loss_cfg": {"loss_type": "vanilla"}, "use_kl_loss": True, "kl_loss_type": "k3"},
    )
    callbacks = [KillDuringStep(kill_step, kill_rank)] if kill_step else None
    trainer = RLLossGRPOTrainer(
        make_model(tok),
        [reward_length, reward_digit],
        args=args,
        train_dataset=make_dataset(),
        processing_class=tok,
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=True if list_checkpoints(out) else None)
    if trainer.accelerator.is_main_process:
        logs = [h for h in trainer.state.log_history if "loss" in h]
        torch.save({"logs": logs, "params": trainable_snapshot(trainer.model)}, os.path.join(out, "result.pt"))
    if trainer.accelerator.num_processes > 1:
        torch.distributed.barrier()
        destroy_process_groups()


def _forked_rank(rank: int, world_size: int, port: int, out: str, kill: tuple, fault: str | None, log: str) -> None:
    """The body of a forked rank: never returns (`os._exit`), 0 when the run finished, 1 on an exception."""
    code = 1
    try:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        # pytest's capture replaced sys.stdout/stderr, and logging handlers hold them: point both at the log file
        sys.stdout = sys.stderr = os.fdopen(os.dup(fd), "w", buffering=1)
        for handler in [*logging.getLogger().handlers, *logging.getLogger("transformers").handlers]:
            if isinstance(handler, logging.StreamHandler):
                handler.setStream(sys.stderr)
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)  # the parent's singletons are not this run's
        GradientState._reset_state()
        env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": world_size}
        os.environ.update({k: str(v) for k, v in env.items()})
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TOKENIZERS_PARALLELISM="false")
        os.environ.pop(FAULT_ENV, None)
        if fault:
            os.environ[FAULT_ENV] = fault
        if world_size == 1:
            for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                del os.environ[key]
        train_run(out, *kill)
        code = 0
    except BaseException:  # noqa: BLE001 - reported in the log, and by the exit code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        # No interpreter teardown in a forked copy of the test process (it would run the parent's atexit hooks).
        os._exit(code)


def launch(out: str, world_size: int, kill_step=None, kill_rank=0, fault=None, timeout=300.0, sp_size=1) -> dict:
    """Run `train_run` in `world_size` processes forked from this one (gloo, no launcher: a rank whose peer died
    must leave by itself). Returns ``{"codes": [exit code or -signal per rank], "seconds": [time each took],
    "logs": [each rank's output]}``; kills every rank and raises `TimeoutError` after `timeout` s."""
    port = free_port()
    os.makedirs(out, exist_ok=True)
    logs = [os.path.join(out, f"rank{rank}.log") for rank in range(world_size)]
    start = time.monotonic()
    pids = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            _forked_rank(rank, world_size, port, out, (kill_step, kill_rank, sp_size), fault, logs[rank])
        pids.append(pid)
    codes, seconds = [None] * world_size, [None] * world_size
    while any(c is None for c in codes):
        if time.monotonic() - start > timeout:
            for pid, code in zip(pids, codes):
                if code is None:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
            raise TimeoutError(f"{world_size}-process run in {out} did not finish within {timeout:.0f} s")
        for i, pid in enumerate(pids):
            if codes[i] is None:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[i] = os.waitstatus_to_exitcode(status)
                    seconds[i] = time.monotonic() - start
        time.sleep(0.05)
    texts = []
    for path in logs:
        with open(path) as f:
            texts.append(f.read())
    return {"codes": codes, "seconds": seconds, "logs": texts}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill-step", type=int)
    parser.add_argument("--kill-rank", type=int, default=0)
    parser.add_argument("--cpu-fsdp", action="store_true", help="install the test-only CPU FSDP2 shim")
    cli = parser.parse_args()
    if cli.cpu_fsdp:
        from _cpu_fsdp import enable_cpu_fsdp

        enable_cpu_fsdp()
    train_run(cli.out, cli.kill_step, cli.kill_rank)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        finish_distributed()


if __name__ == "__main__":
    main()
