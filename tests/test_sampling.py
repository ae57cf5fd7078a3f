"""`common.sampling.generate_and_cut`: left-pad, generate, cut at the first EOS; the RNG forked or continued."""

from __future__ import annotations

import pytest
import torch

from hf_rlloss.trainer.common.sampling import cut_at_eos, generate_and_cut

PAD, EOS = 0, 9


class RandomTokens(torch.nn.Module):
    """A stand-in for a transformers model: `generate` appends `max_new_tokens` tokens drawn from torch's RNG, and
    records the padded prompts it was given."""

    device = torch.device("cpu")

    def __init__(self):
        super().__init__()
        self.seen = []

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, **kwargs):
        self.seen.append((input_ids.tolist(), attention_mask.tolist(), pad_token_id, eos_token_id))
        return torch.cat([input_ids, torch.randint(1, 10, (input_ids.shape[0], max_new_tokens))], dim=1)


def test_prompts_are_left_padded_and_completions_cut_after_the_first_eos():
    model = RandomTokens()
    model.generate = lambda input_ids, attention_mask, **kw: torch.cat(
        [input_ids, torch.tensor([[3, EOS, 4, EOS], [5, 6, 7, 8]])], dim=1
    )
    assert generate_and_cut(model, [[1, 2, 3], [4]], PAD, [EOS], max_new_tokens=4) == [[3, EOS], [5, 6, 7, 8]]
    recorder = RandomTokens()
    generate_and_cut(recorder, [[1, 2, 3], [4]], PAD, [EOS], max_new_tokens=2)
    assert recorder.seen == [([[1, 2, 3], [PAD, PAD, 4]], [[1, 1, 1], [0, 0, 1]], PAD, [EOS])]
    assert cut_at_eos([1, EOS, EOS], [EOS]) == [1, EOS] and cut_at_eos([1, 2], [EOS]) == [1, 2]


def test_the_rng_is_forked_by_default_and_continued_with_fork_rng_false():
    model, prompts = RandomTokens(), [[1, 2], [3]]
    torch.manual_seed(0)
    forked = [generate_and_cut(model, prompts, PAD, [EOS], max_new_tokens=6) for _ in range(2)]
    assert forked[0] == forked[1]  # the caller's RNG restored after each call
    torch.manual_seed(0)
    continued = [generate_and_cut(model, prompts, PAD, [EOS], fork_rng=False, max_new_tokens=6) for _ in range(2)]
    torch.manual_seed(0)
    stream = [torch.randint(1, 10, (2, 6)).tolist() for _ in range(2)]
    assert continued == [[cut_at_eos(row, [EOS]) for row in draw] for draw in stream]
    assert continued[0] == forked[0] and continued[1] != continued[0]
    seeded = [generate_and_cut(model, prompts, PAD, [EOS], seed=3, max_new_tokens=6) for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_a_seed_without_a_forked_rng_is_refused():
    with pytest.raises(ValueError, match="seed=3 with fork_rng=False"):
        generate_and_cut(RandomTokens(), [[1]], PAD, [EOS], seed=3, fork_rng=False, max_new_tokens=1)
