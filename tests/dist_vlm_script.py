"""Train RLLossGRPOTrainer on a tiny VLM (`tests/_vlm.py`) for a few steps with fixed completions and save the final
parameters (rank 0).

Run by `tests/test_vlm.py` with 1 process (`python`) and with 2 (`torchrun --nproc_per_node 2`, DDP): with the same
global batch the two must give the same parameters.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _trainer_utils import BASE_ARGS, finish_distributed, trainable_snapshot  # noqa: E402
from _vlm import make_trainer, make_vlm  # noqa: E402

from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a key of _vlm.VLMS")
    parser.add_argument("--out", required=True)
    parser.add_argument("--per-device-batch-size", type=int, required=True)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    processor, make_model, image_specials = make_vlm(cli.model)
    args = RLLossGRPOConfig(
        output_dir=os.path.join(os.path.dirname(cli.out), "run"),
        **{**BASE_ARGS, "per_device_train_batch_size": cli.per_device_batch_size, "learning_rate": 0.05},
        gradient_accumulation_steps=2,
        max_steps=2,
        num_iterations=2,  # the second step is off-policy: old log-probs from the no-grad pass
        optim="sgd",
        beta=0.1,  # reference log-probs of the in-memory policy's copy, with the images
    )
    trainer = make_trainer(RLLossGRPOTrainer, args, processor, make_model, image_specials)
    trainer.train()
    if trainer.accelerator.is_main_process:
        params = trainable_snapshot(trainer.accelerator.unwrap_model(trainer.model))
        steps = [h for h in trainer.state.log_history if "loss/total" in h]
        run = {"world_size": trainer.accelerator.num_processes, "ddp": type(trainer.model_wrapped).__name__}
        torch.save({"params": params, "steps": steps, **run}, cli.out)
    finish_distributed()


if __name__ == "__main__":
    main()
