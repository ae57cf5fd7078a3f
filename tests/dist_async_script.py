"""One rank of the async trainer on gloo (launched by tests/test_async_grpo.py): train 3 steps on fixed samples and,
on rank 0, save the trainable parameters and the step logs to `argv[2]`.

    python tests/dist_async_script.py <policy> <out.pt> <per_device_train_batch_size>
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _async import (  # noqa: E402
    ASYNC_ARGS,
    DIST_RL_LOSS,
    FixedRolloutWorker,
    NoWeightTransfer,
    fixed_samples,
    prompts_dataset,
)
from _trainer_utils import finish_distributed, make_tokenizer, trainable_snapshot  # noqa: E402

from hf_rlloss.trainer import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer  # noqa: E402


def train(policy: str, out_dir: str, per_device: int):
    """3 SGD steps of 8 samples (2 groups) each, with the decoupled objective, rollout IS and KL."""
    torch.set_num_threads(1)
    options = {**ASYNC_ARGS, "per_device_train_batch_size": per_device, "optim": "sgd", "learning_rate": 0.05,
               "max_grad_norm": 0.0, "max_steps": 3}  # fmt: skip
    args = RLLossAsyncGRPOConfig(output_dir=out_dir, rl_loss=DIST_RL_LOSS, **options)
    trainer = RLLossAsyncGRPOTrainer(policy, [], args, prompts_dataset(), make_tokenizer(),
                                     rollout_worker=FixedRolloutWorker(fixed_samples(8)),
                                     weight_transfer=NoWeightTransfer())  # fmt: skip
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    return trainer, trainable_snapshot(trainer.model), logs


if __name__ == "__main__":
    policy, out, per_device = sys.argv[1], sys.argv[2], int(sys.argv[3])
    trainer, params, logs = train(policy, out + ".run", per_device)
    if trainer.accelerator.is_main_process:
        torch.save({"params": params, "logs": logs, "world": trainer.accelerator.num_processes}, out)
    finish_distributed()
