"""MoE routing replay on tiny MoE models: a bf16 sampler, an fp32 trainer, with and without replay.

Part 1 (one forward): HF `generate` samples 8 tokens for each of 3 left-padded prompts under bf16 autocast, recording
its routers (`RoutingReplay.recording`); the fp32 trainer then forwards prompt + completion once routed live and once
replaying the recorded experts. Printed per model: the fraction of router decisions (token × MoE layer × k) where the
recorded expert is not among the trainer's own top-k (`routing/disagreement`), the fraction of tokens differing in at
least one layer, and the mismatch between the sampler's and the trainer's log-probs of the sampled tokens (mean and
max |Δ log p|, k3 KL estimate E[exp(Δ) − 1 − Δ] with Δ = log p_trainer − log p_sampler).

Part 2 (training): `RLLossGRPOTrainer` with HF generation under bf16 autocast (the sampler) and fp32 training, a few
optimizer steps per `routing_replay` mode; printed: the mean per step of `routing/disagreement` and of the rollout
mismatch metrics, the reward of the first and last steps, the run's time.

Models: `tests/_models.py::tiny_moe` (2 layers, 8 experts, top-2), at their random initialization and with
near-tied routers (every expert's router row one shared row plus a 1e-3 perturbation, experts' outputs ×10): the
case where bf16 rounding flips the top-k choice.

    python -m benchmarks.experiments.routing_replay            # about 2 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from transformers import PrinterCallback

from benchmarks.shared.tiny_models import BASE_ARGS, make_tokenizer, reward_length, tiny_moe
from hf_rlloss.trainer import RLLossGRPOConfig, RLLossGRPOTrainer
from hf_rlloss.trainer.common.routing_replay import (
    RoutingReplay,
    batch_routes,
    generation_routes,
    layout_routes,
)

PROMPTS = ["hello world, how", "hi", "what is 3+4?"]


def one_forward(tok, family: str, near_tied: bool) -> dict[str, dict[str, float]]:
    """Part 1 for one model: the metrics routed live and replayed."""
    model = tiny_moe(tok, family, near_tied=near_tied)
    replay = RoutingReplay().attach(model)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    torch.manual_seed(1)
    with replay.recording() as records, torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(
            **enc, do_sample=True, max_new_tokens=8, top_k=0, top_p=1.0, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    p = enc["input_ids"].shape[1]
    completion = out.sequences[:, p:]
    sampler = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(2, completion[..., None])[..., 0]
    prompts, completions = generation_routes(records, enc["attention_mask"], [completion.shape[1]] * len(PROMPTS))
    routes = batch_routes(prompts, completions, p, completion.shape[1])
    mask = torch.cat([enc["attention_mask"], torch.ones_like(completion)], 1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    targets = layout_routes(routes)
    results = {}
    for name, replayed in (("live", False), ("replay", True)):
        replay.live()
        with replay.replay(targets if replayed else None), torch.no_grad():
            logits = model(input_ids=out.sequences, attention_mask=mask, position_ids=positions).logits.float()
        trainer = torch.log_softmax(logits[:, p - 1 : -1], -1).gather(2, completion[..., None])[..., 0]
        delta = trainer - sampler
        results[name] = {
            "mean |Δ log p|": delta.abs().mean().item(),
            "max |Δ log p|": delta.abs().max().item(),
            "k3 KL": (delta.exp() - 1 - delta).mean().item(),
        }
    # the trainer's own routing (live forward, recorded) against the sampler's, per decision and per token
    with replay.recording() as live, torch.no_grad():
        model(input_ids=out.sequences, attention_mask=mask, position_ids=positions)
    own = torch.stack([calls[0] for calls in live], dim=1)  # (N, L, k)
    has_route = targets[:, 0, 0] >= 0
    differs = ~(targets[has_route].long()[..., :, None] == own[has_route].long()[..., None, :]).any(-1)  # (N', L, k)
    for name in results:
        results[name]["disagreement"] = differs.float().mean().item() if name == "live" else 0.0
        results[name]["tokens differing"] = differs.any(-1).any(-1).float().mean().item() if name == "live" else 0.0
    return results


class Bf16Sampler(RLLossGRPOTrainer):
    """The trainer with its HF generation under bf16 autocast: a bf16 sampler beside an fp32 trainer."""

    def _generate_single_turn(self, *args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return super()._generate_single_turn(*args, **kwargs)


KEYS = ("routing/disagreement", "mismatch/mismatch_logprob_abs_diff", "mismatch/mismatch_k3_kl")


def train(tok, mode: str, steps: int, near_tied: bool) -> dict[str, float]:
    """Part 2 for one mode: the step means of `KEYS`, the first and last rewards, the time."""
    options = {"routing_replay": mode, "max_steps": steps, "rl_loss": {"rollout_is": {}}, "packing": "padding_free"}
    if mode == "old_policy":
        options["num_iterations"] = 2  # R2 replays the π_old pass's routing in the second iteration's loss forward
    prompts = Dataset.from_dict({"prompt": [f"Q{i}: add {i % 7}+{i % 5} =" for i in range(64)]})
    with tempfile.TemporaryDirectory() as out:
        args = RLLossGRPOConfig(output_dir=out, **{**BASE_ARGS, "learning_rate": 1e-2, **options})
        model = tiny_moe(tok, "qwen3_moe", near_tied=near_tied).train()
        trainer = Bf16Sampler(model, [reward_length], args=args, train_dataset=prompts, processing_class=tok)
        trainer.remove_callback(PrinterCallback)  # the per-step log lines; the table is the output
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "reward" in h or "loss/total" in h]
    result = {key: statistics.mean(h[key] for h in logs if key in h) for key in KEYS if any(key in h for h in logs)}
    rewards = [h["reward"] for h in logs if "reward" in h]
    return {**result, "reward first": rewards[0], "reward last": rewards[-1], "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = make_tokenizer()
    print("| model | routing | disagreement | tokens differing | mean \\|Δ log p\\| | max \\|Δ log p\\| | k3 KL |")
    print("|---|---|---|---|---|---|---|")
    for family in ("qwen3_moe", "olmoe", "mixtral", "gpt_oss"):
        for near_tied in (False, True):
            label = f"{family}{', near-tied routers' if near_tied else ''}"
            for name, r in one_forward(tok, family, near_tied).items():
                print(
                    f"| {label} | {name} | {r['disagreement']:.3f} | {r['tokens differing']:.3f} | "
                    f"{r['mean |Δ log p|']:.2e} | {r['max |Δ log p|']:.2e} | {r['k3 KL']:.2e} |"
                )
    print()
    header = (
        "| routing_replay | routing/disagreement | mismatch_logprob_abs_diff | mismatch_k3_kl | reward | time (s) |"
    )
    print(header)
    print("|---|---|---|---|---|---|")
    for mode in ("off", "rollout", "old_policy"):
        r = train(tok, mode, args.steps, near_tied=True)
        disagreement = f"{r['routing/disagreement']:.3f}" if "routing/disagreement" in r else "—"
        print(
            f"| `{mode}` | {disagreement} | {r['mismatch/mismatch_logprob_abs_diff']:.2e} | "
            f"{r['mismatch/mismatch_k3_kl']:.2e} | {r['reward first']:.3f} → {r['reward last']:.3f} | "
            f"{r['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()
