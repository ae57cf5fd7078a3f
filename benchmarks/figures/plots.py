"""The images on the user pages, drawn from the results files (`core.plot`): `python -m
benchmarks.tools.render_figures`
writes them, and the check fails when a page shows an image no renderer draws or one that differs from its drawing."""

from __future__ import annotations

from .core import draw, plot

__all__ = ["draw"]


@plot("docs/agentic_demo.png")
def agentic_demo(r):
    return seed_curves(r("agentic_demo_seeds.json"))


def seed_curves(result: dict):
    """Per seed: the accuracy reward per step (and the turns per episode of a tool run), with the held-out accuracy
    at the first and the last step as markers."""
    import matplotlib.pyplot as plt

    runs = result["runs"]
    panels = 2 if all("turns" in run for run in runs) else 1
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 3.6), squeeze=False)
    for run in runs:
        steps = range(1, len(run["reward"]) + 1)
        (line,) = axes[0][0].plot(steps, run["reward"], lw=1, alpha=0.8, label=f"seed {run['seed']}")
        axes[0][0].plot([0, len(run["reward"])], [run["heldout_before"], run["heldout_after"]], "D",
                        color=line.get_color(), ms=6)  # fmt: skip
        if panels == 2:
            axes[0][1].plot(steps, run["turns"], lw=1, color=line.get_color(), label=f"seed {run['seed']}")
    axes[0][0].set(
        xlabel="step", ylabel="accuracy", title="reward per step (lines), held-out (diamonds)", ylim=(0, 1.02)
    )
    axes[0][0].legend(fontsize=8)
    if panels == 2:
        axes[0][1].set(xlabel="step", ylabel="turns per episode", title="assistant turns per conversation")
    meta = result["meta"]
    fig.suptitle(f"{meta['machine']['kind']}, {meta['date']}", fontsize=8)
    fig.tight_layout()
    return fig


@plot("docs/async_demo_curves.png")
def async_demo_curves(r):
    """The logged async demo run's panels, as the recipe's own callback draws them (`plot_curves`)."""
    from hf_rlloss.recipe_support.callbacks import plot_curves

    records = [record for record in r("async_demo_metrics.jsonl") if "step" in record]
    return _png(lambda path: plot_curves(records, str(path)))


@plot("docs/staleness_v2.png")
def staleness_v2(r):
    """Held-out accuracy per seed at the primary lag, and each pre-registered comparison's per-seed differences
    (`benchmarks/experiments/staleness_experiment.py`'s own drawing, from its run files and `analysis.json`)."""
    from benchmarks.experiments import staleness_experiment

    from .core import RESULTS
    from .staleness_v2 import analysis_data

    runs, _ = staleness_experiment.load_runs(RESULTS / "staleness_v2")
    return _png(staleness_experiment.make_plot, runs, analysis_data(r))


@plot("docs/async_staleness.png")
def async_staleness(r):
    """Reward per step, the mean over the seeds with a 5-step moving mean, by arm and lag (the exploratory runs)."""

    from benchmarks.experiments.async_staleness import load_arm_runs, reward_curves

    r("async_staleness/smollm2/meta.json")  # the run files' provenance
    runs = load_arm_runs("smollm2")
    lags = sorted({k[0] for k in runs})
    return reward_curves(runs, lags)


@plot("docs/staleness_replication.png")
def staleness_replication(r):
    """The lag-4 replication's held-out accuracy per seed, and the per-seed differences of the original comparison
    and of the replication (`staleness_experiment.make_replication_plot`, from the run files and `analysis.json`)."""
    from benchmarks.experiments import staleness_experiment

    from .core import RESULTS
    from .staleness_replication import analysis_data

    runs, _ = staleness_experiment.load_runs(RESULTS / "staleness_replication")
    return _png(staleness_experiment.make_replication_plot, runs, analysis_data(r))


def _png(draw, *args) -> bytes:
    """The image `draw(*args, path)` saves at `path`, read back (an experiment's own drawing of its results)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plot.png"
        draw(*args, path)
        return path.read_bytes()
