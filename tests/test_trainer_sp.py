"""RLLossGRPOTrainer with sequence parallelism (`sp_size > 1`, Ulysses) on CPU/gloo.

The distributed tests launch `tests/dist_trainer_sp_script.py` through torchrun (with a hard timeout): sp=2 on 2
processes and dp=2 × sp=2 on 4 must give the same losses, metrics and parameters as one process with the same global
batch (fixed completions, SGD, 2 optimizer steps, the second off-policy) for vanilla, GSPO (with gradient
checkpointing) and sequence-level rollout IS with a KL, on a GQA model with 1 key/value head and odd packed lengths,
with each prompt forwarded once per micro-batch (`packing="shared_prefix"`, the default); vanilla also with
`"padding_free"` and `"off"`, which give the same parameters.
"""

from __future__ import annotations

import os
import re
import sys

import _launch
import pytest
import torch
from _full_matrix import SLOW_LAUNCH

from hf_rlloss.trainer import RLLossGRPOConfig
from hf_rlloss.trainer.common.packing import pack_rows

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "dist_trainer_sp_script.py")
TIMEOUT = 480  # seconds per launch; 4 processes on 2 cores take about 30 s when the machine is idle

# name -> (processes, sp_size, per_device_train_batch_size, per_device_eval_batch_size): one global batch of 8
# sequences per optimizer step (2 micro-batches of 4, per SP group or process) and one eval batch of 8 completions.
# TRL's names (issue 25), logged per micro-batch: compared where the micro-batches hold the same rows (sp2)
TRL_KEYS = ("clip_ratio/", "entropy", "policy_loss", "kl")
RUNS = {
    "one": (1, 1, 4, 8),
    "sp2": (2, 2, 4, 4),
    "dp2xsp2": (4, 2, 2, 2),
}


