"""Train the tiny model a few steps under whatever engine `accelerate launch --config_file ...` configures, and dump
what the engine-matrix tests and the benchmark table need. Rank 0 writes `--out`, a `torch.save`d dict
``{case: record}`` (cases ``sp1``, ``sp2``, ``sp1-peft``, ...: run one after the other in the same processes, which
saves the start-up of a launch per case); each record has:

* ``engine``: Accelerate's distributed type, the wrapper type of the trained model, DeepSpeed's ZeRO stage (or None),
  whether the parameters are FSDP2 DTensors, the reference model's wrapper type and ZeRO stage;
* ``losses``: the per-step ``loss`` (the step's global loss) and ``loss/total`` logged by the trainer;
* ``params``: the final trainable parameters, full (gathered from ZeRO-3 shards / FSDP2 DTensors), float32, on CPU;
* ``ranks``: per process: global rank (torch.distributed), Accelerate's process index and local process index,
  ``LOCAL_RANK``/``RANK``/``GROUP_RANK`` from the launcher, the global ranks of its SP group (None without SP);
* ``peak_rss_mb``: per process, the RSS high-water mark of the process (``ru_maxrss``) at the end, in MiB, engine
  set-up included; ``train_peak_rss_mb``: the high-water mark from the end of the first micro-batch on (training);
  ``start_rss_mb``: rank 0's RSS after the imports, before any model (what the peak includes of the libraries);
* ``wall_s``: seconds from the trainer's construction to the end of ``train()`` (rank 0);
* ``head``: the LM-head weight shapes the chunked passes received, the head's ZeRO-3 status before, inside and
  after each of the trainer's `maybe_gather_lm_head_ctx`, its local numel after each step, tied or not;
* ``moved``: the largest change of a parameter during training (the test is not trivial);
* ``saved``: when ``--save-dir`` is given, the files ``save_model`` wrote to ``<save-dir>/<case>``.

The run is deterministic and the same under every engine with the same number of processes and ``--sp``: fixed
completions (a function of the prompt only) with synthetic rollout log-probs, so rollout IS runs, KL to the reference
(``use_kl_loss``), float32 (``bf16=False``: TRL's ``GRPOConfig`` would turn bf16 on otherwise), SGD. The model is
built in memory (no path): with ``--zero3-init`` (ZeRO-3 configs) it is built the way ``from_pretrained`` builds it
under ``zero3_init_flag``, i.e. partitioned by ``deepspeed.zero.Init`` before the trainer sees it, and its weights
are then set to the plain model's, so the starting point equals the other engines'. ``--resume-from`` resumes from a
checkpoint folder of an earlier run (``--save-steps`` writes them).

Reused by the FSDP2 tests: keep it engine-agnostic (anything engine-specific is a small branch in `engine_info` or
`full_params`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _trainer_utils import (  # noqa: E402
    BASE_ARGS,
    FixedWithLogprobs,
    finish_distributed,
    make_dataset,
    make_model,
    make_tokenizer,
    reward_digit,
    reward_length,
)

import hf_rlloss.trainer.common.forwards as trainer_module  # noqa: E402
from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer  # noqa: E402


def _rss_mb(field: str = "VmRSS") -> float:
    """A `/proc/self/status` memory field in MiB (`VmRSS`: resident now, `VmHWM`: the high-water mark)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _reset_peak_rss() -> None:
    """Reset `VmHWM` to the current RSS (Linux `clear_refs`), so that the next reading is the peak from here on."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


START_RSS_MB = _rss_mb()

RL_LOSS = {
    "use_kl_loss": True,
    "kl_loss_type": "k3",
    "kl_loss_coef": 0.1,
    "rollout_is": {"level": "token", "mode": "truncate", "upper": 2.0},
}


def _zero3_model(plain: torch.nn.Module) -> torch.nn.Module:
    """`plain`'s architecture built under `deepspeed.zero.Init` (what `from_pretrained` does under ZeRO-3 with
    `zero3_init_flag`), with `plain`'s weights copied in shard by shard."""
    import deepspeed
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    assert is_deepspeed_zero3_enabled(), "--zero3-init needs a ZeRO-3 config with zero3_init_flag: true"
    model = type(plain)._from_config(plain.config)  # transformers builds it under zero.Init here
    assert all(hasattr(p, "ds_id") for p in model.parameters()), "the model was not partitioned by zero.Init"
    model.generation_config = plain.generation_config
    sources = dict(plain.named_parameters())
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if dist.get_rank() == 0:
                param.data.copy_(sources[name].data)
    return model


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters, full (ZeRO-3 shards gathered, FSDP2 DTensors made whole), float32 on CPU."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if any(hasattr(p, "ds_id") for _, p in params):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.detach().float().cpu().clone() for n, p in params}
    out = {}
    for name, param in params:
        value = param.detach()
        if hasattr(value, "full_tensor"):  # FSDP2 DTensor (collective)
            value = value.full_tensor()
        out[name] = value.float().cpu().clone()
    return out


