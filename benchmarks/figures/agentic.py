"""The agentic demo (`benchmarks/experiments/demo_seeds.py --demo calculator`): SmolLM2-135M-Instruct with an `add`
tool."""

from __future__ import annotations

from benchmarks.shared.stats import format_p, paired_t

from .core import table

SEEDS = "agentic_demo_seeds.json"
VLLM = "agentic_demo_vllm.json"


def _last_step(run: dict) -> str:
    return max((k for k in run["heldout"] if k.startswith("step_") and k != "step_0"), key=lambda k: int(k[5:]))


def _rows(data: dict) -> list[str]:
    rows = []
    for run in data["runs"]:
        h, last = run["heldout"], _last_step(run)
        rows.append(
            f"| {run['seed']} | {run['reward_first']:.2f} → {run['reward_last']:.2f} "
            f"| {run['turns_first']:.2f} → {run['turns_last']:.2f} "
            f"| {h['untrained']['accuracy']:.2f} | {h['step_0']['accuracy']:.2f} → {h[last]['accuracy']:.2f} "
            f"| {h['step_0']['greedy']['accuracy']:.2f} → {h[last]['greedy']['accuracy']:.2f} "
            f"| {run['wall_s'] / 60:.1f} min ({run['load_average_at_start'][0]:.1f}) |"
        )
    return rows


HEADER = [
    "| seed | accuracy reward, first 8 → last 8 steps | assistant turns per episode, first 8 → last 8 steps "
    "| held-out, untrained | held-out, after the warm-up → after GRPO | held-out greedy, after the warm-up → after "
    "GRPO | run (1-min load average at its start) |",
    "|---|---|---|---|---|---|---|",
]


def _per_seed_with_gain(data: dict) -> str:
    """Per seed, then the held-out gain of GRPO (after − before, sampled accuracy) with its 95 % interval: paired over
    seeds, and paired over items pooled across seeds (each seed draws its own held-out problems)."""
    rows = HEADER + _rows(data)
    runs = data["runs"]
    before = [run["heldout"]["step_0"]["accuracy"] for run in runs]
    after = [run["heldout"][_last_step(run)]["accuracy"] for run in runs]
    items_before = [c for run in runs for c in run["heldout"]["step_0"]["sampled"]["correct"]]
    items_after = [c for run in runs for c in run["heldout"][_last_step(run)]["sampled"]["correct"]]
    rows.append("")
    for label, x, y in (("seeds", after, before), ("items, pooled over seeds", items_after, items_before)):
        if len(x) < 2:  # one seed: no interval over seeds
            continue
        t = paired_t(x, y)
        rows.append(
            f"Held-out gain of GRPO, paired over {t['n']} {label}: {t['mean_diff']:+.3f} (95 % CI "
            f"{t['ci'][0]:+.3f} to {t['ci'][1]:+.3f}), t({t['df']}) = {t['t']:.2f}, {format_p(t['p'])}."
        )
        rows.append("")
    return "\n".join(rows).rstrip()


@table("agentic_demo.seeds")
def seeds(r) -> str:
    """The demo with the HF-generate worker (`HFGenerateRolloutWorker`)."""
    return _per_seed_with_gain(r(SEEDS))


@table("agentic_demo.vllm")
def vllm(r) -> str:
    """The same recipe with `--vllm_engine true` (`VLLMRolloutWorker`, vLLM's CPU build), in the vLLM environment."""
    return _per_seed_with_gain(r(VLLM))
