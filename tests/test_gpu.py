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