def engine_info(trainer) -> dict:
    """What actually ran: the wrapper types and the ZeRO stage of the policy and of the reference."""

    def zero_stage(module):
        stage = getattr(module, "zero_optimization_stage", None)
        return stage() if callable(stage) else None

    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "wrapper": type(trainer.model_wrapped).__name__,
        "model": type(trainer.model).__name__,
        "zero_stage": zero_stage(trainer.model_wrapped),
        "dtensor_params": any(hasattr(p, "full_tensor") for p in unwrapped.parameters()),
        "param_dtype": str(next(unwrapped.parameters()).dtype),
        "param_device": next(unwrapped.parameters()).device.type,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "ref_wrapper": None if trainer.ref_model is None else type(trainer.ref_model).__name__,
        "ref_zero_stage": None if trainer.ref_model is None else zero_stage(trainer.ref_model),
        "mixed_precision": str(trainer.accelerator.mixed_precision),
    }


def rank_info(trainer) -> dict:
    sp_ranks = None
    if trainer.sp_mesh is not None:
        sp_ranks = dist.get_process_group_ranks(trainer.sp_mesh.get_group())
    return {
        "global_rank": dist.get_rank() if dist.is_initialized() else 0,
        "process_index": trainer.accelerator.process_index,
        "local_process_index": trainer.accelerator.local_process_index,
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")},
        "sp_group_ranks": sp_ranks,
    }


def _gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _status(param) -> str:
    """A ZeRO-3 parameter's status (`AVAILABLE`: gathered, `NOT_AVAILABLE`: a shard), `plain` for others."""
    status = getattr(param, "ds_status", None)
    return "plain" if status is None else status.name


HEAD_GATHERS: list[dict] = []  # one entry per use of maybe_gather_lm_head_ctx by the trainer
_original_gather = trainer_module.maybe_gather_lm_head_ctx


@contextlib.contextmanager
def _recording_gather(*params):
    """The trainer's `maybe_gather_lm_head_ctx`, recording the head's status before, inside and after it."""
    entry = {"before": [_status(p) for p in params]}
    with _original_gather(*params):
        entry["inside"] = [(_status(p), tuple(p.shape)) for p in params]
        yield
    entry["after"] = [_status(p) for p in params]
    HEAD_GATHERS.append(entry)


trainer_module.maybe_gather_lm_head_ctx = _recording_gather


class RecordingTrainer(RLLossGRPOTrainer):
    """Records the shape of every LM-head weight the chunked loss and log-prob passes receive (under ZeRO-3: the
    gathered full weight, while the parameter itself stays a shard)."""

    head_shapes: set[tuple[int, ...]] = set()
    head_numel_after_step: list[int] = []  # the head parameter's local numel after each micro-batch's backward

    def _head_inputs(self, hidden, weight):
        self.head_shapes.add(tuple(weight.shape))
        return super()._head_inputs(hidden, weight)

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        if not self.head_numel_after_step:  # the engine is built and has run once: measure the steady state from here
            _reset_peak_rss()
        lm = self._causal_lm(self.accelerator.unwrap_model(self.model))
        self.head_numel_after_step.append(lm.get_output_embeddings().weight.numel())
        return loss


def head_info(trainer) -> dict:
    """The LM head after training: its local numel (0: a ZeRO-3 shard, not kept gathered), tied or not."""
    lm = trainer._causal_lm(trainer.accelerator.unwrap_model(trainer.model))
    head = lm.get_output_embeddings().weight
    return {
        "seen_in_loss": sorted(RecordingTrainer.head_shapes),
        "gathers": list(HEAD_GATHERS),
        "local_numel_after_steps": sorted(set(RecordingTrainer.head_numel_after_step)),
        "local_numel_after": head.numel(),
        "full_shape": tuple(getattr(head, "ds_shape", head.shape)),
        "tied": head is lm.get_input_embeddings().weight,
    }


def parse_case(case: str) -> tuple[int, bool, bool]:
    """`sp1`, `sp2`, `sp1-peft`, `sp1-plain` (never partitioned by zero.Init, even with --zero3-init), ... ->
    (sp_size, peft, plain)."""
    sp, *options = case.split("-")
    if not sp.startswith("sp") or not sp[2:].isdigit() or set(options) - {"peft", "plain"}:
        raise ValueError(f"case {case!r}: expected sp<N> with optional -peft / -plain")
    return int(sp[2:]), "peft" in options, "plain" in options


