"""The cases of the pinned outputs (`benchmarks/shared/pins.py`): each a function of nothing that computes a measured
function's outputs on recorded inputs, made here from fixed seeds.

A case imports only torch and the package, through the package's public names of every release it is pinned at, so
that `python benchmarks/shared/pin_cases.py <case>` (which prints the outputs as JSON) runs against the package of any
commit on `PYTHONPATH` (`python -m benchmarks.tools.pin_outputs`). Each output is rounded to `DIGITS` significant
digits: the same arithmetic gives the same digits, a changed formula does not.
"""

from __future__ import annotations

import json
import sys

DIGITS = 10

#: The loss configurations of the `loss_layer` case: a policy loss per family, KL, rollout IS, aggregation modes.
LOSS_CONFIGS = {
    "vanilla_token_mean": {"policy_loss_cfg": {"loss_type": "vanilla", "cliprange_low": 0.2, "cliprange_high": 0.28}},
    "gspo_seq_mean": {
        "policy_loss_cfg": {"loss_type": "gspo", "cliprange_low": 3e-4, "cliprange_high": 4e-4},
        "loss_agg_mode": "seq-mean-token-mean",
    },
    "cispo_kl_k3": {
        "policy_loss_cfg": {"loss_type": "cispo"},
        "use_kl_loss": True,
        "kl_loss_type": "k3",
        "kl_loss_coef": 0.01,
    },
    "vanilla_rollout_is": {
        "policy_loss_cfg": {"loss_type": "vanilla"},
        "rollout_is": {"level": "token", "upper": 2.0},
        "loss_agg_mode": "seq-mean-token-sum",
    },
}


def _round(value: float) -> float:
    return float(f"{value:.{DIGITS}g}")


def loss_layer() -> dict:
    """The loss layer from log-probs and from hidden states (the chunked LM head) on one fixed micro-batch of 3
    sequences × 12 tokens in float64 (vocabulary 50, hidden 16; seed 0): per configuration of `LOSS_CONFIGS`, the
    loss and the sum and norm of its gradient, each path."""
    import torch

    from hf_rlloss import GRPOLossConfig, GRPOLossContext

    g = torch.Generator().manual_seed(0)
    batch, length, vocab, hidden = 3, 12, 50, 16
    labels = torch.randint(0, vocab, (batch, length), generator=g)
    labels[:, :4] = -100  # the prompts
    labels[2, 9:] = -100  # a shorter completion
    hidden_states = torch.randn(batch, length, hidden, generator=g, dtype=torch.float64)
    head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / 4
    logits = hidden_states @ head.T  # (B, T, V)
    logprobs = torch.log_softmax(logits, -1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (B, T)
    shift = 0.3 * torch.randn(batch, length, generator=g, dtype=torch.float64)
    data = {
        "shifted_labels": labels,
        "advantages": torch.tensor([1.0, -0.5, 0.25]),
        "old_logprobs": (logprobs + shift).detach(),
        "ref_logprobs": (logprobs - shift / 2).detach(),
        "rollout_logprobs": (logprobs + shift / 3).detach(),
    }
    outputs = {}
    for name, config in LOSS_CONFIGS.items():
        for path in ("logprobs", "hidden"):
            cfg = GRPOLossConfig(**config)
            ctx = cfg.build(dict(data))
            if "rollout_is" in config:
                ctx.compute_rollout_is()
            GRPOLossContext.build_batches([ctx])
            if path == "logprobs":
                leaf = logprobs.detach().clone().requires_grad_(True)
                loss, _ = ctx(logprobs=leaf)
            else:
                leaf = hidden_states.detach().clone().requires_grad_(True)
                loss, _ = ctx(hidden_states=leaf, head_weight=head)
            loss.backward()
            grad = leaf.grad.double()
            outputs[f"{name}/{path}"] = [_round(loss.item()), _round(grad.sum().item()), _round(grad.norm().item())]
    return outputs


CASES = {"loss_layer": loss_layer}


if __name__ == "__main__":
    print(json.dumps(CASES[sys.argv[1]](), sort_keys=True))
