"""Vision-language models (issue 12, item 11): `RLLossGRPOTrainer` trains a VLM with the same update as stock TRL.

Two tiny random VLMs are built in memory with their processors (no Hub access): Gemma 3 (SigLIP tower, one
`pixel_values` row per image, `token_type_ids` for the images' bidirectional attention) and Qwen2-VL (patch-flattened
`pixel_values` with `image_grid_thw`, `mm_token_type_ids`, M-RoPE positions computed by the model). The prompts are
conversational with one generated PIL image each, of equal length (no left padding), as in the text parity tests
(builders in `_vlm.py`).
"""

from __future__ import annotations

import os

import _launch
import pytest
import torch
from _trainer_utils import BASE_ARGS, trainable_snapshot
from _vlm import VLMS, make_dataset, make_trainer, make_vlm, reward_length, vision_tower
from transformers import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)
from trl import GRPOConfig, GRPOTrainer

from hf_rlloss.trainer.common.multimodal import MULTIMODAL_FIELDS, SP_REFUSAL, multimodal_inputs
from hf_rlloss.trainer.common.rollout_recording import SampledTokenLogprobs
from hf_rlloss.trainer.grpo_trainer import RLLossGRPOConfig, RLLossGRPOTrainer

torch.set_num_threads(1)

TOLERANCE = 1e-6
COMMON = dict(max_steps=3, gradient_accumulation_steps=2, num_iterations=2, optim="sgd", learning_rate=0.05)


@pytest.fixture(scope="module", params=sorted(VLMS))
def vlm(request):
    """`(name, processor, make_model, image specials)`, see `_vlm.make_vlm`."""
    return request.param, *make_vlm(request.param)


def _trainer(vlm, trainer_cls, args, **kwargs):
    return make_trainer(trainer_cls, args, *vlm[1:], **kwargs)


# ------------------------------------------------------------------------------------------------------------------


def test_multimodal_fields_are_trls():
    """The fields passed through are the multimodal keyword arguments of TRL's log-prob forward."""
    assert {"pixel_values", "image_grid_thw", "num_images", "token_type_ids", "mm_token_type_ids"} <= set(
        MULTIMODAL_FIELDS
    )
    assert not {"model", "input_ids", "attention_mask", "compute_aux_loss"} & set(MULTIMODAL_FIELDS)


def test_parity_with_trl(vlm, tmp_path):
    """Stock `GRPOTrainer` and `RLLossGRPOTrainer`, same tiny VLM, seed and completions: the parameters after 3
    optimizer steps (the second off-policy, with old log-probs from the no-grad pass) agree to 1e-6, the vision tower's
    included; and the vision tower ran in every training forward and in the no-grad passes."""
    options = {**BASE_ARGS, **COMMON, "loss_type": "dapo"}
    stock = _trainer(vlm, GRPOTrainer, GRPOConfig(output_dir=str(tmp_path / "trl"), **options))
    ours = _trainer(vlm, RLLossGRPOTrainer, RLLossGRPOConfig(output_dir=str(tmp_path / "ours"), **options))
    calls = {True: 0, False: 0}  # vision-tower forwards with / without gradient

    def count(*_):
        calls[torch.is_grad_enabled()] += 1

    vision_tower(ours.model).register_forward_hook(count)
    before = trainable_snapshot(ours.model)
    for trainer in (stock, ours):
        trainer.train()
    trl_after, our_after = trainable_snapshot(stock.model), trainable_snapshot(ours.model)
    assert trl_after.keys() == our_after.keys() == before.keys()
    vision = [k for k in before if ".visual." in f".{k}" or "vision_tower" in k]
    assert vision, "no vision-tower parameters found"
    moved = max((our_after[k] - before[k]).abs().max().item() for k in vision)
    assert moved > 1e-4, "the vision tower did not train: the images did not reach the loss forward"
    diff = max((trl_after[k] - our_after[k]).abs().max().item() for k in before)
    assert diff < TOLERANCE, diff
    # 3 steps × 2 micro-batches with gradient; old log-probs of the 2 generation batches, 2 rows chunks each
    assert calls[True] == 6 and calls[False] == 4, calls


