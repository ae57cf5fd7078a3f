"""What a training step costs a GPU, counted on the CPU with CUDA's code path
(`benchmarks/performance/cuda_proxies.py`): operators per step against stock TRL, host syncs per layer inside the model
and per step outside it."""

from __future__ import annotations

from ._aggregates import aggregate, recompute
from ._units import times
from .core import figure, plot, table

FILE = "cuda_proxies.json"
LABELS = {
    "trl": "stock TRL `GRPOTrainer`",
    "cuda_default": "hf_rlloss, CUDA default (`auto` → `off` without flash-attn)",
    "shared_prefix": "hf_rlloss, `shared_prefix` (segment by segment)",
    "padding_free": "hf_rlloss, `padding_free` (segment by segment)",
    "off": "hf_rlloss, `off`",
}


@aggregate("cuda_proxies", block="summary")
def summary(data: dict, name: str = "") -> dict:
    """The summary block, from the per-run counts (`cuda_proxies.summarize`)."""
    from benchmarks.performance.cuda_proxies import summarize

    return summarize(data["rows"])


@table("cuda_proxies")
def cuda_proxies(r) -> str:
    data = r(FILE)
    low, high = data["meta"]["layers"]
    lines = [
        f"| training step ({low} and {high} layers) | operators ÷ TRL's | host syncs in the model, per layer "
        "| host syncs outside the model, per step |",
        "|---|---|---|---|",
    ]
    for variant, x in recompute(FILE, data).items():
        ratios = " and ".join(times(v) for v in x["ops_ratio_to_trl"])
        outside = " and ".join(str(v) for v in x["syncs_outside_model"])
        lines.append(f"| {LABELS[variant]} | {ratios} | {x['model_syncs_per_layer']:g} | {outside} |")
    return "\n".join(lines)


@figure("cuda_proxies.default_ops_ratio")
def default_ops_ratio(r) -> str:
    return " and ".join(times(v) for v in recompute(FILE, r(FILE))["cuda_default"]["ops_ratio_to_trl"])


@plot("docs/cuda_proxies.png")
def cuda_proxies_plot(r):
    """Operators per step against TRL's, and host syncs per step, of each variant at both depths."""
    import matplotlib.pyplot as plt

    data = r(FILE)
    rows, layers = data["rows"], data["meta"]["layers"]
    variants = list(LABELS)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    width = 0.8 / len(layers)
    for i, n in enumerate(layers):
        xs = [j + (i - (len(layers) - 1) / 2) * width for j in range(len(variants))]
        axes[0].bar(xs, [rows[f"{v}|{n}"]["ops"] / rows[f"trl|{n}"]["ops"] for v in variants], width,
                    label=f"{n} layers")  # fmt: skip
        axes[1].bar(xs, [rows[f"{v}|{n}"]["syncs"] for v in variants], width, label=f"{n} layers")
    axes[0].axhline(1.2, color="k", ls="--", lw=0.8)
    axes[0].set(ylabel="operators ÷ stock TRL's", title="operators dispatched per step (dashed: 1.2)")
    axes[1].set(ylabel="host syncs", title="host syncs per step")
    for ax in axes:
        ax.set_xticks(range(len(variants)), ["TRL", "auto (CUDA)", "shared_prefix", "padding_free", "off"],
                      fontsize=8)  # fmt: skip
        ax.legend(fontsize=8)
    meta = data["meta"]
    fig.suptitle(f"{meta['machine']['kind']}, {meta['date']} (counts: the same on any machine)", fontsize=8)
    fig.tight_layout()
    return fig
