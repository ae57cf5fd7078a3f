"""Every shipped accelerate config trains RLLossGRPOTrainer like DDP: DeepSpeed ZeRO-2 and ZeRO-3, and two machines.

Each launch runs `tests/engine_matrix_script.py` under `accelerate launch` with a shipped config made to run here
(`_launch.cpu_accelerate_config`: CPU, 2 processes, fp32, sharding unchanged): the tiny model trained 3 steps with a
KL to the reference and token-level rollout IS on (the second step off-policy), for `sp_size` 1 and 2 and with LoRA,
an in-memory model (under ZeRO-3 one already partitioned by `zero.Init`, as `from_pretrained` gives it). Each must
really run the configured engine, and give the per-step losses and final parameters of DDP within 1e-5.

The default run covers DDP, ZeRO-2 and ZeRO-3 (sp 1 and 2, LoRA) and saving under both. The rest of the matrix
(two machines, resuming from checkpoints) is marked `full_matrix` and runs when HF_RLLOSS_FULL_MATRIX=1 (`.ci/run`).
DeepSpeed runs on its CPU accelerator (DS_ACCELERATOR=cpu); its first launch on a machine builds a small
shared-memory op (about 2 minutes on 2 cores, cached in ~/.cache/torch_extensions).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import _launch
import pytest
import torch
from _full_matrix import full_matrix as full_matrix_mark
from _full_matrix import slow_launch

from hf_rlloss.trainer.grpo_config import RLLossGRPOConfig, precision_mismatch_warning

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "engine_matrix_script.py"
TIMEOUT = 600  # seconds per launch: about 60 s each on an idle 2-core machine (plus 2 min for the first DeepSpeed op)
TOL = 1e-5
CASES = ["sp1", "sp2", "sp1-peft"]

# name -> (accelerate config, processes, script arguments)
LAUNCHES = {
    "ddp": ("multi_process_cpu", 2, ["--cases", *CASES]),
    "zero2": ("zero2", 2, ["--cases", *CASES, "--save-dir", "saved"]),
    # ZeRO-3: the model partitioned by zero.Init before the trainer (as from_pretrained gives it), and not (plain)
    "zero3": ("zero3", 2, ["--zero3-init", "--cases", *CASES, "sp1-plain", "--save-dir", "saved"]),
    # two machines × 2 processes, launched as two machine ranks; against DDP with 4 processes on one machine
    "ddp4": ("multi_process_cpu", 4, ["--cases", "sp1", "sp2"]),
    "two_node": ("two_node_cpu", 4, ["--cases", "sp1", "sp2"]),
    # resuming: checkpoints every 2 steps of 4, then a run resumed from the first
    "zero3_ckpt": ("zero3", 2, ["--zero3-init", "--cases", "sp1", "--steps", "4", "--save-steps", "2"]),
    "zero3_resumed": ("zero3", 2, ["--zero3-init", "--cases", "sp1", "--steps", "4", "--save-steps", "2"]),
    "zero2_ckpt": ("zero2", 2, ["--cases", "sp1", "--steps", "4", "--save-steps", "2"]),
    "zero2_resumed": ("zero2", 2, ["--cases", "sp1", "--steps", "4", "--save-steps", "2"]),
}

full_matrix = full_matrix_mark("the full engine matrix")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """`runs(name)`: the launch's `{case: record}`, launched once per module."""
    root = tmp_path_factory.mktemp("engines")

    def launch(name: str) -> dict:
        config_name, processes, args = LAUNCHES[name]
        out_dir = root / name
        out_dir.mkdir()
        out = out_dir / "out.pt"
        args = [*args, "--out", str(out)]
        if "--save-dir" in args:
            args[args.index("--save-dir") + 1] = str(out_dir / "saved")
        if name.endswith("_resumed"):
            checkpoint = root / name.replace("_resumed", "_ckpt") / "run" / "sp1" / "checkpoint-2"
            get(name.replace("_resumed", "_ckpt"))
            args += ["--resume-from", str(checkpoint)]
        if config_name == "two_node_cpu":
            config = _launch.ROOT / "accelerate_configs" / "two_node_cpu.yaml"  # as shipped: it is for CPU
            results = _launch.run_all(_launch.accelerate_launch_machines(config, SCRIPT, *args), TIMEOUT, out_dir)
        else:
            config = _launch.cpu_accelerate_config(config_name, out_dir, processes)
            results = [_launch.run(_launch.accelerate_launch(config, SCRIPT, *args), TIMEOUT, out_dir)]
        for result in results:
            assert result.returncode == 0, result.stderr[-6000:]
        record = torch.load(out, weights_only=False)
        record["_dir"] = out_dir
        return record

    get = _launch.launch_once(launch)
    return get


