"""Rollout log-probs recorded during HF `generate`, and the truncation the trainer replays on π_old.

With HF `generate` (and `record_rollout_logprobs`), `SampledTokenLogprobs` records the log-prob of each sampled
token and the log of the probability mass that top-k/top-p/min-p truncation kept (`recording_logprobs` installs it
in the model's logits processors for one `generate` call). Under truncated sampling the rollout log-probs can be
compared with π_old on the sampled support: the trainer then replays the same truncating warpers on π_old
(`replay_warpers`) and renormalizes by the mass they keep (`chunked_kept_logmass`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from transformers import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MinPLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.configuration_utils import GenerationMode
from transformers.utils import logging

from .multimodal import detach_token_suppression, token_suppression_replay

logger = logging.get_logger(__name__)

__all__ = [
    "TRUNCATING_WARPERS",
    "SampledTokenLogprobs",
    "kept_logmass_batch",
    "recording_logprobs",
    "replay_warpers",
    "truncation_replay",
    "unreplayable_truncation",
]

# transformers' logits warpers that cut the support of the sampling distribution (removed tokens get -inf). What
# comes before them in the processor list (penalties, temperature) shapes the distribution the trainer compares with.
TRUNCATING_WARPERS = (
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)

# The truncation settings the trainer can replay on its own distribution (`replay_warpers`), and those it cannot.
REPLAYED_SETTINGS = ("top_k", "top_p", "min_p")
UNREPLAYED_SETTINGS = ("top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")


class _BeforeTruncation(LogitsProcessor):
    """Inserted before the first truncating warper: keeps the full-vocabulary log-softmax for the recorder."""

    def __init__(self, recorder: SampledTokenLogprobs):
        self.recorder = recorder

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.recorder.full = torch.log_softmax(scores.float(), dim=-1)
        return scores


class SampledTokenLogprobs(LogitsProcessor):
    """Records, for each token sampled by HF ``generate``, its log-prob under the full-vocabulary sampling
    distribution and the log of the probability mass that top-k/top-p/min-p (…) truncation kept.

    Two hooks in the processor list (see `install`): `before_truncation` sits right before the first truncating
    warper, after the penalties and the temperature, so its log-softmax is the distribution over the whole vocabulary
    that the trainer's log-probs (with the same temperature) describe; the recorder itself comes last and sees the
    distribution the token is drawn from, whose finite entries are the kept support ``S``. Per row it keeps
    ``log p(v)`` `(B, V)` and ``log K = log Σ_{v∈S} p(v)`` `(B,)`; the token is only known at the next step, so each
    call records the previous step's values (one `(B, V)` block alive at a time) and `finish` records the last one.
    The log-prob on the sampled support is ``log p(o) − log K``.
    """

    def __init__(self):
        self.full: torch.Tensor | None = None  # (B, V) log-softmax before truncation, set by before_truncation
        self.previous: tuple[torch.Tensor, torch.Tensor] | None = None
        self.logprobs: list[torch.Tensor] = []
        self.kept_logmass: list[torch.Tensor] = []
        self.before_truncation = _BeforeTruncation(self)

    def install(self, processors: LogitsProcessorList) -> LogitsProcessorList:
        """Insert `before_truncation` before the first truncating warper and append the recorder (in place)."""
        cut = next((i for i, p in enumerate(processors) if isinstance(p, TRUNCATING_WARPERS)), len(processors))
        suppressions = detach_token_suppression(processors, cut)  # VLM: TRL's suppressed image token
        cut -= len(suppressions)
        if cut < len(processors) or suppressions:
            processors[cut:cut] = [self.before_truncation, *suppressions]
        processors.append(self)
        return processors

    def _record(self, tokens: torch.Tensor) -> None:
        full, kept_logmass = self.previous
        self.logprobs.append(full.gather(-1, tokens.to(full.device)[:, None]).squeeze(-1))
        self.kept_logmass.append(kept_logmass)
        self.previous = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.previous is not None:
            self._record(input_ids[:, -1])
        full = self.full if self.full is not None else torch.log_softmax(scores.float(), dim=-1)
        cut = ~torch.isfinite(scores)
        kept_logmass = torch.logsumexp(full.masked_fill(cut, float("-inf")), dim=-1).clamp(max=0.0)
        # exactly 0 where nothing was cut (a float32 sum of the whole softmax is 1 only to about 1e-5 at 49k tokens)
        kept_logmass = torch.where(cut.any(dim=-1), kept_logmass, 0.0)
        self.previous, self.full = (full, kept_logmass), None
        return scores

    def finish(self, last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(B, generated)` full-vocabulary log-probs of the generated tokens and the kept log-masses, given the
        `(B,)` tokens sampled at the last step."""
        if self.previous is not None:
            self._record(last_tokens)
        if not self.logprobs:
            empty = torch.zeros(last_tokens.size(0), 0)
            return empty, empty
        return torch.stack(self.logprobs, dim=1), torch.stack(self.kept_logmass, dim=1)

    def per_completion(
        self, completion_ids: list[list[int]], support: str
    ) -> tuple[list[list[float]], list[torch.Tensor]] | None:
        """The recorded log-probs of each completion (TRL's `logprobs` list of lists) and its kept log-masses
        (`(len,)` each), or `None` when nothing was recorded.

        Args:
            completion_ids (`list[list[int]]`): the generated completions, as TRL's `_generate_single_turn` returns
                them (each cut at its EOS).
            support (`str`): `"full"` (log-probs over the whole vocabulary) or `"sampled"` (renormalized over the
                kept support: `log p(o) − log K`).
        """
        if self.previous is None:
            return None
        steps = len(self.logprobs) + 1
        # rows that ran to the last step hold its token; shorter rows (ended by EOS) never use that value
        last = torch.tensor([ids[steps - 1] if len(ids) >= steps else 0 for ids in completion_ids])
        full, kept_logmass = (t.cpu() for t in self.finish(last))
        if support == "sampled":
            full = full - kept_logmass  # log-probs renormalized over the kept support
        logprobs = [full[i, : len(ids)].tolist() for i, ids in enumerate(completion_ids)]
        return logprobs, [kept_logmass[i, : len(ids)] for i, ids in enumerate(completion_ids)]


