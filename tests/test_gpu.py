"""CUDA checks of the chunked kernel (skipped without a GPU): the same numbers as the CPU path, bf16 included."""

import pytest
import torch
from _data import make_step, run_step

from hf_rlloss import GRPOLossConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("loss_type", ["vanilla", "gspo", "geo_mean"])
def test_cuda_hidden_path_matches_cpu(loss_type):
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": loss_type}, use_kl_loss=True, kl_loss_type="k3", chunk_size=4)
    step = make_step(seed=3)
    cpu = run_step(cfg, step, [list(range(8))], "hidden")
    cuda_step = {k: v.cuda() for k, v in step.items()}
    gpu = run_step(cfg, cuda_step, [list(range(8))], "hidden")
    for a, b in zip(cpu[:3], gpu[:3]):
        torch.testing.assert_close(a, b.cpu(), atol=1e-8, rtol=1e-8)


def test_cuda_bf16_hidden_states_close_to_fp32():
    step = {k: (v.float() if v.is_floating_point() else v) for k, v in make_step(seed=4).items()}
    cfg = GRPOLossConfig()
    ref = run_step(cfg, {k: v.cuda() for k, v in step.items()}, [list(range(8))], "hidden")
    bf16 = {k: (v.cuda().bfloat16() if k in ("h", "w") else v.cuda()) for k, v in step.items()}
    low = run_step(cfg, bf16, [list(range(8))], "hidden")
    torch.testing.assert_close(low[0].float(), ref[0].float(), atol=5e-2, rtol=5e-2)


# ------------------------------------------------------------------------------------------------------------------
# Async GRPO (issue 22): the loss layer on TRL's packed rows on CUDA, and TRL's own vLLM worker + NCCL transfer.


def _async_parity_on_cuda(tmp_path, tree_attention):
    """RLLossAsyncGRPOTrainer configured as TRL vs stock AsyncGRPOTrainer on CUDA, float32, same injected samples."""
    from _async import (
        ASYNC_ARGS,
        FixedRolloutWorker,
        NoWeightTransfer,
        fixed_samples,
        prompts_dataset,
        save_tiny_policy,
    )
    from _trainer_utils import make_tokenizer, trainable_snapshot
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from hf_rlloss.trainer import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer
    from hf_rlloss.trainer.async_grpo_trainer import portable_async_trl

    policy, tok = save_tiny_policy(tmp_path / "policy"), make_tokenizer()
    options = {**ASYNC_ARGS, "use_cpu": False, "optim": "sgd", "learning_rate": 0.05, "max_grad_norm": 0.0,
               "max_steps": 3, "lr_scheduler_type": "constant", "epsilon_high": 0.28}  # fmt: skip
    runs = []
    for cls, args in (
        (AsyncGRPOTrainer, AsyncGRPOConfig(output_dir=str(tmp_path / "trl"), **options)),
        (RLLossAsyncGRPOTrainer, RLLossAsyncGRPOConfig(output_dir=str(tmp_path / "ours"), behavior_as_old_policy=True,
                                                       tree_attention=tree_attention, **options)),
    ):  # fmt: skip
        # stock TRL gets the portable tree attention unless the FA3 kernel is asked for
        with portable_async_trl("cuda" if tree_attention == "fa3" else "cpu"):
            worker = FixedRolloutWorker(fixed_samples(4))
            trainer = cls(policy, [], args, prompts_dataset(), tok, rollout_worker=worker,
                          weight_transfer=NoWeightTransfer())  # fmt: skip
        before = trainable_snapshot(trainer.model)
        trainer.train()
        runs.append((before, trainable_snapshot(trainer.model)))
    (before, stock), (_, ours) = runs
    assert max((stock[k] - before[k]).abs().max().item() for k in before) > 1e-3
    return max((stock[k] - ours[k]).abs().max().item() for k in before)


def test_cuda_async_configured_as_trl_equals_stock(tmp_path):
    assert _async_parity_on_cuda(tmp_path, "sdpa") < 1e-5


def test_cuda_async_fa3_tree_attention(tmp_path):
    """TRL's FlashAttention-3 tree kernel (from the Hub, `kernels`): our loss on its rows equals stock TRL's."""
    pytest.importorskip("kernels")
    try:
        from trl.experimental.async_grpo.packing import _flash_attn

        _flash_attn()
    except Exception as err:  # noqa: BLE001 - no Hub access or no Hopper GPU: nothing to compare with
        pytest.skip(f"TRL's FA3 kernel is not available here: {err}")
    assert _async_parity_on_cuda(tmp_path, "fa3") < 1e-5


@pytest.mark.skipif(
    not __import__("os").environ.get("HF_RLLOSS_VLLM_URL"),
    reason="needs a vLLM server (`trl vllm-serve --model $HF_RLLOSS_VLLM_MODEL`) at HF_RLLOSS_VLLM_URL",
)
def test_cuda_async_with_trl_vllm_worker_and_nccl_transfer(tmp_path):
    """TRL's default rollout worker (vLLM) and NCCL weight transfer, unchanged, with the loss layer's decoupled
    objective: two steps train, the sampler's log-probs reach rollout IS (finite mismatch metrics)."""
    import os

    from datasets import Dataset

    from hf_rlloss.recipe_support.rewards import accuracy_reward
    from hf_rlloss.trainer import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer

    pytest.importorskip("vllm")
    args = RLLossAsyncGRPOConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=16, vllm_server_base_url=os.environ["HF_RLLOSS_VLLM_URL"], report_to="none",
        rl_loss={"rollout_is": {"level": "token", "upper": 2.0}}, bf16=True,
    )  # fmt: skip
    prompts = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(16)]
    data = Dataset.from_dict({"prompt": prompts, "answer": [2 * i for i in range(16)]})
    trainer = RLLossAsyncGRPOTrainer(os.environ["HF_RLLOSS_VLLM_MODEL"], [accuracy_reward], args, data)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    assert len(logs) == 2
    assert all(0 <= log["mismatch/mismatch_k3_kl"] < 1.0 for log in logs)
