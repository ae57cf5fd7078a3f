"""One vLLM run of `tests/test_vllm.py`, in a process of its own (vLLM binds OpenMP threads and replaces
`torch.set_num_threads` in the process that runs it).

    python tests/vllm_script.py CASE MODEL_DIR OUT_JSON

CASE: `trl` (stock TRL `GRPOTrainer`, colocate), `ours` (`RLLossGRPOTrainer`, colocate, TRL's vLLM IS correction and
the loss layer's metrics-only rollout IS, KL to the reference; then the weight-sync check), `is` (`RLLossGRPOTrainer`
with `rl_loss.rollout_is` under top-k sampling and dynamic sampling, the IS weights recorded), `async` (the async
trainer with the vLLM rollout worker), `multiturn` (the vLLM rollout worker's tool loop). MODEL_DIR is a tiny policy
saved by `tests/test_vllm.py`.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: the tiny model needs little
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # a shared machine: do not pin cores
# vLLM's CPU switch for its own CI: trace the model once and run it eagerly instead of compiling it with inductor
# (minutes per engine on 2 cores, for a tiny model)
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _trainer_utils import BASE_ARGS, make_dataset, reward_digit, reward_length  # noqa: E402

STEPS = 3
ARGS = {
    **BASE_ARGS,
    "learning_rate": 1e-2,  # large (Adam), so that a step changes the log-probs well beyond vLLM's bf16 rounding
    "max_steps": STEPS,
    "use_vllm": True,
    "vllm_mode": "colocate",
    "vllm_max_model_length": 128,
}


def _logs(trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


def _trainer_logprobs(model, ids: list[int], temperature: float) -> torch.Tensor:
    """The trained policy's log-probs of `ids[1:]` given the tokens before each (float32)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def _vllm_logprobs(llm, ids: list[int]) -> torch.Tensor:
    """vLLM's log-probs of `ids[1:]` (its prompt log-probs: the model's distribution, temperature 1)."""
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return torch.tensor([entry[t].logprob for t, entry in zip(ids[1:], out[0].prompt_logprobs[1:])])


def weight_sync_check(trainer, initial_dir: str) -> dict:
    """After training, the engine's log-probs of a fixed sequence against the trainer's (synced weights) and against
    the model as loaded from disk (what the engine would hold had no sync happened)."""
    from transformers import AutoModelForCausalLM

    trainer.vllm_generation.sync_weights()  # TRL syncs before each generation; the last step's update is not yet in
    llm = trainer.vllm_generation.llm
    tok = trainer.processing_class
    ids = tok("Q03: add 3+3 = 6 and then 7", add_special_tokens=False)["input_ids"]
    state = {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}

    def trained_model(dtype):  # a plain copy of the trained policy (the trainer's own has TRL's patched forward)
        model = AutoModelForCausalLM.from_pretrained(initial_dir, dtype=dtype)
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
        return model.eval()

    engine = _vllm_logprobs(llm, ids)
    trained = _trainer_logprobs(trained_model(torch.float32), ids, 1.0)
    initial = _trainer_logprobs(AutoModelForCausalLM.from_pretrained(initial_dir, dtype=torch.float32), ids, 1.0)
    # the sampler's precision: the same trained weights evaluated in bf16, as vLLM does on CPU
    bf16 = _trainer_logprobs(trained_model(torch.bfloat16), ids, 1.0)
    return {
        "bf16_vs_trainer": (bf16 - trained).abs().max().item(),
        "synced_vs_trainer": (engine - trained).abs().max().item(),
        "trainer_vs_initial": (trained - initial).abs().max().item(),
        "engine_vs_initial": (engine - initial).abs().max().item(),
    }


def run_trl(model_dir: str, out_dir: str) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    from hf_rlloss.trainer.sync.vllm import prepare_vllm_engine

    args = GRPOConfig(output_dir=out_dir, **ARGS)
    prepare_vllm_engine(args)  # the CPU shim, without which stock TRL's first weight sync fails on CPU
    trainer = GRPOTrainer(model_dir, [reward_length, reward_digit], args=args, train_dataset=make_dataset())
    trainer.train()
    return {"logs": _logs(trainer)}


