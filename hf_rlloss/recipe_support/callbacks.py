"""Trainer callbacks: write the logged metrics to JSON lines and plot the training curves at the end of training."""

from __future__ import annotations

import json
import math
import os

from transformers import TrainerCallback

# panel title -> metric keys tried in order (the first one logged is plotted: ref KL, else the on-policy-flat kl3)
CURVES = {
    "reward": ("reward",),
    "KL to reference / old policy": ("train_policy/ref_kl", "train_policy/kl3"),
    "completion length (tokens)": ("completions/mean_length",),
    "rollout mismatch |Δ log p| per token": ("mismatch/mismatch_logprob_abs_diff",),
}
# noisy per-step curves also drawn as a trailing moving average over this many steps
SMOOTHED = {"reward": 8}
# the held-out accuracy (TRL's evaluation of the eval dataset: the accuracy reward, else the total reward), drawn as
# large markers on the reward panel and reported by the run summary
HELDOUT_KEYS = ("eval_rewards/accuracy_reward/mean", "eval_reward")


def heldout_value(logs: dict) -> float | None:
    """The held-out accuracy in a log record (the first of `HELDOUT_KEYS` it has), else `None`."""
    for key in HELDOUT_KEYS:
        if key in logs:
            return float(logs[key])
    return None


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