def test_no_grad_logps_match_trl(vlm, tmp_path):
    """Old and reference log-probs of a generation batch, scored 3 rows at a time (the images cut by rows), equal
    TRL's fused-head log-probs of the whole batch; without the images they differ (the check is not vacuous)."""
    args = RLLossGRPOConfig(output_dir=str(tmp_path), **BASE_ARGS, max_steps=1, beta=0.1, num_iterations=2)
    trainer = _trainer(vlm, RLLossGRPOTrainer, args)
    trainer.model.train()
    batch = trainer._generate_and_score_completions([trainer.train_dataset[i] for i in range(8)])
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    length = batch["completion_ids"].size(1)
    fields = multimodal_inputs(batch)
    with torch.no_grad():
        expected, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, length, **fields
        )
    valid = batch["completion_mask"].bool()
    for name, logps in {
        "old": trainer.compute_per_token_logps(trainer.model, ids, mask, length, 3, multimodal=fields),
        "ref": trainer.compute_ref_per_token_logps(batch),  # the in-memory policy's copy
        "old, from TRL's call": batch["old_per_token_logps"],
        "ref, from the trainer's call": batch["ref_per_token_logps"],
    }.items():
        assert (logps - expected)[valid].abs().max() < 1e-5, name
    blind = trainer.compute_per_token_logps(trainer.model, ids, mask, length, 3)
    assert (blind - expected)[valid].abs().max() > 1e-3


def test_sequence_parallelism_refused(vlm, tmp_path):
    args = RLLossGRPOConfig(output_dir=str(tmp_path), **BASE_ARGS, max_steps=1)
    args.sp_size = 2  # past the config's own multi-process check: the trainer's VLM check comes first
    with pytest.raises(ValueError, match="sequence parallelism .* does not support vision-language models"):
        _trainer(vlm, RLLossGRPOTrainer, args)
    assert "shard" in SP_REFUSAL


@pytest.mark.parametrize("support", ["full", "sampled"])
def test_generate_rollout_logprobs_match_the_trainer_on_left_padded_prompts(vlm, tmp_path, support):
    """Real HF `generate` (sampling) on prompts of different lengths, so every batch is left-padded: the log-probs
    recorded during generation equal the trainer's (from its loss forward) to float32 noise at every step, so the
    trainer sees the images, token types and positions that generation did (M-RoPE positions for Qwen2-VL). TRL
    suppresses the image token in generation: that is a truncation of the support, reported as the kept mass (about
    1 − 1/V for a random model), and compared on the full vocabulary or replayed on the trainer's distribution."""
    _, processor, make_model, _ = vlm
    prompts = [[{"role": "user", "content": "?" * (1 + i % 9)}] for i in range(16)]
    dataset = make_dataset().remove_columns("prompt").add_column("prompt", prompts)
    args = RLLossGRPOConfig(
        output_dir=str(tmp_path), **{**BASE_ARGS, "max_steps": 2}, rollout_logprobs_support=support
    )
    trainer = RLLossGRPOTrainer(
        make_model(), [reward_length], args=args, train_dataset=dataset, processing_class=processor
    )
    assert trainer.generation_config.suppress_tokens == [trainer.model.config.image_token_id]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss/total" in h]
    assert len(logs) == 2
    vocab = len(processor.tokenizer)
    for log in logs:
        assert log["mismatch/mismatch_logprob_abs_diff"] <= 1e-5, log
        assert log["mismatch/mismatch_k3_kl"] <= 1e-8, log
        assert 1 - 3 / vocab < log["mismatch/kept_mass_min"] <= log["mismatch/kept_mass_mean"] < 1 - 1e-4, log


