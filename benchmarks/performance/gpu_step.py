"""Whole optimizer steps on one device: `RLLossGRPOTrainer` against stock `GRPOTrainer`, on the same fixed completions,
each step timed between `torch.cuda.synchronize()` calls, the peak of `torch.cuda.max_memory_allocated`.

`make gpu-check` runs it on CUDA with a randomly initialised 0.5B-class Qwen2 (hidden 896, 24 layers, 151,936-token
vocabulary) trained in bf16 on 512-token completions; `--device cpu --model tiny` is its rehearsal. Generation is
replaced by the same fixed completions in every variant (what is timed is the training step: scoring, the old and
reference passes when configured, the loss forward and backward, the optimizer). Every variant runs in a fresh
subprocess, the variants interleaved within each repeat; a run's first step (allocator, kernels) is not timed.

* `trl`: stock `GRPOTrainer`, TRL's defaults;
* `hf_rlloss`: `RLLossGRPOTrainer`, TRL's defaults and `packing="auto"` (the padded forward on CUDA without
  flash-attn);
* `hf_rlloss_shared_prefix`: the same with `packing="shared_prefix"`.

    python -m benchmarks.performance.gpu_step --device cuda --out outputs/gpu-check/gpu_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

from benchmarks.shared.launch import python_module
from benchmarks.shared.provenance import ROOT, provenance

VARIANTS = ("trl", "hf_rlloss", "hf_rlloss_shared_prefix")
MODELS = {  # Qwen2 shapes: a randomly initialised 0.5B-class model, and a tiny one for the CPU rehearsal
    "qwen2_0.5b_random": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),  # fmt: skip
    "tiny": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),  # fmt: skip
}
# The package modules this benchmark measures: its results are stale once they change.
MEASURES = ("hf_rlloss/loss", "hf_rlloss/trainer", "hf_rlloss/parallel")


def run_variant(variant: str, model_name: str, device: str, steps: int, length: int, batch: int) -> dict:
    """`steps` optimizer steps of `variant` on `device`; the synchronized time of each and the peak memory."""
    import torch
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.shared.tiny_models import make_tokenizer, special_token_ids
    from hf_rlloss import RLLossGRPOConfig, RLLossGRPOTrainer

    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    tokenizer = make_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(**MODELS[model_name], max_position_embeddings=length + 64, tie_word_embeddings=True,
                         **special_token_ids(tokenizer))  # fmt: skip
    model = Qwen2ForCausalLM(config)
    dataset = Dataset.from_list([{"prompt": f"Q{i}: what is {i} + {i}?"} for i in range(64)])
    common = dict(
        output_dir=os.path.join(ROOT, "outputs", "gpu_step", variant), use_cpu=not cuda, bf16=cuda, max_steps=steps,
        per_device_train_batch_size=batch, num_generations=batch, max_completion_length=length, learning_rate=1e-6,
        logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    reward = lambda completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    if variant == "trl":
        trainer = GRPOTrainer(model, reward, args=GRPOConfig(**common), train_dataset=dataset,
                              processing_class=tokenizer)  # fmt: skip
    else:
        packing = "shared_prefix" if variant == "hf_rlloss_shared_prefix" else "auto"
        args = RLLossGRPOConfig(**common, packing=packing)
        trainer = RLLossGRPOTrainer(model, reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    g = torch.Generator().manual_seed(1)  # the same completions in every variant: full length, random tokens
    low, high = 16, len(tokenizer)

    def fixed(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [torch.randint(low, high, (length,), generator=g).tolist() for _ in prompt_ids], None

    trainer._generate_single_turn = fixed
    times: list[float] = []

    class Synchronized(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            sync()
            times.append(time.perf_counter() - self.start)

    trainer.add_callback(Synchronized())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    return {"step_times_s": times, "step_s": statistics.median(times[1:] or times), "peak_mb": peak,
            "packing": getattr(trainer, "_packing", None)}  # fmt: skip


def _measure(variant: str, args) -> dict:
    cmd = [*python_module("benchmarks.performance.gpu_step"), "--_one", variant, "--model", args.model,
           "--device", args.device, "--steps", str(args.steps), "--length", str(args.length),
           "--batch", str(args.batch)]  # fmt: skip
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--model", default="qwen2_0.5b_random", choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--length", type=int, default=512, help="completion tokens")
    parser.add_argument("--batch", type=int, default=8, help="completions per step (one group)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh subprocesses per variant, interleaved")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu_step.json"))
    parser.add_argument("--_one", default=None, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args._one:
        print(json.dumps(run_variant(args._one, args.model, args.device, args.steps, args.length, args.batch)))
        return
    meta = provenance()
    runs = {v: [] for v in args.variants}
    for _ in range(args.repeats):
        for variant in args.variants:
            runs[variant].append(_measure(variant, args))
            print(variant, {k: v for k, v in runs[variant][-1].items() if k != "step_times_s"}, flush=True)
    rows = {v: {"step_s": statistics.median(r["step_s"] for r in rs), "peak_mb": rs[-1]["peak_mb"],
                "packing": rs[-1]["packing"]} for v, rs in runs.items()}  # fmt: skip
    if "trl" in runs:
        for v in rows:
            rows[v]["time_ratio_to_trl_per_repeat"] = [a["step_s"] / b["step_s"] for a, b in zip(runs[v], runs["trl"])]
    settings = {k: getattr(args, k) for k in ("device", "model", "steps", "length", "batch", "repeats")}
    result = {"meta": meta | settings, "rows": rows, "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