def run_ours(model_dir: str, out_dir: str) -> dict:
    from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer
    from hf_rlloss.trainer.sync.vllm import shutdown_vllm_engine

    args = RLLossGRPOConfig(
        output_dir=out_dir,
        **ARGS,
        rl_loss={"use_kl_loss": True, "kl_loss_coef": 0.01, "kl_loss_type": "low_var_kl"},
    )
    trainer = RLLossGRPOTrainer(model_dir, [reward_length, reward_digit], args=args, train_dataset=make_dataset())
    trainer.train()
    result = {"logs": _logs(trainer), "sync": weight_sync_check(trainer, model_dir), "packing": trainer._packing}
    # the recipes' end: the engine shut down, then every process group destroyed (the test reads stderr for vLLM's
    # teardown error at interpreter exit)
    shutdown_vllm_engine(trainer)
    trainer.accelerator.end_training()
    return result


def run_is(model_dir: str, out_dir: str) -> dict:
    """Rollout IS on (token level, truncated at 2) under top-k sampling; each micro-batch's vLLM log-probs, old
    log-probs, kept mass and the IS weights the loss layer computed from them are recorded."""
    from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer

    records = []

    class Recording(RLLossGRPOTrainer):
        def build_loss_context(self, inputs):
            ctx = super().build_loss_context(inputs)
            mask = inputs["completion_mask"].bool()
            records.append(
                {
                    "rollout": inputs["sampling_per_token_logps"][mask].tolist(),
                    "old": inputs["old_per_token_logps"][mask].tolist(),
                    "old_kept": inputs["old_kept_logmass"][mask].tolist(),
                    "weights": ctx.loss_kwargs.rollout_is_weights[mask].tolist(),
                }
            )
            return ctx

    args = RLLossGRPOConfig(
        output_dir=out_dir,
        **{**ARGS, "max_steps": 2},
        top_k=20,
        rollout_logprobs_support="sampled",
        vllm_importance_sampling_correction=False,
        rl_loss={"rollout_is": {"level": "token", "mode": "truncate", "upper": 2.0}},
        dynamic_sampling=True,
    )
    trainer = Recording(model_dir, [reward_length, reward_digit], args=args, train_dataset=make_dataset())
    trainer.train()
    return {"logs": _logs(trainer), "records": records}


def run_async(model_dir: str, out_dir: str) -> dict:
    """`RLLossAsyncGRPOTrainer` with `VLLMRolloutWorker` (float32 engine, as the trainer: `ASYNC_ARGS`' dtype), rollout
    IS on; then stock TRL's `AsyncGRPOTrainer` with the same worker (its keys are compared)."""
    from _async import ASYNC_ARGS
    from transformers import AutoTokenizer

    from hf_rlloss.trainer import RLLossAsyncGRPOConfig, RLLossAsyncGRPOTrainer
    from hf_rlloss.trainer.async_.rollout import QueueWeightTransfer, VLLMRolloutWorker

    tok = AutoTokenizer.from_pretrained(model_dir)
    rewards = [reward_length, reward_digit]
    options = {**ASYNC_ARGS, "max_staleness": 1, "learning_rate": 1e-2, "max_steps": STEPS}
    args = RLLossAsyncGRPOConfig(
        output_dir=out_dir, queue_maxsize=4, heartbeat_stale_after_s=300, **options,
        rl_loss={"rollout_is": {"level": "token", "upper": 2.0}},
    )  # fmt: skip
    worker = VLLMRolloutWorker(model_dir, make_dataset(), rewards, tok, args, max_model_len=128)
    trainer = RLLossAsyncGRPOTrainer(model_dir, rewards, args, make_dataset(), tok, rollout_worker=worker,
                                     weight_transfer=QueueWeightTransfer(worker))  # fmt: skip
    trainer.train()
    state = {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}
    return {"logs": _logs(trainer), "reload": worker_reload_check(worker, model_dir, state)}