class MetricsPlotCallback(TrainerCallback):
    """On the main process: append every log to ``<output_dir>/metrics.jsonl`` and, at the end of training, plot
    reward (with its moving average), KL, completion length and rollout mismatch per step to
    ``<output_dir>/training_curves.png``."""

    def __init__(self, output_dir: str | None = None):
        self.output_dir = output_dir
        self.history: list[dict] = []
        self.train_ended = False

    def _dir(self, args) -> str:
        return self.output_dir or args.output_dir

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
        self.history.append(record)
        os.makedirs(self._dir(args), exist_ok=True)
        with open(os.path.join(self._dir(args), "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        self.train_ended = True
        if state.is_world_process_zero and self.history:
            plot_curves(self.history, os.path.join(self._dir(args), "training_curves.png"))

    def on_evaluate(self, args, state, control, **kwargs):
        # an evaluation after training (the recipe's final held-out one): draw the curves again with it
        if self.train_ended:
            self.on_train_end(args, state, control, **kwargs)


def logged_panels(history: list[dict]) -> dict[str, tuple[str, ...]]:
    """The `CURVES` panels at least one record of `history` has a finite value for (a trainer that does not log a
    panel's keys, e.g. the asynchronous one's completion length, gets no empty panel)."""
    return {
        title: keys
        for title, keys in CURVES.items()
        if any(key in r and math.isfinite(r[key]) for r in history for key in keys)
    }


def plot_curves(history: list[dict], path: str) -> str:
    """Plot the logged `CURVES` panels (`logged_panels`) of records with a ``step`` key to a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = logged_panels(history) or {"reward": CURVES["reward"]}
    rows = math.ceil(len(panels) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(10, 3.5 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)  # an odd number of panels: the last cell stays blank
    for ax, (title, keys) in zip(axes.flat, panels.items()):
        for key in keys:
            points = [(r["step"], r[key]) for r in history if key in r and math.isfinite(r[key])]
            if points:
                ax.plot(*zip(*points), marker=".", label=key, alpha=0.5 if key in SMOOTHED else 1.0)
            if points and key in SMOOTHED:
                steps, values = zip(*points)
                window = SMOOTHED[key]
                ax.plot(steps, moving_average(list(values), window), linewidth=2, label=f"{key} ({window}-step mean)")
            if points:
                break
        heldout = [(r["step"], heldout_value(r)) for r in history if heldout_value(r) is not None]
        if title == "reward" and heldout:
            ax.plot(*zip(*heldout), marker="D", markersize=8, linestyle="--", color="black", label="held-out accuracy")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class RunSummaryCallback(TrainerCallback):
    """Collect the accuracy reward and the step time of every training step, for the end-of-run summary line.

    Args:
        k (`int`, *optional*, defaults to `8`):
            Steps averaged at the start and at the end of the run (all of them when the run is shorter).
        reward_key (`str`, *optional*, defaults to `"rewards/accuracy_reward/mean"`):
            The logged reward to summarize; TRL's total `reward` is used when it is not logged.
        step_time_key (`str`, *optional*, defaults to `"step_time"`):
            The logged step time (TRL's async trainer: `"perf/step_s"`, absent on its first step); a training step's
            log is one with it or with a `loss`.
        heldout_note (`str`, *optional*, defaults to `""`):
            How the held-out accuracy was measured (e.g. ``"greedy, 64 prompts"``), shown next to it.
        series (`dict[str, str]`, *optional*):
            Further logged metrics summarized as the reward is (first and last `k` values), by name:
            ``{"turns per episode": "rollout/turns_mean"}``.

    `notes` (a list of strings) are appended to the summary line as they are; `values` (a dict of numbers, e.g.
    ``{"heldout_untrained": accuracy}``) go into the JSON summary as they are.

    The same outcome is given twice: `summary()`, one line for a person, and `record()`, a JSON object for a program,
    which a recipe writes beside `metrics.jsonl` (`write(path)`, `run_summary.json`). Reading the JSON, not the line,
    is what the benchmarks do.

    Example:

    ```python
    >>> summary = RunSummaryCallback(k=8, heldout_note="greedy, 64 prompts")
    >>> trainer = RLLossGRPOTrainer(..., callbacks=[summary])
    >>> trainer.train()
    >>> print(summary.summary(args.output_dir))  # run summary: accuracy reward ... -> ...; ...
    >>> summary.write(os.path.join(args.output_dir, "run_summary.json"), args.output_dir)
    ```
    """

    def __init__(
        self,
        k: int = 8,
        reward_key: str = "rewards/accuracy_reward/mean",
        step_time_key: str = "step_time",
        heldout_note: str = "",
        series: dict[str, str] | None = None,
    ):
        self.k = k
        self.reward_key = reward_key
        self.step_time_key = step_time_key
        self.rewards: list[float] = []
        self.step_times: list[float] = []
        self.heldout: list[tuple[int, float]] = []  # (step, held-out accuracy) of each evaluation
        self.heldout_note = heldout_note
        self.summarized_key = reward_key
        self.series = {name: (key, []) for name, key in (series or {}).items()}
        self.notes: list[str] = []
        self.values: dict[str, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and heldout_value(logs) is not None:
            self.heldout.append((state.global_step, heldout_value(logs)))
        for key, values in self.series.values():
            if logs and key in logs:
                values.append(float(logs[key]))
        if not logs or (self.step_time_key not in logs and "loss" not in logs):  # only training steps' logs
            return
        if self.step_time_key in logs:
            self.step_times.append(float(logs[self.step_time_key]))
        key = self.reward_key if self.reward_key in logs else "reward"
        if key in logs:
            self.rewards.append(float(logs[key]))
            self.summarized_key = key

    @staticmethod
    def _first_last(values: list[float], k: int) -> dict | None:
        """The mean of the first and of the last `k` values (fewer when there are fewer), and that `k`."""
        k = min(k, len(values))
        return {"first": sum(values[:k]) / k, "last": sum(values[-k:]) / k, "k": k} if k else None

    def record(self, model_dir: str, curves: str | None = None) -> dict:
        """The run's outcome as numbers: the reward (`name`, the logged `key`) and each of `series` over the first
        and the last `k` steps, every held-out evaluation `(step, accuracy)` with the first and the last, the mean
        step time and its number of steps, `values`, `notes`, the curves' and the model's paths."""
        accuracy = self.summarized_key in ("rewards/accuracy_reward/mean", "rewards/accuracy_reward")
        reward = self._first_last(self.rewards, self.k)
        n = len(self.step_times)
        return {
            "reward": reward and {"name": "accuracy reward" if accuracy else self.summarized_key,
                                  "key": self.summarized_key, **reward},
            "series": {label: {"key": key, **found} for label, (key, values) in self.series.items()
                       if (found := self._first_last(values, self.k))},
            "heldout": self.heldout and {"note": self.heldout_note, "evaluations": [list(e) for e in self.heldout],
                                         "first_step": self.heldout[0][0], "first": self.heldout[0][1],
                                         "last_step": self.heldout[-1][0], "last": self.heldout[-1][1]},
            "step_time": {"mean_s": sum(self.step_times) / n, "steps": n} if n else None,
            "values": dict(self.values),
            "notes": list(self.notes),
            "curves": curves,
            "model": model_dir,
        }  # fmt: skip

    def summary(self, model_dir: str, curves: str | None = None) -> str:
        """One line: the reward over the first and the last `k` steps, the mean step time, the curves, the model."""
        out = self.record(model_dir, curves)
        parts = []

        def first_last(name: str, x: dict) -> str:
            return f"{name} {x['first']:.2f} (first {x['k']} steps) -> {x['last']:.2f} (last {x['k']} steps)"

        if out["reward"]:
            parts.append(first_last(out["reward"]["name"], out["reward"]))
        parts += [first_last(label, x) for label, x in out["series"].items()]
        if out["heldout"]:
            h = out["heldout"]
            note = f" ({h['note']})" if h["note"] else ""
            parts.append(
                f"held-out accuracy{note} {h['first']:.2f} (step {h['first_step']}) -> {h['last']:.2f} "
                f"(step {h['last_step']})"
            )
        if out["step_time"]:
            parts.append(f"mean step time {out['step_time']['mean_s']:.2f} s over {out['step_time']['steps']} steps")
        parts += self.notes
        if curves:
            parts.append(f"curves: {curves}")
        parts.append(f"model: {model_dir}")
        return "run summary: " + "; ".join(parts)

    def write(self, path: str, model_dir: str, curves: str | None = None) -> str:
        """Write `record()` as JSON to `path` (a recipe: `run_summary.json` beside `metrics.jsonl`); returns `path`."""
        with open(path, "w") as f:
            json.dump(self.record(model_dir, curves), f, indent=1)
        return path