@contextlib.contextmanager
def recording_logprobs(lm: nn.Module, recorder: SampledTokenLogprobs) -> Iterator[None]:
    """Install `recorder` in the logits processors of every `lm.generate` call inside the block.

    transformers builds the processor list in `GenerationMixin._get_logits_processor`; it is wrapped on the instance
    (not the class, so other models are untouched) and restored on exit, including an instance attribute that was
    already there.
    """
    original = lm._get_logits_processor
    shadowed = vars(lm).get("_get_logits_processor")

    def get_logits_processor(*args: Any, **kwargs: Any) -> LogitsProcessorList:
        return recorder.install(original(*args, **kwargs))

    lm._get_logits_processor = get_logits_processor
    try:
        yield
    finally:
        if shadowed is None:
            del lm._get_logits_processor
        else:
            lm._get_logits_processor = shadowed


def kept_logmass_batch(recorded: list[list[torch.Tensor]], completion_ids: torch.Tensor) -> torch.Tensor | None:
    """`(B, C)` kept log-masses of a padded completion batch from the recorder's per-completion values (one list per
    generation call), 0 past each completion; `None` unless exactly one call produced every row (with tool calls a
    row's tokens come from several calls)."""
    if len(recorded) != 1 or len(recorded[0]) != completion_ids.size(0):
        return None
    kept = torch.zeros(completion_ids.shape, dtype=torch.float32)
    for i, values in enumerate(recorded[0]):
        kept[i, : len(values)] = values[: completion_ids.size(1)]
    return kept.to(completion_ids.device)