def worker_reload_check(worker, model_dir: str, state: dict) -> dict:
    """The worker's engine loop, run here once training is over: its engine's log-probs of a fixed sequence before
    and after the trained weights arrive the way `QueueWeightTransfer` sends them (`LatestWeights.publish`), against
    transformers' (float32)."""
    import multiprocessing
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_rlloss.trainer.async_.rollout.channel import LatestWeights
    from hf_rlloss.trainer.async_.rollout.vllm import VLLMWorkerLoop

    weights = LatestWeights(multiprocessing.get_context("spawn"))
    loop = VLLMWorkerLoop(worker._settings, None, None, weights, None, SimpleNamespace(value=0.0))
    loop.load()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok("Q03: add 3+3 = 6 and then 7", add_special_tokens=False)["input_ids"]
    before = _vllm_logprobs(loop.llm, ids)
    weights.publish(1, iter(state.items()))
    loop._apply_weights(block=False)
    after = _vllm_logprobs(loop.llm, ids)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(state)
    trained = _trainer_logprobs(model.eval(), ids, 1.0)
    return {
        "version": loop.version,
        "loaded_vs_trained": (after - trained).abs().max().item(),
        "initial_vs_trained": (before - trained).abs().max().item(),
    }


def run_multiturn(model_dir: str, out_dir: str) -> dict:
    """`VLLMRolloutWorker`'s loop with `tools=[multiply]`, in this process: the first turn scripted (half of each group
    calls the tool, `_tools.ScriptedToolRollout`), every later turn sampled by the engine (float32). Returns the
    samples' tokens, masks and behaviour log-probs, and transformers' float32 log-probs of the same tokens."""
    import queue

    from _async import ASYNC_ARGS
    from _tools import PAIRS, ScriptedToolRollout, multiply, reward_correct, tool_tokenizer
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from hf_rlloss.trainer import RLLossAsyncGRPOConfig
    from hf_rlloss.trainer.async_.rollout.vllm import VLLMRolloutWorker, VLLMWorkerLoop

    tok = tool_tokenizer()
    path = os.path.join(out_dir, "tool-policy")
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, **ids)  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    options = {**ASYNC_ARGS, "max_completion_length": 200, "max_tool_calling_iterations": 1}
    args = RLLossAsyncGRPOConfig(output_dir=out_dir, **options)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} times {b}?"}], "product": a * b} for a, b in PAIRS]
    worker = VLLMRolloutWorker(path, rows, [reward_correct], tok, args, tools=[multiply], max_model_len=512)
    loop = VLLMWorkerLoop(worker._settings, None, queue.Queue(), None, None, None)
    loop.load()
    loop.version = 1
    engine, script, calls = loop._generate_ids, ScriptedToolRollout(loop.s.tokenizer, logprobs=True), []

    def generate(prompt_ids, seed, budgets=None):
        calls.append(len(prompt_ids))
        return script(prompt_ids) if len(calls) == 1 else engine(prompt_ids, seed, budgets)

    loop._generate_ids = generate
    samples = loop._generate_batch()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = {"calls": calls, "samples": []}
    for sample in samples:
        tokens = sample.input_ids.tolist()
        out["samples"].append({
            "input_ids": tokens, "completion_mask": sample.completion_mask.tolist(),
            "old_log_probs": sample.old_log_probs.tolist(), "hf": _trainer_logprobs(model, tokens, 1.0).tolist(),
            "text": tok.decode(tokens),
        })  # fmt: skip
    return out


CASES = {"trl": run_trl, "ours": run_ours, "is": run_is, "async": run_async, "multiturn": run_multiturn}

if __name__ == "__main__":
    case, model_dir, out = sys.argv[1:4]
    start = time.time()
    result = CASES[case](model_dir, os.path.join(os.path.dirname(out), f"run-{case}"))
    result["seconds"] = time.time() - start
    with open(out, "w") as f:
        json.dump(result, f)
