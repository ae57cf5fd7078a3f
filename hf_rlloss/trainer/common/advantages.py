"""GRPO's group advantages as TRL's `GRPOTrainer` computes them, on NumPy arrays: the rollout workers score their
groups with them, and the recipe support's diagnostics compute the advantages the trainer would.

* `nanstd`: TRL's unbiased standard deviation of the finite values (0 with fewer than two).
* `group_advantages`: `r − mean` over the group, divided by TRL's unbiased std + 1e-4 under `scale_rewards="group"`,
  the batch's under `"batch"`, not divided under `"none"`; 0 for a completion no reward function scored.
"""

from __future__ import annotations

import numpy as np

__all__ = ["group_advantages", "nanstd"]


def nanstd(values: np.ndarray) -> float:
    """TRL's `nanstd`: the unbiased standard deviation of the finite values (0 with fewer than two)."""
    values = values[~np.isnan(values)]
    return float(values.std(ddof=1)) if values.size > 1 else 0.0


def group_advantages(rewards: np.ndarray, scale_rewards: str = "group", batch_std: float | None = None):
    """`(G,)` advantages of one group's summed rewards as TRL's `GRPOTrainer` computes them: `r − mean`, divided by
    `std + 1e-4` (TRL's unbiased std: the group's under `"group"`, `batch_std` under `"batch"`; not divided under
    `"none"`), over the scorable completions; 0 for a completion every reward function skipped (NaN). Also the
    group's reward mean and std (NaN when nothing was scorable).

    Example:

    ```python
    >>> import numpy as np
    >>> advantages, mean, std = group_advantages(np.array([1.0, 0.0, np.nan]), scale_rewards="none")
    >>> advantages.tolist(), mean
    ([0.5, -0.5, 0.0], 0.5)
    ```
    """
    scored = ~np.isnan(rewards)
    advantages = np.zeros_like(rewards)  # (G,)
    if not scored.any():
        return advantages, float("nan"), float("nan")
    values = rewards[scored]
    std = nanstd(values)
    advantages[scored] = values - values.mean()
    if scale_rewards != "none":
        advantages[scored] /= (std if scale_rewards == "group" else batch_std) + 1e-4
    return advantages, float(values.mean()), std