def run_case(cli, tok, case: str) -> dict | None:
    """Train one case; every rank returns None except the main process, which returns its record."""
    sp, peft, plain = parse_case(case)
    case_dir = os.path.join(os.path.dirname(os.path.abspath(cli.out)), "run", case)
    save = {"save_strategy": "steps", "save_steps": cli.save_steps} if cli.save_steps else {}
    args = RLLossGRPOConfig(
        output_dir=case_dir,
        **{
            **BASE_ARGS,
            **save,
            "num_generations": 2,
            "per_device_train_batch_size": cli.per_device_batch_size,
            "learning_rate": cli.learning_rate,
            "use_cpu": cli.device == "cpu",
        },
        gradient_accumulation_steps=cli.grad_accum,
        max_steps=cli.steps,
        num_iterations=cli.num_iterations,
        optim=cli.optim,
        rl_loss=cli.rl_loss,
        sp_size=sp,
    )
    model = make_model(tok, hidden_size=cli.hidden_size, layers=cli.layers)
    if sp > 1:
        model.set_attn_implementation("sdpa")
    if cli.zero3_init and not plain:
        model = _zero3_model(model)
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)  # the LoRA init: the same whatever the engine consumed before
    RecordingTrainer.head_shapes, RecordingTrainer.head_numel_after_step = set(), []
    HEAD_GATHERS.clear()
    start = time.perf_counter()
    trainer = RecordingTrainer(
        model,
        [reward_length, reward_digit],
        args=args,
        train_dataset=make_dataset(),
        processing_class=tok,
        peft_config=peft_config,
    )
    trainer._generate_single_turn = FixedWithLogprobs(tok, trainer.max_completion_length)
    initial = None if cli.no_snapshot else full_params(trainer.accelerator.unwrap_model(trainer.model))
    trainer.train(resume_from_checkpoint=cli.resume_from)
    wall = time.perf_counter() - start
    # memory first: saving and the gather of every parameter below (ZeRO-3, FSDP2) would raise the peaks
    peak = _gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    steady_peak = _gather(_rss_mb("VmHWM"))
    save_dir = os.path.join(cli.save_dir, case) if cli.save_dir else None
    if save_dir:
        trainer.save_model(save_dir)
    head = head_info(trainer)  # before full_params, whose gather re-partitions every parameter
    params = full_params(trainer.accelerator.unwrap_model(trainer.model))  # collective under ZeRO-3/FSDP2
    ranks = _gather(rank_info(trainer))
    trainer.accelerator.wait_for_everyone()
    if not trainer.accelerator.is_main_process:
        return None
    steps = [h for h in trainer.state.log_history if "loss" in h]
    return {
        "engine": engine_info(trainer),
        "head": head,
        "world_size": trainer.accelerator.num_processes,
        "sp": sp,
        "peft": peft,
        "losses": [h["loss"] for h in steps],
        "loss_total": [h.get("loss/total") for h in steps],
        "steps": [h["step"] for h in steps],
        "history": trainer.state.log_history,
        "global_step": trainer.state.global_step,
        "micro_steps_trained": len(RecordingTrainer.head_numel_after_step),  # in this run (a resumed run: fewer)
        "params": params,
        "moved": None if initial is None else max((params[k] - initial[k]).abs().max().item() for k in params),
        "ranks": ranks,
        "peak_rss_mb": peak,
        "train_peak_rss_mb": steady_peak,
        "start_rss_mb": START_RSS_MB,
        "wall_s": wall,
        "saved": sorted(os.listdir(save_dir)) if save_dir else None,
    }


def main(finish: bool = True) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: make gpu-check's engines")
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["sp1"],
        help="sp<N> or sp<N>-peft (LoRA; the reference is the base model), run one after the other in these "
        "processes (peak RSS is then the running maximum: give one case per launch to measure memory)",
    )
    parser.add_argument("--per-device-batch-size", type=int, default=4, help="sequences per micro-batch per replica")
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--num-iterations", type=int, default=2, help="2: every other step is off-policy")
    parser.add_argument("--hidden-size", type=int, default=32, help="the model's width (benchmarks: larger)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--optim", default="sgd", help="sgd: no optimizer state; adamw_torch shows ZeRO's sharding")
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--zero3-init", action="store_true", help="in-memory model partitioned by zero.Init")
    parser.add_argument("--rl-loss", default=json.dumps(RL_LOSS))
    parser.add_argument("--no-snapshot", action="store_true", help="no copy of the initial weights (memory runs)")
    parser.add_argument("--save-dir", default=None, help="save_model() to <save-dir>/<case> at the end")
    parser.add_argument("--save-steps", type=int, default=0, help="write checkpoints every N steps")
    parser.add_argument("--resume-from", default=None, help="a checkpoint folder to resume from")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    tok = make_tokenizer()
    results = {case: run_case(cli, tok, case) for case in cli.cases}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, cli.out)
    if finish:
        finish_distributed()


if __name__ == "__main__":
    main()
