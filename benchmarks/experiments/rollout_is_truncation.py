"""The rollout IS ratio under truncated sampling: tiny Qwen2, fp32, on-policy, one process, HF `generate`.

Prompts are left-padded (1–11 tokens). For each sampling setting the trainer runs a few optimizer steps with the
mismatch metrics on, and the per-step `mismatch/mismatch_logprob_abs_diff` (mean |log μ − log π_old| per token),
`rollout_is/mean`, `mismatch/mismatch_k3_kl` and `mismatch/kept_mass_mean` are printed as a Markdown table, for
each support of the rollout log-probs (`rollout_logprobs_support`).

    python -m benchmarks.experiments.rollout_is_truncation            # about a minute on 2 CPU cores
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from datasets import Dataset

from benchmarks.shared.tiny_models import BASE_ARGS, make_model, make_tokenizer, reward_length
from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer

SETTINGS = {
    "temperature 1.0": {},
    "temperature 0.7": {"temperature": 0.7},
    "`top_p=0.8`": {"top_p": 0.8},
    "`top_k=10`": {"top_k": 10},
}
KEYS = (
    "mismatch/mismatch_logprob_abs_diff",
    "rollout_is/mean",
    "mismatch/mismatch_k3_kl",
    "mismatch/kept_mass_mean",
)


def left_padded_prompts(n: int = 16) -> Dataset:
    """Prompts of 1 to 11 byte tokens, so a generation batch is left-padded."""
    return Dataset.from_dict({"prompt": [("abcdefghijk"[: 1 + i % 11]) for i in range(n)]})


def run(support: str, overrides: dict, steps: int) -> list[dict]:
    tok = make_tokenizer()
    with tempfile.TemporaryDirectory() as out:
        args = RLLossGRPOConfig(
            output_dir=out,
            **{**BASE_ARGS, "max_steps": steps, "rollout_logprobs_support": support, **overrides},
        )
        trainer = RLLossGRPOTrainer(
            make_model(tok), [reward_length], args=args, train_dataset=left_padded_prompts(), processing_class=tok
        )
        trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--supports", nargs="+", default=["full", "sampled"])
    options = parser.parse_args()
    torch.set_num_threads(1)
    header = ["support", "sampling", "\\|Δ log p\\| per token (max)", "`rollout_is/mean`", "k3 (max)", "kept mass"]
    print("| " + " | ".join(header) + " |")
    print("|---|---|---|---|---|---|")
    for support in options.supports:
        for name, overrides in SETTINGS.items():
            logs = run(support, overrides, options.steps)
            diff = max(log[KEYS[0]] for log in logs)
            means = [log[KEYS[1]] for log in logs]
            k3 = max(log[KEYS[2]] for log in logs)
            kept = [log.get(KEYS[3], float("nan")) for log in logs]
            print(
                f"| {support} | {name} | {diff:.1e} | {min(means):.6f}–{max(means):.6f} | {k3:.1e} | "
                f"{min(kept):.3f}–{max(kept):.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
