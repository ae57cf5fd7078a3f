"""The benchmark page's headline table: one line per benchmark, each from its own results file."""

from __future__ import annotations

from ._aggregates import recompute
from ._units import mb, sec, times
from .core import table
from .generation import DEMO_STEP
from .loss_step import FILES, TRL_FP32_152K, row, rows


def _gb(x_mb: float) -> str:
    return f"{x_mb / 1000:.1f} GB"


@table("headline")
def headline(r) -> str:
    lines = ["| | hf_rlloss | TRL 1.16 | ratio |", "|---|---|---|---|"]
    for dtype, vocab in FILES:
        x = row(r, (dtype, vocab))
        floor = times(x["hf_rlloss_s"] / x["gemm_floor_s"])
        ours = f"{sec(x['hf_rlloss_s'])}, {mb(x['hf_rlloss_peak_mb'])} ({floor} floor)"
        speedup = times(x["naive_s"] / x["hf_rlloss_s"])
        naive = f"{speedup} faster than naive {dtype} logits ({_gb(x['naive_peak_mb'])})"
        if "trl_chunked_s" in x:
            trl = f"{sec(x['trl_chunked_s'])}, {mb(x['trl_chunked_peak_mb'])}"
            ratio = (
                f"**{times(x['trl_chunked_s'] / x['hf_rlloss_s'], 1)} faster, "
                f"{times(x['hf_rlloss_peak_mb'] / x['trl_chunked_peak_mb'])} memory**; {naive}"
            )
        else:
            t = rows(r, TRL_FP32_152K)[0]
            trl = f"{sec(t['trl_chunked_s'])}, {mb(t['trl_chunked_peak_mb'])} (a separate run)"
            ratio = naive
        lines.append(f"| loss step, {dtype}, vocab {round(vocab / 1000)}k | {ours} | {trl} | {ratio} |")

    growth = recompute("scaling.json", r("scaling.json"))
    lines.append(
        f"| loss-step memory growth with completion length | {growth['hf_rlloss']:.1f} MB per 1k tokens "
        f"| {growth['trl_chunked']:.0f} MB per 1k tokens | no `(tokens, vocab)` term |"
    )

    step = r("train_step_smollm2.json")["rows"]
    ours, trl = step["hf_rlloss"], step["trl_dapo"]
    lines.append(
        f"| GRPO train step, SmolLM2-135M (features off, fixed completions) | {sec(ours['step_s'])}, "
        f"{mb(ours['peak_mb'])} | {sec(trl['step_s'])}, {mb(trl['peak_mb'])} | "
        f"**{times(ours['step_s'] / trl['step_s'])} time, {times(ours['peak_mb'] / trl['peak_mb'])} memory** |"
    )

    demo = recompute(DEMO_STEP, r(DEMO_STEP))["demo"]["step"]
    ours, trl = demo["shared"], demo["trl"]
    repeats = len(r(DEMO_STEP)["samples"]["step/demo"]["shared"])
    lines.append(
        f"| whole demo step, float32, generation included (CPU time, "
        f"{'one repeat' if repeats == 1 else f'median of {repeats} repeats'}) | {sec(ours['step_cpu_s'])} "
        f"| {sec(trl['step_cpu_s'])} | **{times(ours['step_cpu_s'] / trl['step_cpu_s'])} CPU time** |"
    )

    sp = {(x["tokens"], x["sp"]): x["peak_mb_max"] for x in r("sp_memory.json")["rows"]}
    tokens = max(t for t, _ in sp)
    lines.append(
        f"| per-rank memory, {tokens // 1024}k-token sequence, sp=2 vs sp=1 | {mb(sp[tokens, 2])} "
        f"| {mb(sp[tokens, 1])} (sp=1; TRL refuses sp > 1) | {times(sp[tokens, 2] / sp[tokens, 1])} |"
    )
    return "\n".join(lines)