def unreplayable_truncation(generation_config: Any) -> dict[str, Any]:
    """The truncation settings of an HF generation config that `replay_warpers` cannot replay (and are in use)."""
    values = {name: getattr(generation_config, name, None) for name in UNREPLAYED_SETTINGS}
    return {name: value for name, value in values.items() if value not in (None, 0.0, 1.0)}


def replay_warpers(top_k: int | None, top_p: float | None, min_p: float | None) -> LogitsProcessorList | None:
    """The truncating warpers of the sampling settings, in HF `generate`'s order, or `None` when none truncates.

    Args:
        top_k (`int`, *optional*): keep the `top_k` most likely tokens (0 or `None`: off).
        top_p (`float`, *optional*): nucleus sampling (1.0 or `None`: off).
        min_p (`float`, *optional*): keep the tokens with at least `min_p` × the top probability (0 or `None`: off).
    """
    warpers = LogitsProcessorList()
    if top_k is not None and top_k > 0:
        warpers.append(TopKLogitsWarper(top_k=int(top_k)))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=float(top_p)))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p=float(min_p)))
    return warpers or None


def truncation_replay(
    recorded_by_hf: bool,
    external_sampling: dict[str, Any] | None,
    generation_config: GenerationConfig,
    support: str,
    rollout_is_enabled: bool,
) -> LogitsProcessorList | None:
    """The truncating warpers (top-k, top-p, min-p) the trainer replays on π_old to get the mass they keep, or
    `None` when the rollout log-probs are compared as they are.

    HF `generate` records full-vocabulary log-probs (`support="full"`: nothing to replay) or the log-probs on the
    sampled support (`"sampled"`: π_old is renormalized over the replayed support). vLLM (`processed_logprobs`) and
    a `rollout_func` report log-probs on the sampled support only, so with truncation they are always compared on
    that support, whatever `support` says.

    Args:
        recorded_by_hf (`bool`): the rollout log-probs are recorded from HF `generate` (`SampledTokenLogprobs`).
        external_sampling (`dict`, *optional*): with vLLM or a `rollout_func`, the `top_k`/`top_p`/`min_p` they
            sample with; `None` otherwise.
        generation_config (`GenerationConfig`): HF `generate`'s settings (read when `recorded_by_hf`).
        support (`str`): the trainer's `rollout_logprobs_support`, `"full"` or `"sampled"`.
        rollout_is_enabled (`bool`): `rl_loss.rollout_is` corrects for the sampling distribution (it needs one).
    """
    if recorded_by_hf:
        mode = generation_config.get_generation_mode()
        if rollout_is_enabled and mode != GenerationMode.SAMPLE:
            raise ValueError(
                f"rl_loss.rollout_is needs sampled completions, but the generation mode is {mode.value!r} "
                "(generation_kwargs num_beams/do_sample): there is no sampling distribution to correct for"
            )
        if support == "full" or mode != GenerationMode.SAMPLE:
            return None
        settings = {name: getattr(generation_config, name, None) for name in REPLAYED_SETTINGS}
        others = unreplayable_truncation(generation_config)
    elif external_sampling is not None:
        settings, others = external_sampling, {}
    else:
        return None
    if others:
        raise ValueError(
            f"rollout_logprobs_support='sampled' replays top_k, top_p and min_p on the trainer's distribution, "
            "not "
            f"{', '.join(f'{k}={v}' for k, v in others.items())}: use rollout_logprobs_support='full'"
        )
    warpers = replay_warpers(**settings)
    if recorded_by_hf:  # VLM: TRL's suppressed image token cuts the sampled support too, before top-k/p
        suppressions = token_suppression_replay(generation_config)
        warpers = LogitsProcessorList([*suppressions, *(warpers or [])]) or None
    if warpers is not None and not recorded_by_hf:
        logger.warning_once(
            f"sampling is truncated ({', '.join(type(w).__name__ for w in warpers)}) and the rollout log-probs of "
            "vLLM / rollout_func are on the sampled support: rollout IS compares them with π_old renormalized "
            "over the replayed support (rollout_logprobs_support='full' needs HF generate)"
        )
    return warpers
