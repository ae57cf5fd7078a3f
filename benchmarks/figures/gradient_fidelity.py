"""The gradient-fidelity experiment (`python -m benchmarks.experiments.gradient_fidelity`): its pilot's sizing,
computed from the pilot's per-prompt rows (`gradient_fidelity/pilot.json`) with the experiment's own function."""

from __future__ import annotations

import functools

from .core import figure

PILOT = "gradient_fidelity/pilot.json"


@functools.lru_cache(maxsize=2)
def _power(text: str) -> dict:
    import json

    from benchmarks.experiments import gradient_fidelity

    return gradient_fidelity.pilot_power(json.loads(text), gradient_fidelity.PROMPTS["late"])


def _pilot(r) -> dict:
    import json

    return _power(json.dumps(r(PILOT)))


@figure("gradient_fidelity.pilot")
def pilot(r) -> str:
    p = _pilot(r)
    return (
        f"over its {p['pilot_prompts']} prompts, the per-prompt difference C − B of the relative squared bias had a "
        f"mean of {p['mean_diff']:+.2f} and a standard deviation of {p['sd_diff']:.2f}; B's relative bias was "
        f"{p['relative_bias_none']:.2f}; a prompt took {p['seconds_per_prompt']:.0f} s"
    )


@figure("gradient_fidelity.power")
def power(r) -> str:
    p = _pilot(r)
    return (
        f"with {p['prompts']} prompts, the paired t-test of the per-prompt squared-bias differences detects a "
        f"difference of {p['mde_squared']:.2f} (relative squared bias) with 80 % power at α = 0.05, about "
        f"{p['mde_relative_bias']:.2f} on the relative-bias scale at the pilot's B; its power at the pilot's mean "
        f"difference is {p['power_at_pilot_mean']:.2f}"
    )
