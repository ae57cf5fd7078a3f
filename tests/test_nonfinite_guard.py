"""`skip_nonfinite_grad_steps`: a step with a non-finite gradient norm leaves parameters, optimizer state and learning
rate as they were and is logged; one too many in a row stops the run naming the step."""

import math

import pytest
import torch
from _trainer_utils import BASE_ARGS, make_tokenizer, train_fixed, trainable_snapshot
from transformers import TrainerCallback

from hf_rlloss import RLLossGRPOConfig


class InfGradientAt(TrainerCallback):
    """Makes one parameter's gradient infinite during the optimizer steps `steps` (1-based); snapshots the trainable
    parameters after every step."""

    def __init__(self, steps):
        self.steps, self.handle, self.after = set(steps), None, {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 in self.steps:
            param = next(p for p in model.parameters() if p.requires_grad)
            self.handle = param.register_hook(lambda grad: grad * float("inf"))

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.after[state.global_step] = trainable_snapshot(model)


def _train(tmp_path, bad_steps, limit, max_steps=3):
    args = RLLossGRPOConfig(
        output_dir=str(tmp_path),
        **{**BASE_ARGS, "max_steps": max_steps, "learning_rate": 1e-2, "skip_nonfinite_grad_steps": limit},
    )
    probe = InfGradientAt(bad_steps)
    trainer, _, _ = train_fixed(make_tokenizer(), args, callbacks=[probe])
    return trainer, probe


def test_a_nonfinite_step_is_skipped_whole_and_logged(tmp_path):
    trainer, probe = _train(tmp_path, bad_steps=[2], limit=1)
    for name, value in probe.after[1].items():  # step 2 changed nothing
        assert torch.equal(probe.after[2][name], value), name
    assert any(not torch.equal(probe.after[3][n], v) for n, v in probe.after[2].items())  # step 3 trained again
    assert all(torch.isfinite(v).all() for v in probe.after[3].values())
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert [logs[s]["nonfinite_grad_skipped"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert not math.isfinite(logs[2]["grad_norm"])
    assert logs[3]["learning_rate"] == logs[2]["learning_rate"]  # the schedule did not advance at step 2
    assert logs[2]["learning_rate"] < logs[1]["learning_rate"]
    steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    assert steps == {2}  # AdamW counted 2 updates for every parameter, not 3


def test_one_too_many_in_a_row_stops_naming_the_step(tmp_path):
    with pytest.raises(FloatingPointError, match=r"2 consecutive optimizer steps, the last at step 3; .*allows 1"):
        _train(tmp_path, bad_steps=[2, 3], limit=1)


def test_the_option_is_validated():
    with pytest.raises(ValueError, match="skip_nonfinite_grad_steps=-1 must be an integer >= 0"):
        RLLossGRPOConfig(output_dir="unused", **{**BASE_ARGS, "skip_nonfinite_grad_steps": -1})