@pytest.mark.parametrize("top_k", [None, 8])
def test_recorder_treats_token_suppression_as_truncation(top_k):
    """Closed form (float64 reference): with a suppressed token (TRL's image token) the sampling distribution is
    unchanged, the recorded log-prob is `log_softmax(z / T)` over the whole vocabulary, and the kept log-mass is that
    of the tokens neither suppressed nor cut by top-k."""
    torch.manual_seed(0)
    vocab, temperature = 30, 0.7

    def processors():  # HF's order: the suppression before the temperature and the truncating warpers
        warpers = [SuppressTokensLogitsProcessor([2, 5]), TemperatureLogitsWarper(temperature)]
        return LogitsProcessorList(warpers + ([TopKLogitsWarper(top_k)] if top_k else []))

    recorder = SampledTokenLogprobs()
    installed = recorder.install(processors())
    assert isinstance(installed[1], type(recorder.before_truncation)), installed
    assert isinstance(installed[2], SuppressTokensLogitsProcessor), installed  # after the temperature
    ids, scores = torch.zeros(3, 1, dtype=torch.long), torch.randn(3, vocab)
    final = installed(ids, scores.clone())
    torch.testing.assert_close(final, processors()(ids, scores.clone()), atol=0, rtol=0)  # same sampling
    token = final.argmax(dim=-1)
    logps, kept_logmass = recorder.finish(token)
    full = torch.log_softmax(scores.double() / temperature, dim=-1)
    expected_kept = torch.logsumexp(full.masked_fill(~torch.isfinite(final), float("-inf")), dim=-1)
    torch.testing.assert_close(logps[:, 0].double(), full.gather(-1, token[:, None])[:, 0], atol=1e-6, rtol=0)
    torch.testing.assert_close(kept_logmass[:, 0].double(), expected_kept, atol=1e-6, rtol=0)
    assert (kept_logmass < -1e-3).all()


def test_recorder_leaves_a_suppression_it_cannot_move():
    """A processor that is not known to commute with the suppression sits between it and the temperature: nothing
    moves (the order of the processors is HF's)."""
    recorder = SampledTokenLogprobs()
    original = [SuppressTokensLogitsProcessor([2]), MinLengthLogitsProcessor(3, 1), TemperatureLogitsWarper(0.7)]
    installed = recorder.install(LogitsProcessorList(original))
    assert list(installed) == [*original, recorder]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("HF_RLLOSS_FULL_MATRIX"), reason="four launches (1-2 minutes): HF_RLLOSS_FULL_MATRIX=1"
)
@pytest.mark.parametrize("name", sorted(VLMS))
def test_two_processes_match_one(tmp_path, name):
    """DDP: 2 ranks × 2 sequences × GA 2 == 1 rank × 4 sequences × GA 2 on a VLM, off-policy second step, with the
    KL to the reference: the images of each rank's rows reach its forwards (and the unused vision parameters, e.g.
    SigLIP's pooling head, do not stop DDP)."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_vlm_script.py")
    runs = {"one": (_launch.torchrun(1), "4"), "two": (_launch.torchrun(2), "2")}
    results = {}
    for run, (launcher, batch) in runs.items():
        out = tmp_path / f"{run}.pt"
        cmd = [*launcher, script, "--model", name, "--per-device-batch-size", batch, "--out", str(out)]
        result = _launch.run(cmd, timeout=600, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-4000:]
        results[run] = torch.load(out)
    one, two = results["one"], results["two"]
    assert (one["world_size"], two["world_size"], two["ddp"]) == (1, 2, "DistributedDataParallel")
    diff = max((one["params"][k] - two["params"][k]).abs().max().item() for k in one["params"])
    assert diff < 1e-6, diff
    steps = list(zip(one["steps"], two["steps"], strict=True))
    assert len(steps) == 2
    for a, b in steps:
        assert a["train_policy/valid_tokens"] == b["train_policy/valid_tokens"]
        assert abs(a["loss/total"] - b["loss/total"]) < 1e-6
    assert steps[1][0]["train_policy/ref_kl"] > 0
