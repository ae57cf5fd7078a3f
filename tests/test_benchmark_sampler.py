"""The staleness experiments' sampler (`benchmarks/experiments/async_staleness.py`, also used by
`staleness_experiment.py`): stale by construction, `lag + 1` batches of the first policy queued ahead, then one batch
per weight sync, served first in, first out; paired seeds per batch index."""

import torch

from benchmarks.experiments.async_staleness import lagged_sampler
from benchmarks.shared.tiny_models import make_model, make_tokenizer


def _sampler(lag: int, seed: int = 0):
    tok = make_tokenizer()
    train = [{"prompt": [{"role": "user", "content": f"{a} + 1"}], "answer": str(a + 1)} for a in range(6)]

    def text(prompt):
        return tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)

    return lagged_sampler(lambda: make_model(tok, seed=0), tok, text, train, seed, lag, 2, 4, 4)


def test_the_first_batches_are_lag_versions_stale_and_served_in_order():
    sampler = _sampler(lag=2)
    weights = list(sampler.model.state_dict().items())
    sampler.send_weights(iter(weights))  # version 1: lag + 1 = 3 batches of the first policy
    assert sampler.version == 1 and sampler.batch_versions == [1, 1, 1] and sampler.qsize() == 3 * 2 * 4
    served = [sampler.get() for _ in range(2 * 4)]
    assert [s.group_id for s in served] == [0] * 4 + [1] * 4 and {s.model_version for s in served} == {1}
    sampler.send_weights(iter(weights))  # version 2: one more batch, queued behind the stale ones
    assert sampler.batch_versions == [1, 1, 1, 2] and sampler.get().group_id == 2
    sample = served[0]
    prompt_len = int((sample.completion_mask == 0).sum())
    assert sample.old_log_probs.shape == sample.input_ids.shape and (sample.old_log_probs[:prompt_len] == 0).all()
    assert sampler.generate_s > 0


def test_the_same_batch_index_draws_the_same_completions_in_every_arm():
    first, second = _sampler(lag=0), _sampler(lag=0)
    for sampler in (first, second):
        sampler.send_weights(iter(sampler.model.state_dict().items()))
    a = [first.get() for _ in range(8)]
    b = [second.get() for _ in range(8)]
    assert all(torch.equal(torch.as_tensor(x.input_ids), torch.as_tensor(y.input_ids)) for x, y in zip(a, b))


def test_the_drift_of_a_row_in_closed_form():
    """The staleness experiments' drift metrics: mean |Δ|, the ESS of exp(Δ) and the share of |Δ| > ln 2, with Δ the
    loss's π_θ (π_old, one step per batch) minus the sampler's log-probs."""
    import math
    from types import SimpleNamespace

    import torch

    from benchmarks.experiments.async_staleness import drift

    trainer = SimpleNamespace(args=SimpleNamespace(behavior_as_old_policy=False))
    row = SimpleNamespace(behavior_logprobs=torch.tensor([-1.0, -2.0, -0.5, -3.0]))
    old = torch.tensor([[-1.0, -1.0, -1.5, -3.0]])  # Δ = 0, 1, -1, 0
    got = drift(trainer, {"old_logprobs": old}, row)
    w = [1.0, math.e, 1 / math.e, 1.0]
    assert got["abs_logratio"] == 0.5
    assert abs(got["ess"] - sum(w) ** 2 / (4 * sum(x * x for x in w))) < 1e-12
    assert got["frac_over_ln2"] == 0.5