def _launch_run(name: str, out_dir) -> dict:
    procs, sp, per_device, per_eval = RUNS[name]
    out = out_dir / f"{name}.pt"
    cmd = [
        *_launch.torchrun(procs),
        SCRIPT,
        "--out",
        str(out),
        "--sp",
        str(sp),
        "--per-device-batch-size",
        str(per_device),
        "--eval-batch-size",
        str(per_eval),
    ]
    if name == "sp2":
        cmd.append("--check-errors")
    result = _launch.run(cmd, timeout=TIMEOUT, cwd=out_dir)
    assert result.returncode == 0, result.stderr[-6000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("sp_runs")
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            cache[name] = _launch_run(name, out_dir)
        return cache[name]

    return get


def _initial_params():
    sys.path.insert(0, HERE)
    from _trainer_utils import make_tokenizer, trainable_snapshot
    from dist_trainer_sp_script import make_model

    return trainable_snapshot(make_model(make_tokenizer()))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", ["sp2", pytest.param("dp2xsp2", marks=SLOW_LAUNCH)])
def test_sequence_parallel_matches_one_process(runs, name):
    reference, result = runs("one"), runs(name)
    assert reference["world_size"] == 1 and result["world_size"] == RUNS[name][0]
    initial = _initial_params()
    cases = {"vanilla", "gspo", "rollout_is_seq", "dynamic_sampling", "vanilla:padding_free", "vanilla:off", "tools"}
    assert reference["cases"].keys() == result["cases"].keys() == cases
    for case, ref in reference["cases"].items():
        got = result["cases"][case]
        initial = ref["initial"]
        assert all(torch.equal(initial[k], got["initial"][k]) for k in initial)
        # the one-process reference trains packed (packing's default, shared_prefix: docs/packing.md) unless off
        assert got["attn"] == "ulysses_sdpa" and ref["attn"] == ("sdpa" if case == "vanilla:off" else "tree_or_sdpa")
        moved = max((ref["params"][k] - initial[k]).abs().max().item() for k in initial)
        assert moved > 1e-3, (case, moved)
        diff = max((ref["params"][k] - got["params"][k]).abs().max().item() for k in initial)
        assert diff < 1e-5, (case, diff)
        assert got["packed_lengths"], case
        ref_steps = [h for h in ref["history"] if "loss/total" in h]
        got_steps = [h for h in got["history"] if "loss/total" in h]
        assert len(ref_steps) == len(got_steps) == 2
        ref_evals = [h for h in ref["history"] if "eval_loss/total" in h]
        got_evals = [h for h in got["history"] if "eval_loss/total" in h]
        assert len(ref_evals) == len(got_evals) == (case == "vanilla")  # an evaluation at the end
        ref_steps, got_steps = ref_steps + ref_evals, got_steps + got_evals
        for a, b in zip(ref_steps, got_steps):
            assert a.keys() == b.keys(), (case, sorted(a.keys() ^ b.keys()))
            tokens = "train_policy/valid_tokens" if "loss" in a else "eval_train_policy/valid_tokens"
            assert a[tokens] == b[tokens] > 0
            if "loss" in a:  # the Trainer's logged loss is the step's global loss
                assert abs(a["loss"] - b["loss"]) < 1e-5, (case, a["loss"], b["loss"])
            for key in a:
                if key.startswith("packing/"):  # positions forwarded: they depend on how rows are grouped
                    continue
                if name != "sp2" and key.startswith(TRL_KEYS):
                    continue  # per micro-batch: with 2 DP ranks a micro-batch holds other rows than one process's
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (case, key, a[key], b[key])
    # odd packed lengths: the last SP shard is padded (padding-free rows here; tree rows in test_ulysses.py)
    assert any(n % 2 for case in result["cases"].values() for n in case["packed_lengths"])
    # every packing mode gives the same update under SP; shared prefixes forward fewer positions
    initial = _initial_params()
    for mode in ("vanilla:padding_free", "vanilla:off"):
        diff = max(
            (result["cases"]["vanilla"]["params"][k] - result["cases"][mode]["params"][k]).abs().max() for k in initial
        )
        assert diff < 1e-6, (mode, diff)

    def forwarded(case, key="packing/forwarded_tokens"):
        return sum(h[key] for h in result["cases"][case]["history"] if "loss" in h)

    assert forwarded("vanilla") < forwarded("vanilla:padding_free") == forwarded("vanilla:off")
    assert forwarded("vanilla:padding_free") < forwarded("vanilla", "packing/padded_tokens")
    # the second step is off-policy (num_iterations=2: old log-probs from the SP no-grad pass), and it trains
    for case in ("vanilla", "gspo"):
        second = [h for h in result["cases"][case]["history"] if "loss" in h][1]
        assert second["train_policy/ratio_abs_dev_mean"] > 1e-3
    gspo = [h for h in result["cases"]["gspo"]["history"] if "loss" in h][1]
    assert 0 < gspo["train_policy/clip_frac_low"] + gspo["train_policy/clip_frac_high"] < 1
    # sequence-level rollout IS rejected some whole sequences, and kept others
    first = [h for h in result["cases"]["rollout_is_seq"]["history"] if "loss" in h][0]
    assert 0 < first["rollout_is/seq_masked_fraction"] < 1
    assert first["rollout_is/masked_fraction"] > 0 and "train_policy/ref_kl" in first
    # dynamic sampling refilled and dropped groups alike (the metrics were compared above), with rollout IS
    first = [h for h in result["cases"]["dynamic_sampling"]["history"] if "loss" in h][0]
    assert first["dynamic_sampling/rounds"] > 1 and first["dynamic_sampling/groups_kept"] == 4, first
    assert "rollout_is/mean" in first
    # multi-turn: half of the conversations called the tool; the replies' tokens are in the rows but not trained
    first = [h for h in result["cases"]["tools"]["history"] if "loss" in h][0]
    assert (
        first["tools/call_frequency"] == 0.5 and first["packing/forwarded_tokens"] > first["train_policy/valid_tokens"]
    )


@pytest.mark.distributed
@pytest.mark.slow
def test_bad_sequence_parallel_construction(runs):
    errors = runs("sp2")["errors"]
    expected = {
        "sp_not_dividing": r"sp_size=3 must divide the number of processes \(2\)",
        "batch_not_divisible": r"per_device_train_batch_size × steps_per_generation .* divisible by sp_size",
        "vllm_is_correction": r"vllm_importance_sampling_correction=False",
        "continuous_batching": r"use_transformers_continuous_batching",
        "heads_not_divisible": r"has 3 attention heads, not divisible by sp_size",
        "flex_attention": r"attn_implementation='flex_attention', which the Ulysses attention cannot wrap",
        "flash_attention_2": r"attn_implementation='flash_attention_2', which the Ulysses attention cannot wrap",
    }
    for name, pattern in expected.items():
        assert re.search(pattern, errors[name]), (name, errors[name])
    assert errors["good"] == ""


# ------------------------------------------------------------------------------------------------------------------
# Single process


@pytest.mark.parametrize(
    "options,match",
    [
        ({"sp_size": 2}, r"sp_size=2 needs 2 or a multiple of 2 processes, but this is a single process"),
        ({"sp_size": 0}, r"sp_size=0 must be an integer >= 1"),
        ({"sp_size": 2, "generation_batch_size": 8}, r"set steps_per_generation instead of generation_batch_size"),
    ],
)
def test_bad_sp_config(tmp_path, options, match):
    with pytest.raises(ValueError, match=match):
        RLLossGRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **options)


def test_pack_rows():
    pad = 0
    prompt_ids = torch.tensor([[pad, 11, 12], [21, 22, 23], [pad, pad, 31]])
    prompt_mask = (prompt_ids != pad).long()
    completion_ids = torch.tensor([[13, 14, pad], [24, pad, pad], [32, 33, 34]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2: a masked (truncated) completion
    packed = pack_rows(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert packed.input_ids.tolist() == [[11, 12, 13, 14, 21, 22, 23, 24, 31]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0]]
    assert packed.num_tokens.tolist() == [4, 4, 1]
    labels = packed.pack(completion_ids.masked_fill(completion_mask == 0, -100), -100)
    assert labels.tolist() == [[-100, 13, 14, -100, -100, -100, 24, -100, -100]]
    # every label is the next packed token, inside its own sequence
    valid = labels[0] != -100
    assert torch.equal(labels[0][valid], packed.input_ids[0][1:][valid[:-1]])
    values = torch.arange(9, dtype=torch.float32).reshape(3, 3) + 1
    assert packed.unpack(packed.pack(values, 0.0), (3, 3)).tolist() == (values * completion_mask).tolist()
    # a sequence without prompt: its first completion token is predicted from nothing and gets no label
    empty = pack_rows(torch.zeros(1, 0, dtype=torch.long), torch.zeros(1, 0), torch.tensor([[5, 6]]), torch.ones(1, 2))
    assert empty.label_index.tolist() == [0] and empty.cols.tolist() == [1]
