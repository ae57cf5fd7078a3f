"""End-to-end GRPO train steps with fixed completions (`benchmarks/performance/train_step.py`)."""

from __future__ import annotations

from ._units import times
from .core import table

MODELS = {"tiny": "tiny (random Qwen2, 110k params)", "smollm2": "SmolLM2-135M"}
VARIANTS = {
    "hf_rlloss+kl": "+ KL (k3, reference model)",
    "hf_rlloss+rollout_is": "+ rollout IS (token, both; old log-probs pass)",
    "hf_rlloss-entropy": "− entropy",
}


def _step(s: float) -> str:
    return f"{s:.3f} s" if s < 1 else f"{s:.2f} s"


@table("train_step")
def train_step(r) -> str:
    lines = ["| model | variant | step | peak memory | ratio |", "|---|---|---|---|---|"]
    for model, label in MODELS.items():
        rows = r(f"train_step_{model}.json")["rows"]
        trl, ours = rows["trl_dapo"], rows["hf_rlloss"]
        lines.append(f"| {label} | stock TRL `dapo` | {_step(trl['step_s'])} | {trl['peak_mb']:.0f} MB | — |")
        lines.append(
            f"| | hf_rlloss | {_step(ours['step_s'])} | {ours['peak_mb']:.0f} MB | "
            f"**{times(ours['step_s'] / trl['step_s'])} time, "
            f"{times(ours['peak_mb'] / trl['peak_mb'])} memory** vs TRL |"
        )
        for key, name in VARIANTS.items():
            x = rows[key]
            lines.append(
                f"| | {name} | {_step(x['step_s'])} | {x['peak_mb']:.0f} MB | "
                f"{times(x['step_s'] / ours['step_s'])} time vs hf_rlloss |"
            )
    return "\n".join(lines)
