"""Train RLLossGRPOTrainer for a few steps with fixed completions and save the final parameters (rank 0).

Run by `tests/test_trainer.py` with 1 process (`python`) and with 2 (`torchrun --nproc_per_node 2`): with the same
global batch the two must give the same parameters.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _trainer_utils import (  # noqa: E402
    BASE_ARGS,
    StatelessCompletions,
    finish_distributed,
    make_dataset,
    make_model,
    make_tokenizer,
    patch_generation,
    reward_digit,
    reward_length,
    reward_length_or_constant,
    trainable_snapshot,
)

from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-device-batch-size", type=int, required=True)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--num-iterations", type=int, default=1)
    parser.add_argument("--rl-loss", default='{"policy_loss_cfg": {"loss_type": "vanilla"}}')
    parser.add_argument("--eval-only", action="store_true", help="evaluate the untrained model, save the metrics")
    parser.add_argument(
        "--dynamic-sampling-max-rounds", type=int, default=0, help="> 0: dynamic sampling, constant-reward prompts"
    )
    cli = parser.parse_args()
    torch.set_num_threads(1)
    tok = make_tokenizer()
    model = make_model(tok)
    args = RLLossGRPOConfig(
        output_dir=os.path.join(os.path.dirname(cli.out), "run"),
        **{**BASE_ARGS, "per_device_train_batch_size": cli.per_device_batch_size, "learning_rate": 0.05},
        per_device_eval_batch_size=cli.per_device_batch_size,
        gradient_accumulation_steps=cli.grad_accum,
        max_steps=cli.steps,
        num_iterations=cli.num_iterations,
        optim="sgd",
        rl_loss=cli.rl_loss,
        dynamic_sampling=cli.dynamic_sampling_max_rounds > 0,
        dynamic_sampling_max_rounds=max(cli.dynamic_sampling_max_rounds, 1),
    )
    dynamic = cli.dynamic_sampling_max_rounds > 0
    trainer = RLLossGRPOTrainer(
        model,
        [reward_length_or_constant] if dynamic else [reward_length, reward_digit],
        args=args,
        train_dataset=make_dataset(),
        eval_dataset=make_dataset(8) if cli.eval_only else None,
        processing_class=tok,
    )
    patch_generation(trainer, tok)
    if dynamic:  # prompts are drawn again, on either rank: completions must not depend on how often one was seen
        trainer._generate_single_turn = StatelessCompletions(tok, trainer.max_completion_length)
    if cli.eval_only:
        metrics = trainer.evaluate()
        if trainer.accelerator.is_main_process:
            torch.save({"metrics": metrics, "world_size": trainer.accelerator.num_processes}, cli.out)
        finish_distributed()
        return
    trainer.train()
    if trainer.accelerator.is_main_process:
        history = [
            {k: v for k, v in h.items() if k.startswith(("loss", "train_policy/", "dynamic_sampling/"))}
            for h in trainer.state.log_history
        ]
        torch.save(
            {
                "params": trainable_snapshot(trainer.accelerator.unwrap_model(trainer.model)),
                "world_size": trainer.accelerator.num_processes,
                "history": history,
            },
            cli.out,
        )
    finish_distributed()


if __name__ == "__main__":
    main()
