"""CUDA checks (skipped without a GPU): the chunked kernel gives the CPU path's numbers, bf16 included; both trainers
give stock TRL's update on the GPU. `make gpu-check` runs them (its `cuda_tests` step); with
`HF_RLLOSS_GPU_CHECK_DEVICE=cpu` the trainer checks run on the CPU instead, the check's rehearsal in the default suite
(tests/test_gpu_check.py)."""

import os

import pytest
import torch
from _data import make_step, run_step

from hf_rlloss import GRPOLossConfig

DEVICE = os.environ.get("HF_RLLOSS_GPU_CHECK_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="compares the CUDA kernel with the CPU path")


@cuda_only
@pytest.mark.parametrize("loss_type", ["vanilla", "gspo", "geo_mean"])
def test_cuda_hidden_path_matches_cpu(loss_type):
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": loss_type}, use_kl_loss=True, kl_loss_type="k3", chunk_size=4)
    step = make_step(seed=3)
    cpu = run_step(cfg, step, [list(range(8))], "hidden")
    cuda_step = {k: v.cuda() for k, v in step.items()}
    gpu = run_step(cfg, cuda_step, [list(range(8))], "hidden")
    for a, b in zip(cpu[:3], gpu[:3]):
        torch.testing.assert_close(a, b.cpu(), atol=1e-8, rtol=1e-8)


@cuda_only
def test_cuda_bf16_hidden_states_close_to_fp32():
    step = {k: (v.float() if v.is_floating_point() else v) for k, v in make_step(seed=4).items()}
    cfg = GRPOLossConfig()
    ref = run_step(cfg, {k: v.cuda() for k, v in step.items()}, [list(range(8))], "hidden")
    bf16 = {k: (v.cuda().bfloat16() if k in ("h", "w") else v.cuda()) for k, v in step.items()}
    low = run_step(cfg, bf16, [list(range(8))], "hidden")
    torch.testing.assert_close(low[0].float(), ref[0].float(), atol=5e-2, rtol=5e-2)


# ------------------------------------------------------------------------------------------------------------------
# The synchronous trainer against stock TRL on the device, fixed completions, fp32 and bf16, packing off and on.


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("packing", ["auto", "off", "shared_prefix"])
def test_sync_trainer_gives_stock_trls_update_on_the_device(tmp_path, precision, packing):
    """`RLLossGRPOTrainer` configured as TRL against stock `GRPOTrainer`, the same model and completions, two SGD
    steps on DEVICE: the same parameters (fp32: to round-off; bf16 autocast: within 5% of how far they moved)."""
    from _trainer_utils import BASE_ARGS, make_model, make_tokenizer, train_fixed
    from trl import GRPOConfig, GRPOTrainer

    from hf_rlloss.trainer import RLLossGRPOConfig

    tok = make_tokenizer()
    options = {**BASE_ARGS, "use_cpu": DEVICE == "cpu", "bf16": precision == "bf16", "max_steps": 2, "optim": "sgd",
               "learning_rate": 0.05, "max_grad_norm": 0.0, "lr_scheduler_type": "constant"}  # fmt: skip
    _, before, stock = train_fixed(tok, GRPOConfig(output_dir=str(tmp_path / "trl"), **options), make_model(tok),
                                   GRPOTrainer)  # fmt: skip
    args = RLLossGRPOConfig(output_dir=str(tmp_path / "ours"), packing=packing, **options)
    trainer, _, ours = train_fixed(tok, args, make_model(tok))
    assert next(trainer.model.parameters()).device.type == DEVICE  # it trained where it was asked to
    assert trainer._packing in ("off", "shared_prefix")
    moved = max((stock[k] - before[k]).abs().max().item() for k in before)
    diff = max((stock[k] - ours[k]).abs().max().item() for k in before)
    assert moved > 1e-3, "the parameters hardly moved: the comparison would be vacuous"
    assert diff <= (1e-5 if precision == "fp32" else 0.05 * moved), (diff, moved)


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
