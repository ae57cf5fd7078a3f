"""Train RLLossGRPOTrainer with `packing="off"` and then `"shared_prefix"` in one launch (same processes, same fixed
completions) and save, on rank 0, each run's parameters and step logs. Run by `tests/test_packing.py` under
`torchrun --nproc_per_node 2`."""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _trainer_utils import (  # noqa: E402
    BASE_ARGS,
    FixedCompletions,
    finish_distributed,
    make_model,
    make_tokenizer,
    reward_digit,
    reward_length,
    trainable_snapshot,
)
from test_packing import COMMON, make_uneven_dataset  # noqa: E402

from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    tok = make_tokenizer()
    results = {}
    for mode in ("off", "shared_prefix"):
        args = RLLossGRPOConfig(
            output_dir=os.path.join(os.path.dirname(cli.out), mode),
            packing=mode,
            **{**BASE_ARGS, **COMMON, "per_device_train_batch_size": 2, "num_generations": 4},
            rl_loss={"use_kl_loss": True, "kl_loss_type": "k3", "kl_loss_coef": 0.1},
        )
        trainer = RLLossGRPOTrainer(
            make_model(tok), [reward_length, reward_digit], args=args, train_dataset=make_uneven_dataset(),
            processing_class=tok,
        )  # fmt: skip
        trainer._generate_single_turn = FixedCompletions(tok, trainer.max_completion_length)
        trainer.train()
        results[mode] = {
            "params": trainable_snapshot(trainer.accelerator.unwrap_model(trainer.model)),
            "history": [h for h in trainer.state.log_history if "loss/total" in h],
        }
        results["world_size"] = trainer.accelerator.num_processes
    if torch.distributed.get_rank() == 0:
        torch.save(results, cli.out)
    finish_distributed()


if __name__ == "__main__":
    main()
