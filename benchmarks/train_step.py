"""End-to-end GRPO optimizer steps: RLLossGRPOTrainer vs stock TRL GRPOTrainer, then the cost of each feature.

Generation is replaced by fixed random completions of full length (the same for every variant), so what is timed is
the training step: old/ref log-prob passes, the loss forward+backward and the optimizer. Every variant runs in a
fresh subprocess (peak memory = RSS high-water mark minus the RSS after the trainer is built), variants interleaved
within each repeat; the step time is the median of TRL's logged `step_time` over the steps after the first.

    python benchmarks/train_step.py --model tiny            # seconds
    python benchmarks/train_step.py --model smollm2 --steps 4 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from _memory import peak_rss_mb, reset_peak_rss, rss_mb

VARIANTS = {
    # name: (trainer, rl_loss overrides or None for stock TRL, extra args)
    "trl_dapo": ("trl", None, {}),
    "hf_rlloss": ("ours", {}, {}),
    "hf_rlloss+kl": ("ours", {"use_kl_loss": True, "kl_loss_type": "k3", "kl_loss_coef": 0.001}, {}),
    "hf_rlloss+rollout_is": ("ours", {"rollout_is": {"level": "token", "mode": "both", "upper": 2.0}}, {"is": True}),
    "hf_rlloss-entropy": ("ours", {"compute_entropy": False}, {}),
}


def _run_variant(name: str, model_name: str, steps: int, batch: int, length: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from hf_rlloss import RLLossGRPOConfig, RLLossGRPOTrainer
    from hf_rlloss.assets import SMOLLM2, TINY, resolve_model

    kind, rl_loss, extra = VARIANTS[name]
    path = resolve_model({"tiny": TINY, "smollm2": SMOLLM2}[model_name])
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": f"What is {i} + {i}?"} for i in range(64)])
    common = dict(
        output_dir=f"/tmp/bench_{name}",
        use_cpu=True,
        max_steps=steps,
        per_device_train_batch_size=batch,
        num_generations=4,
        max_completion_length=length,
        learning_rate=1e-6,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        disable_tqdm=True,
    )
    reward = lambda completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    if kind == "trl":
        args = GRPOConfig(loss_type="dapo", beta=0.0, epsilon_high=0.28, **common)
        trainer = GRPOTrainer(model, reward, args=args, train_dataset=dataset, processing_class=tokenizer)
    else:
        rl = {"policy_loss_cfg": {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28}, **rl_loss}
        args = RLLossGRPOConfig(rl_loss=rl, rollout_logprobs=bool(extra.get("is")), **common)
        trainer = RLLossGRPOTrainer(model, reward, args=args, train_dataset=dataset, processing_class=tokenizer)

    g = torch.Generator().manual_seed(1)
    vocab = len(tokenizer)

    def fixed(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        ids = [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in prompt_ids]
        logprobs = [(-torch.rand(length, generator=g) * 6).tolist() for _ in prompt_ids] if extra.get("is") else None
        return ids, logprobs

    trainer._generate_single_turn = fixed
    reset_peak_rss()
    baseline = rss_mb()
    start = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - start
    step_times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h][1:]
    return {
        "step_s": statistics.median(step_times) if step_times else total / steps,
        "peak_mb": peak_rss_mb() - baseline,
    }


def _measure(name, args) -> dict:
    cmd = [sys.executable, __file__, "--_one", name, args.model, str(args.steps), str(args.batch), str(args.length)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64, help="completion tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--_one", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._one:
        name, model, steps, batch, length = args._one
        print(json.dumps(_run_variant(name, model, int(steps), int(batch), int(length))))
        return
    samples = {v: [] for v in args.variants}
    for _ in range(args.repeats):
        for v in args.variants:
            samples[v].append(_measure(v, args))
    rows = {
        v: {k: statistics.median(s[k] for s in runs) for k in ("step_s", "peak_mb")} for v, runs in samples.items()
    }
    base, ours = rows.get("trl_dapo"), rows.get("hf_rlloss")
    print(f"{'variant':<22} {'step (s)':>9} {'peak (MB)':>10} {'time ratio':>11} {'memory ratio':>13}")
    for v, r in rows.items():
        ref = base if v == "hf_rlloss" else ours if v.startswith("hf_rlloss") else None
        ratio_t = f"{r['step_s'] / ref['step_s']:.2f}" if ref else "-"
        ratio_m = f"{r['peak_mb'] / ref['peak_mb']:.2f}" if ref and ref["peak_mb"] > 0 else "-"
        print(f"{v:<22} {r['step_s']:>9.3f} {r['peak_mb']:>10.0f} {ratio_t:>11} {ratio_m:>13}")
    print("ratios: hf_rlloss vs trl_dapo; each hf_rlloss feature vs plain hf_rlloss")
    meta = {
        "model": args.model,
        "steps": args.steps,
        "batch": args.batch,
        "length": args.length,
        "repeats": args.repeats,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    out = args.out or f"benchmarks/results/train_step_{args.model}.json"
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
