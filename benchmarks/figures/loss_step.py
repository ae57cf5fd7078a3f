"""The loss step from hidden states (`benchmarks/loss_step.py`): hf_rlloss against TRL's chunked kernel, naive logits
and the three-GEMM floor."""

from __future__ import annotations

from ._units import mb, sec, span, times
from .core import figure, table

# (dtype, vocab) -> results file, in the table's order
FILES = {
    ("bf16", 49152): "loss_step_bf16_49k.json",
    ("bf16", 151936): "loss_step_bf16_152k.json",
    ("fp32", 49152): "loss_step_fp32_49k.json",
    ("fp32", 151936): "loss_step_fp32_152k.json",
}
TRL_FP32_152K = "loss_step_fp32_152k_trl.json"  # TRL at fp32 152k: a separate run


def row(r, key) -> dict:
    return r(FILES[key])["rows"][0]


def cell(x: dict, method: str) -> str:
    if f"{method}_s" not in x:
        return "—"
    return f"{sec(x[f'{method}_s'])}, {mb(x[f'{method}_peak_mb'])}"


def with_trl(r) -> list[dict]:
    rows = [row(r, key) for key in FILES]
    return [x for x in rows if "trl_chunked_s" in x]


@table("loss_step")
def loss_step_table(r) -> str:
    lines = [
        "| dtype | vocab | hf_rlloss | TRL chunked | naive logits | 3-GEMM floor "
        "| ÷ floor (ratio of the median times; per repeat) | vs naive | vs TRL (time / memory) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (dtype, vocab), _ in FILES.items():
        x = row(r, (dtype, vocab))
        floor = x["hf_rlloss_s"] / x["gemm_floor_s"]
        repeats = ", ".join(f"{v:.2f}" for v in x["floor_ratio_per_repeat"])
        naive = f"{times(x['naive_s'] / x['hf_rlloss_s'])} faster"
        trl = "—"
        if "trl_chunked_s" in x:
            trl = (
                f"{times(x['trl_chunked_s'] / x['hf_rlloss_s'])} faster / "
                f"{times(x['hf_rlloss_peak_mb'] / x['trl_chunked_peak_mb'])}"
            )
        cells = [
            dtype,
            f"{vocab:,}",
            cell(x, "hf_rlloss"),
            cell(x, "trl_chunked"),
            cell(x, "naive"),
            cell(x, "gemm_floor"),
            f"**{floor:.2f}**; {repeats}",
            naive,
            trl,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@figure("loss_step.trl_speedup_range")
def trl_speedup_range(r) -> str:
    return span([x["trl_chunked_s"] / x["hf_rlloss_s"] for x in with_trl(r)], digits=1)


@figure("loss_step.trl_memory_range")
def trl_memory_range(r) -> str:
    return span([x["hf_rlloss_peak_mb"] / x["trl_chunked_peak_mb"] for x in with_trl(r)])


@figure("loss_step.floor_range")
def floor_range(r) -> str:
    return span([row(r, key)["hf_rlloss_s"] / row(r, key)["gemm_floor_s"] for key in FILES])


@figure("loss_step.floor_repeat_max")
def floor_repeat_max(r) -> str:
    return times(max(v for key in FILES for v in row(r, key)["floor_ratio_per_repeat"]))


@figure("loss_step.naive_speedup_range")
def naive_speedup_range(r) -> str:
    return span([row(r, key)["naive_s"] / row(r, key)["hf_rlloss_s"] for key in FILES])


@figure("loss_step.fp32_49k_floor_runs")
def fp32_49k_floor_runs(r) -> str:
    return span(row(r, ("fp32", 49152))["gemm_floor_runs_s"], unit=" s")


@figure("loss_step.trl_fp32_152k")
def trl_fp32_152k(r) -> str:
    x = r(TRL_FP32_152K)["rows"][0]
    return cell(x, "trl_chunked")