def _param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _assert_matches(reference: dict, got: dict, case: str) -> None:
    """Same per-step losses and final parameters (1e-5), and training moved the parameters."""
    assert len(got["losses"]) == len(reference["losses"]) == got["global_step"], case
    for step, (a, b) in enumerate(zip(reference["losses"], got["losses"]), 1):
        assert abs(a - b) < TOL, (case, step, a, b)
    assert got["moved"] > 1e-3, (case, got["moved"])
    diff = _param_diff(reference["params"], got["params"])
    assert diff < TOL, (case, diff)


# ------------------------------------------------------------------------------------------------------------------
# DeepSpeed against DDP


@slow_launch
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("engine,stage", [("zero2", 2), ("zero3", 3)])
def test_deepspeed_matches_ddp(runs, engine, stage):
    ddp, got = runs("ddp"), runs(engine)
    for case in CASES:
        assert ddp[case]["engine"]["wrapper"] == "DistributedDataParallel", ddp[case]["engine"]
        info = got[case]["engine"]
        assert info["distributed_type"] == "DistributedType.DEEPSPEED" and info["wrapper"] == "DeepSpeedEngine"
        assert info["zero_stage"] == stage, info
        assert info["param_dtype"] == "torch.float32" and info["mixed_precision"] == "no", info
        if case.endswith("peft"):  # the reference is the base model with the adapter disabled
            assert info["ref_wrapper"] is None
        else:  # TRL's prepare_deepspeed: the reference sharded under ZeRO-3, a stage-0 engine otherwise
            assert info["ref_wrapper"] == "DeepSpeedEngine" and info["ref_zero_stage"] == (3 if stage == 3 else 0)
        sp_groups = [r["sp_group_ranks"] for r in got[case]["ranks"]]
        assert sp_groups == ([[0, 1], [0, 1]] if case.startswith("sp2") else [None, None])
        _assert_matches(ddp[case], got[case], f"{engine}/{case}")
    if engine == "zero3":  # an in-memory model the trainer partitions itself
        assert got["sp1-plain"]["engine"]["ref_zero_stage"] == 3
        _assert_matches(ddp["sp1"], got["sp1-plain"], "zero3/sp1-plain")
    history = [h for h in got["sp1"]["history"] if "loss" in h]
    assert history[0]["train_policy/ref_kl"] == 0 < history[1]["train_policy/ref_kl"]  # the KL really runs
    assert history[0]["rollout_is/mean"] != 1.0  # rollout IS weights really are computed


@slow_launch
@pytest.mark.distributed
@pytest.mark.slow
def test_zero3_lm_head_gathered_only_inside_the_loss(runs):
    """The chunked passes get the full tied head weight, gathered by `maybe_gather_lm_head_ctx` only for the pass:
    a head that was a shard before is a shard again after (DeepSpeed itself may keep a parameter gathered between
    uses, per `stage3_max_reuse_distance`; then the context leaves it so)."""
    for case in CASES:
        head = runs("zero3")[case]["head"]
        assert head["tied"] and head["full_shape"] == (259, 32)
        assert head["seen_in_loss"] == [(259, 32)]  # every chunked loss / log-prob pass saw the full weight
        gathers = head["gathers"]
        assert gathers and all(g["inside"] == [("AVAILABLE", (259, 32))] for g in gathers), gathers
        assert all(g["after"] == g["before"] for g in gathers), gathers
        assert any(g["before"] == ["NOT_AVAILABLE"] for g in gathers), gathers  # the context really gathered


@slow_launch
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_saved_model_loads_and_generates(runs, engine):
    """`save_model` writes a normal HF folder with the consolidated trained weights (under ZeRO-3 gathered from the
    shards), which `from_pretrained` loads and generates with."""
    from transformers import AutoModelForCausalLM

    result = runs(engine)
    saved = result["_dir"] / "saved" / "sp1"
    assert "model.safetensors" in result["sp1"]["saved"] and "config.json" in result["sp1"]["saved"]
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    trained = result["sp1"]["params"]
    loaded = dict(model.named_parameters())
    assert _param_diff(trained, {k: loaded[k].detach() for k in trained}) == 0  # the consolidated trained weights
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 7)


