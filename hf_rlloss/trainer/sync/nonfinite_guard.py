"""An optional guard against a non-finite update (`skip_nonfinite_grad_steps`): a `Trainer` mixin.

Under bf16 a gradient can overflow to inf (or a NaN slip in) on one unlucky step; the optimizer then writes NaN into
every parameter and the run is lost. With ``skip_nonfinite_grad_steps = N > 0``, an optimizer step whose gradient
norm is not finite is skipped: every gradient is dropped before `optimizer.step()` (torch optimizers leave a
parameter without a gradient untouched, moments and step count included) and Accelerate's "step was skipped" flag
is raised, so the `Trainer` leaves the learning-rate schedule where it was too. The norm is the clipped-gradient
norm the `Trainer` computes over all ranks, so every rank skips the same steps. Each step logs
`nonfinite_grad_skipped` (1 skipped, 0 applied; the mean over a logging window is the fraction skipped); the
``N + 1``-th consecutive non-finite step raises `FloatingPointError`. Off (0) by default. Not under DeepSpeed, whose
engine owns the gradients and the step (it skips overflowing steps itself under fp16).
"""

from __future__ import annotations

import math


class NonFiniteGradGuard:
    """`Trainer` mixin implementing `args.skip_nonfinite_grad_steps` (see the module docstring); put it before the
    `Trainer` subclass in the bases. It overrides `_get_grad_norm`, called once per optimizer step before the step."""

    _nonfinite_consecutive = 0

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm)
        limit = getattr(self.args, "skip_nonfinite_grad_steps", 0)
        if not limit:
            return grad_norm
        if self.is_deepspeed_enabled:
            raise ValueError(
                f"skip_nonfinite_grad_steps={limit} is not supported under DeepSpeed (its engine owns the gradients "
                "and the step); set it to 0"
            )
        optimizer = self.optimizer
        if getattr(optimizer, "scaler", None) is None:
            optimizer._is_overflow = False  # undo the flag a previous skip raised (no fp16 scaler resets it here)
        norm = float(grad_norm)
        skipped = not math.isfinite(norm)
        self._metrics["train"]["nonfinite_grad_skipped"].append(float(skipped))
        if not skipped:
            self._nonfinite_consecutive = 0
            return grad_norm
        self._nonfinite_consecutive += 1
        if self._nonfinite_consecutive > limit:
            raise FloatingPointError(
                f"the gradient norm was not finite ({norm}) on {self._nonfinite_consecutive} consecutive optimizer "
                f"steps, the last at step {self.state.global_step + 1}; skip_nonfinite_grad_steps={limit} allows "
                f"{limit}: stopping"
            )
        for param in model.parameters():
            param.grad = None
        optimizer._is_overflow = True  # Accelerate's `optimizer_step_was_skipped`: the Trainer keeps the LR schedule
        return grad_norm
