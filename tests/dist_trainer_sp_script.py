"""Train RLLossGRPOTrainer with sequence parallelism for a few steps with fixed completions; save parameters (rank 0).

Run by `tests/test_trainer_sp.py` with 1 process (`python`, sp_size=1: the reference), 2 processes (sp=2) and 4
(dp=2 × sp=2) through `torchrun`, every run with the same global batch: they must give the same losses, metrics and
parameters. `--check-errors` also records the errors of bad constructions (needs a multi-process launch).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _tools  # noqa: E402
import _trainer_utils  # noqa: E402
import torch  # noqa: E402
from _models import tiny_moe  # noqa: E402
from _trainer_utils import (  # noqa: E402
    BASE_ARGS,
    FixedCompletions,
    FixedWithLogprobs,
    StatelessCompletions,
    StatelessWithLogprobs,
    finish_distributed,
    make_tokenizer,
    reward_digit,
    reward_length,
    reward_length_or_constant,
    trainable_snapshot,
)
from datasets import Dataset  # noqa: E402
from transformers import Qwen2ForCausalLM  # noqa: E402

from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer  # noqa: E402

# name -> (rl_loss, extra config, generation returns rollout log-probs)
CASES = {
    "vanilla": ({"policy_loss_cfg": {"loss_type": "vanilla"}}, {}, False),
    # GSPO (per-sequence ratio, reduced over the SP group), with gradient checkpointing (recomputed under SP)
    "gspo": (
        {"policy_loss_cfg": {"loss_type": "gspo", "cliprange_low": 0.03, "cliprange_high": 0.04}},
        {"activation_checkpointing": True},
        False,
    ),
    # sequence-level rollout IS (rejects and truncates whole sequences) with a KL to a reference copy
    "rollout_is_seq": (
        {
            "rollout_is": {"level": "sequence", "mode": "both", "upper": 2.0},
            "use_kl_loss": True,
            "kl_loss_type": "k3",
            "kl_loss_coef": 0.1,
        },
        {},
        True,
    ),
    # dynamic sampling (prompts n % 3 == 0 have one reward: their groups are dropped, refills) with token rollout IS
    "dynamic_sampling": (
        {"rollout_is": {"level": "token", "mode": "truncate", "upper": 2.0}},
        {"dynamic_sampling": True, "dynamic_sampling_max_rounds": 3},
        True,
    ),
    # the cases above run the default packing ("shared_prefix": under SP a TreeRow row sharded over the group);
    # the same vanilla training with the other layouts ("off" under SP is padding-free, as SP always packs)
    "vanilla:padding_free": ({"policy_loss_cfg": {"loss_type": "vanilla"}}, {"packing": "padding_free"}, False),
    "vanilla:off": ({"policy_loss_cfg": {"loss_type": "vanilla"}}, {"packing": "off"}, False),
    # multi-turn tool rollouts (TRL's tool loop, `_tools.ScriptedToolRollout`): the replies masked in every shard
    "tools": (
        {"rollout_is": {"level": "token", "mode": "truncate", "upper": 2.0}},
        {"max_tool_calling_iterations": 2, "max_completion_length": 160},
        True,
    ),
    # MoE routing replay (R2: the π_old pass's experts, gathered from the SP shards, replayed in the loss forward of
    # the off-policy second step, sharded as the row) on a tiny Qwen3-MoE; run by test_routing_replay.py only
    "moe:old_policy": ({"policy_loss_cfg": {"loss_type": "vanilla"}}, {"routing_replay": "old_policy"}, False),
    # R3 with HF generate on every rank (its share of the group's batch, routes recorded, pooled over the group):
    # sampled, so compared with the sampler's log-probs rather than with one process
    "moe:rollout": ({"rollout_is": {}}, {"routing_replay": "rollout"}, None),
}
DEFAULT_CASES = [name for name in CASES if not name.startswith("moe:")]


# ours, and TRL's names computed per micro-batch (`clip_ratio/*`, `entropy`, `policy_loss`, `kl`)
PREFIXES = (
    "loss/",
    "train_policy/",
    "rollout_is/",
    "mismatch/",
    "eval_train_policy/",
    "clip_ratio/",
    "entropy",
    "policy_loss",
    "kl",
    "dynamic_sampling/",
    "packing/",
    "routing/",
    "tools/",
)


def make_model(tokenizer, heads: int = 4, kv_heads: int = 1, hidden_size: int = 32) -> Qwen2ForCausalLM:
    """A tiny Qwen2 with grouped-query attention (fewer key/value heads than SP ranks: they are replicated)."""
    return _trainer_utils.make_model(tokenizer, hidden_size=hidden_size, heads=heads, kv_heads=kv_heads, attn="sdpa")


def make_dataset(n: int = 16) -> Dataset:
    """Prompts of 13 or 14 tokens: batches have left padding, packed rows have odd and even lengths."""
    return Dataset.from_dict({"prompt": [f"Q{i}: add {i % 7}+{i % 5} =" for i in range(n)]})


class RecordingTrainer(RLLossGRPOTrainer):
    """Records the length of every packed SP row."""

    packed_lengths: list[int] = []

    def _sp_pack_batch(self, inputs):
        packed = super()._sp_pack_batch(inputs)
        self.packed_lengths.append(packed.length)
        return packed


def _config(out_dir, sp, per_device, grad_accum, steps, num_iterations, rl_loss, **extra):
    options = {
        **BASE_ARGS,
        "per_device_train_batch_size": per_device,
        "num_generations": 2,
        "learning_rate": 0.05,
        **extra,
    }
    return RLLossGRPOConfig(
        output_dir=out_dir,
        **options,
        gradient_accumulation_steps=grad_accum,
        max_steps=steps,
        num_iterations=num_iterations,
        optim="sgd",
        rl_loss=rl_loss,
        sp_size=sp,
    )


def check_errors(tok, out_dir) -> dict[str, str]:
    """The errors of bad constructions, by name ("" when nothing was raised)."""
    errors = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = ""
        except (ValueError, NotImplementedError) as err:
            errors[name] = str(err)

    base = {"sp": 2, "per_device": 2, "grad_accum": 2, "steps": 1, "num_iterations": 1, "rl_loss": None}
    attempt("sp_not_dividing", lambda: _config(out_dir, **{**base, "sp": 3}))
    attempt("batch_not_divisible", lambda: _config(out_dir, **{**base, "per_device": 1, "grad_accum": 1}))
    attempt("vllm_is_correction", lambda: _config(out_dir, **base, use_vllm=True))
    attempt("continuous_batching", lambda: _config(out_dir, **base, use_transformers_continuous_batching=True))

    def trainer(model):
        RLLossGRPOTrainer(
            model, reward_length, args=_config(out_dir, **base), train_dataset=make_dataset(), processing_class=tok
        )

    attempt("heads_not_divisible", lambda: trainer(make_model(tok, heads=3, kv_heads=1, hidden_size=24)))
    flex = make_model(tok)
    flex.set_attn_implementation("flex_attention")
    attempt("flex_attention", lambda: trainer(flex))
    fa2 = make_model(tok)
    fa2.config._attn_implementation = "flash_attention_2"  # not installed here: set without loading the kernel
    attempt("flash_attention_2", lambda: trainer(fa2))
    attempt("good", lambda: trainer(make_model(tok)))
    return errors


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sp", type=int, required=True)
    parser.add_argument("--per-device-batch-size", type=int, required=True)
    parser.add_argument("--eval-batch-size", type=int, required=True)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--num-iterations", type=int, default=2)
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    parser.add_argument("--check-errors", action="store_true")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    tok = make_tokenizer()
    run_dir = os.path.join(os.path.dirname(cli.out), "run")
    results = {"cases": {}}
    if cli.check_errors:
        results["errors"] = check_errors(tok, run_dir)
    for name in cli.cases:
        rl_loss, extra, with_logprobs = CASES[name]
        if name == "vanilla":  # also an evaluation at the end (one batch of 8 completions over all ranks)
            extra = {**extra, "eval_strategy": "steps", "eval_steps": cli.steps}
            extra["per_device_eval_batch_size"] = cli.eval_batch_size
        args = _config(
            os.path.join(run_dir, name.replace(":", "_")),
            cli.sp,
            cli.per_device_batch_size,
            cli.grad_accum,
            cli.steps,
            cli.num_iterations,
            rl_loss,
            **extra,
        )
        RecordingTrainer.packed_lengths = []
        dynamic = extra.get("dynamic_sampling", False)
        if name == "tools":
            tool_tok = _tools.tool_tokenizer()
            trainer = RecordingTrainer(
                _tools.tool_model(tool_tok), _tools.reward_correct, args=args, train_dataset=_tools.dataset(),
                processing_class=tool_tok, tools=[_tools.multiply],
            )  # fmt: skip
            trainer._generate_single_turn = _tools.ScriptedToolRollout(tool_tok, logprobs=True)
        else:
            trainer = RecordingTrainer(
                tiny_moe(tok, "qwen3_moe", near_tied=False) if name.startswith("moe:") else make_model(tok),
                [reward_length_or_constant] if dynamic else [reward_length, reward_digit],
                args=args,
                train_dataset=make_dataset(),
                eval_dataset=make_dataset(4) if name == "vanilla" else None,
                processing_class=tok,
            )
        generator = FixedWithLogprobs if with_logprobs else FixedCompletions
        if dynamic:  # prompts are drawn again, on any rank: completions must not depend on how often one was seen
            generator = StatelessWithLogprobs if with_logprobs else StatelessCompletions
        if with_logprobs is not None and name != "tools":  # None: HF generate itself
            trainer._generate_single_turn = generator(tok, trainer.max_completion_length)
        initial = trainable_snapshot(trainer.accelerator.unwrap_model(trainer.model))
        trainer.train()
        lengths = torch.tensor(RecordingTrainer.packed_lengths, dtype=torch.long)
        if trainer.accelerator.is_main_process:
            history = [
                {k: v for k, v in h.items() if k in ("loss", "eval_loss/total") or k.startswith(PREFIXES)}
                for h in trainer.state.log_history
            ]
            evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
            results["cases"][name] = {
                "initial": initial,
                "params": trainable_snapshot(trainer.accelerator.unwrap_model(trainer.model)),
                "history": [h for h in history if h],
                "eval_loss": evals,
                "packed_lengths": lengths.tolist(),
                "attn": trainer.accelerator.unwrap_model(trainer.model).config._attn_implementation,
            }
        results["world_size"] = trainer.accelerator.num_processes
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, cli.out)
    finish_distributed()


if __name__ == "__main__":
    main()
