"""Fault: a run stopped after a checkpoint and resumed gives the same next losses as an uninterrupted run."""

import zlib

import pytest
import torch
from _trainer_utils import BASE_ARGS, SPECIALS, make_dataset, make_model, make_tokenizer, reward_digit, reward_length

from hf_rlloss import RLLossGRPOConfig, RLLossGRPOTrainer


def _step_completions(trainer, tokenizer):
    """Completions that depend only on the prompt, its index in the group and the global step (restored on resume)."""

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out, seen = [], {}
        for ids in prompt_ids:
            key = zlib.crc32(bytes(str(list(ids)), "utf8"))
            j = seen[key] = seen.get(key, -1) + 1
            g = torch.Generator().manual_seed(key * 7919 + trainer.state.global_step * 104729 + j)
            length = int(torch.randint(2, trainer.max_completion_length + 1, (1,), generator=g))
            out.append(torch.randint(len(SPECIALS), len(tokenizer), (length,), generator=g).tolist())
        return out, None

    return generate


def _run(tmp_path, max_steps, resume=None):
    tok = make_tokenizer()
    args = RLLossGRPOConfig(
        output_dir=str(tmp_path),
        **{**BASE_ARGS, "save_strategy": "steps", "save_steps": 2, "max_steps": 4, "learning_rate": 1e-2},
        rl_loss={"policy_loss_cfg": {"loss_type": "gspo"}, "use_kl_loss": True, "kl_loss_type": "k3"},
    )
    trainer = RLLossGRPOTrainer(
        make_model(tok), [reward_length, reward_digit], args=args, train_dataset=make_dataset(), processing_class=tok
    )
    trainer._generate_single_turn = _step_completions(trainer, tok)
    if max_steps < 4:  # simulate a run killed right after its checkpoint at step `max_steps`
        trainer.add_callback(_StopAt(max_steps))
    trainer.train(resume_from_checkpoint=resume)
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


class _StopAt:
    def __init__(self, step):
        self.step = step

    def __getattr__(self, name):  # every other TrainerCallback event is a no-op
        return lambda *args, **kwargs: None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


@pytest.mark.slow
def test_resume_after_checkpoint_gives_the_same_next_losses(tmp_path):
    uninterrupted = _run(tmp_path / "a", max_steps=4)
    first = _run(tmp_path / "b", max_steps=2)
    assert (tmp_path / "b" / "checkpoint-2").is_dir()
    resumed = _run(tmp_path / "b", max_steps=4, resume=str(tmp_path / "b" / "checkpoint-2"))
    assert sorted(uninterrupted) == [1, 2, 3, 4] and sorted(first) == [1, 2]
    assert sorted(resumed) == [1, 2, 3, 4]  # steps 1-2 come from the restored trainer state
    for step in (1, 2):
        assert first[step] == pytest.approx(uninterrupted[step], abs=1e-6)
    for step in (3, 4):
        assert resumed[step] == pytest.approx(uninterrupted[step], abs=1e-5), (step, resumed, uninterrupted)