# ------------------------------------------------------------------------------------------------------------------
# The full matrix (HF_RLLOSS_FULL_MATRIX=1)


@full_matrix
@pytest.mark.distributed
@pytest.mark.slow
def test_two_machines_use_global_ranks(runs):
    """2 machine ranks × 2 processes: the (dp, sp) mesh is built on global ranks, and training equals DDP on one
    machine with 4 processes (sp 1 and 2)."""
    single, two = runs("ddp4"), runs("two_node")
    for case in ("sp1", "sp2"):
        ranks = two[case]["ranks"]
        assert [r["global_rank"] for r in ranks] == [r["process_index"] for r in ranks] == [0, 1, 2, 3]
        assert [r["local_process_index"] for r in ranks] == [0, 1, 0, 1]  # local ranks repeat on each machine
        assert [r["env"]["GROUP_RANK"] for r in ranks] == ["0", "0", "1", "1"]  # two machine ranks
        expected = [[0, 1], [0, 1], [2, 3], [2, 3]] if case == "sp2" else [None] * 4
        assert [r["sp_group_ranks"] for r in ranks] == expected
        assert two[case]["world_size"] == single[case]["world_size"] == 4
        _assert_matches(single[case], two[case], f"two_node/{case}")


@full_matrix
@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["zero2", "zero3"])
def test_resume_gives_the_same_next_losses(runs, engine):
    full, resumed = runs(f"{engine}_ckpt")["sp1"], runs(f"{engine}_resumed")["sp1"]
    # the resumed run trained steps 3 and 4 only (2 micro-batches each); its log history starts with the checkpoint's
    assert full["micro_steps_trained"] == 8 and resumed["micro_steps_trained"] == 4
    assert full["steps"] == resumed["steps"] == [1, 2, 3, 4]
    for step, (a, b) in enumerate(zip(full["losses"], resumed["losses"]), 1):
        assert abs(a - b) < TOL, (engine, step, a, b)
    assert _param_diff(full["params"], resumed["params"]) < TOL


# ------------------------------------------------------------------------------------------------------------------
# Single process


@pytest.mark.parametrize(
    "bf16,fp16,env,expected",
    [
        (None, False, "no", r"bf16=True \(TRL's GRPOConfig default .*\) and the accelerate config's "
         r"mixed_precision='no' disagree; training runs with mixed_precision='bf16'"),
        (False, False, "bf16", r"bf16=False and the accelerate config's mixed_precision='bf16' disagree; training "
         r"runs with mixed_precision='bf16'"),
        (False, True, "no", r"fp16=True and the accelerate config's mixed_precision='no' disagree"),
        (False, False, "no", None),
        (True, False, "bf16", None),
        (None, False, None, None),  # not launched with an accelerate config: nothing to disagree with
    ],
)  # fmt: skip
def test_precision_mismatch_warning(bf16, fp16, env, expected):
    resolved = "fp16" if fp16 else "bf16" if bf16 in (None, True) else (env or "no")
    message = precision_mismatch_warning(bf16, fp16, resolved, env)
    if expected is None:
        assert message is None
    else:
        assert message is not None and re.search(expected, message), message


def test_precision_mismatch_warns_at_construction(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    common = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    with pytest.warns(UserWarning, match=r"bf16=True \(TRL's GRPOConfig default"):
        args = RLLossGRPOConfig(**common)
    assert args.mixed_precision == "bf16"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        RLLossGRPOConfig(**common, bf16=False)


def test_zero3_partitioned_policy_without_zero3_config_is_rejected():
    """An in-memory policy already partitioned by zero.Init, but no active ZeRO-3 config: the reference cannot be
    built sharded, and the error names the alternative."""
    from _models import tiny_qwen2

    from hf_rlloss.trainer.common.engines import zero3_sharded_copy

    model = tiny_qwen2()
    for param in model.parameters():
        param.ds_id = 0  # what zero.Init leaves on each parameter
    with pytest.raises(ValueError, match=r"rl_loss.use_kl_loss: .*partitioned by deepspeed.zero.Init.*ref_model="):
        zero3_sharded_copy(model)
