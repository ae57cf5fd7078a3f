"""The gradient-fidelity diagnostic against an exact computation: a policy small enough to enumerate every completion.

    python -m benchmarks.experiments.gradient_fidelity_exact   # writes benchmarks/results/gradient_fidelity_exact.json

A one-layer Qwen2 over a vocabulary of 3 tokens (0 is EOS) answers two prompts with at most 2 tokens: 7 possible
completions per prompt, so every group of `G` = 2 completions (49 ordered pairs) and every optimizer step of one
group per prompt (2401) is enumerated with its probability. Each group's gradient is the diagnostic's own
(`GradientFidelity.gradients`, through the loss layer, sketched); each step's is `GradientFidelity.step_gradients`
(the trainer's objective: the token mean over the step, TRL's reward scaling across it, the KL term).

Two results:

1. **Agreement.** The exact relative bias of B (no correction), C (token IS truncated at 2) and sequence-level IS,
   per group as the diagnostic defines it, against the diagnostic's estimate from sampled groups (four on-policy and
   two stale groups per prompt, drawn from the exact distributions; `REPLICATES` draws of each prompt): each exact
   value should lie inside the diagnostic's 95 % interval.
   Over `SEEDS` sampling seeds, how often each exact value falls inside (a 95 % interval should hold it about 19
   times in 20), at two behaviour perturbations.
2. **What the trainer optimises.** The exact relative bias of each correction under the trainer's objective (per
   step, for every `scale_rewards`, with and without the asynchronous demo's KL term, k3 at 0.001), beside the
   per-group objective the diagnostic measures.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from types import SimpleNamespace

import numpy as np
import torch

from benchmarks.shared.provenance import ROOT, provenance

OUT = ROOT / "benchmarks" / "results" / "gradient_fidelity_exact.json"
EOS, VOCAB, MAX_TOKENS, G = 0, 3, 2, 2
PROMPTS = ([1, 2, 1], [2, 2, 1])  # token ids
TARGET = (1, 2)  # prompt p's reward: 1 when the first token is TARGET[p], plus 0.5 when the completion ends with EOS
NAMES = ("none", "token_tis", "sequence_tis")
REPLICATES = 500  # sampled draws of each prompt for the diagnostic's estimate
SEEDS = 20  # sampling seeds the coverage of the diagnostic's intervals is counted over
STALENESS = (0.1, 0.15)  # the behaviour policy: the policy's weights plus this much Gaussian noise
MEASURES = ("hf_rlloss/recipe_support/gradient_fidelity.py", "hf_rlloss/recipe_support/fidelity_stats.py",
            "hf_rlloss/recipe_support/grad_sketch.py", "hf_rlloss/loss")  # fmt: skip
OBJECTIVES = [("group", 0.0), ("batch", 0.0), ("none", 0.0), ("group", 0.001)]  # (scale_rewards, KL coefficient)


def tiny_policy(seed: int):
    """A one-layer Qwen2 over `VOCAB` tokens, float64 (exact sums of 2401 terms)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, eos_token_id=EOS,
                         pad_token_id=EOS, bos_token_id=EOS, tie_word_embeddings=False)  # fmt: skip
    model = Qwen2ForCausalLM(config).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def perturbed(model, seed: int, scale: float):
    import copy

    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return other.eval()


def completions() -> list[list[int]]:
    """Every completion of at most `MAX_TOKENS` tokens: cut at EOS, or at the budget."""
    out = [[EOS]]
    for length in range(2, MAX_TOKENS + 1):
        for body in itertools.product(range(1, VOCAB), repeat=length - 1):
            out.append([*body, EOS])
    out += [list(c) for c in itertools.product(range(1, VOCAB), repeat=MAX_TOKENS)]
    return out


def reward(prompt: int, completion: list[int]) -> float:
    return float(completion[0] == TARGET[prompt]) + 0.5 * float(completion[-1] == EOS)


def token_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """`(len(completion),)` log-probs of the completion's tokens under `model`."""
    from hf_rlloss.recipe_support.gradient_fidelity import Group, completion_logprobs

    with torch.no_grad():
        return completion_logprobs(model, Group(prompt, [completion], np.zeros(1), np.zeros(1)), EOS)[0]


class Enumeration:
    """Every group of `G` completions of each prompt, with its probability under each sampler and its per-group
    gradients (`GradientFidelity.gradients`), and exact expectations over groups and over steps."""

    def __init__(self, policy, behaviour, reference, sketch_dim: int = 4096):
        from hf_rlloss.recipe_support.gradient_fidelity import CORRECTIONS, GradientFidelity, Settings

        self.models = {"on": policy, "stale": behaviour}
        self.reference = reference
        self.completions = completions()
        self.tuples = list(itertools.product(range(len(self.completions)), repeat=G))
        tokenizer = SimpleNamespace(pad_token_id=EOS, eos_token_id=EOS)
        self.make = lambda **objective: GradientFidelity(
            policy, tokenizer, [], Settings(corrections={n: CORRECTIONS[n] for n in NAMES}, sketch_dim=sketch_dim,
                                            num_generations=G, **objective), reference=reference)  # fmt: skip
        self.fidelity = self.make()
        # per prompt, sampler: each completion's per-token log-probs and probability
        self.logprobs = {(p, s): [token_logprobs(m, PROMPTS[p], c) for c in self.completions]
                         for p in range(len(PROMPTS)) for s, m in self.models.items()}  # fmt: skip
        self.prob = {key: np.array([float(lp.sum().exp()) for lp in lps]) for key, lps in self.logprobs.items()}
        self.tuple_prob = {key: np.array([np.prod(p[list(t)]) for t in self.tuples]) for key, p in self.prob.items()}
        self._vectors: dict[tuple[int, str], np.ndarray] = {}

    def group(self, prompt: int, sampler: str, members: tuple[int, ...], scale_rewards: str = "group"):
        from hf_rlloss.recipe_support.gradient_fidelity import Group, step_advantages

        cs = [self.completions[i] for i in members]
        width = max(len(c) for c in cs)
        behaviour = torch.zeros(len(cs), width, dtype=torch.float64)
        for row, i in enumerate(members):
            lp = self.logprobs[(prompt, sampler)][i]
            behaviour[row, : len(lp)] = lp
        rewards = np.array([reward(prompt, c) for c in cs])
        return Group(PROMPTS[prompt], cs, rewards, step_advantages([rewards], scale_rewards)[0], behaviour.float())

    def group_vectors(self, prompt: int, sampler: str) -> np.ndarray:
        """`(tuples, names, k)`: each group's sketched per-group gradient of each correction (computed once)."""
        key = (prompt, sampler)
        if key not in self._vectors:
            self._vectors[key] = self._group_vectors(prompt, sampler)
        return self._vectors[key]

    def _group_vectors(self, prompt: int, sampler: str) -> np.ndarray:
        rows = []
        for t in self.tuples:
            vectors, _ = self.fidelity.gradients(self.group(prompt, sampler, t), list(NAMES))
            rows.append([vectors[n].numpy() for n in NAMES])
        return np.array(rows)

    def step_expectation(self, sampler: str, scale_rewards: str, kl: float) -> np.ndarray:
        """`(names, k)`: the exact expected gradient of the trainer's objective over steps of one group per prompt."""
        fidelity = self.make(scale_rewards=scale_rewards, kl_loss_coef=kl)
        total = np.zeros((len(NAMES), fidelity.sketch.dim))
        probs = [self.tuple_prob[(p, sampler)] for p in range(len(PROMPTS))]
        for (i, a), (j, b) in itertools.product(enumerate(self.tuples), repeat=2):
            weight = probs[0][i] * probs[1][j]
            if weight < 1e-12:
                continue
            groups = [self.group(0, sampler, a, scale_rewards), self.group(1, sampler, b, scale_rewards)]
            vectors, _ = fidelity.step_gradients(groups, list(NAMES))
            total += weight * np.array([vectors[n].numpy() for n in NAMES])
        return total


def relative_bias(m: np.ndarray, g: np.ndarray) -> float:
    """`‖m − g‖ / ‖g‖` over the rows (prompts) of `(P, k)` arrays, or of two vectors."""
    return float(np.sqrt(((m - g) ** 2).sum() / (g**2).sum()))


def agreement(e: Enumeration, replicates: int, seed: int = 0, resamples: int = 4000) -> dict:
    """Per correction: the exact per-group relative bias and the diagnostic's estimate with its interval, from
    `replicates` sampled draws of each prompt (four on-policy groups, two stale)."""
    from hf_rlloss.recipe_support.fidelity_stats import floor_terms, prompt_terms
    from hf_rlloss.recipe_support.gradient_fidelity import fidelity_report

    vectors = {(p, s): e.group_vectors(p, s) for p in range(len(PROMPTS)) for s in e.models}
    exact_m = {n: np.array([e.tuple_prob[(p, "stale")] @ vectors[(p, "stale")][:, k] for p in range(len(PROMPTS))])
               for k, n in enumerate(NAMES)}  # fmt: skip
    exact_g = np.array([e.tuple_prob[(p, "on")] @ vectors[(p, "on")][:, 0] for p in range(len(PROMPTS))])
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(replicates):
        for p in range(len(PROMPTS)):
            on_i = rng.choice(len(e.tuples), size=4, p=e.tuple_prob[(p, "on")] / e.tuple_prob[(p, "on")].sum())
            stale_i = rng.choice(
                len(e.tuples), size=2, p=e.tuple_prob[(p, "stale")] / e.tuple_prob[(p, "stale")].sum()
            )
            on = [vectors[(p, "on")][i, 0] for i in on_i]
            terms = {n: prompt_terms(on, [vectors[(p, "stale")][i, k] for i in stale_i]) for k, n in enumerate(NAMES)}
            rows.append({"floor": floor_terms(on), "terms": {"stale": terms},
                         "weights": {"stale": {n: [1.0, 1.0, 1.0] for n in NAMES}}})  # fmt: skip
    report = fidelity_report(rows, list(NAMES), resamples=resamples, drop=False, seed=seed)["stale"]
    out = {}
    for n in NAMES:
        estimate = report["estimators"][n]["relative_bias"]
        exact = relative_bias(exact_m[n], exact_g)
        out[n] = {"exact": exact, **estimate, "inside": estimate["ci_low"] <= exact <= estimate["ci_high"]}
    return {"prompts": len(rows), "replicates": replicates, "corrections": out}


def objectives(e: Enumeration) -> dict:
    """Per objective: each correction's exact relative bias (the per-group objective from the groups' gradients)."""
    out = {}
    vectors = {(p, s): e.group_vectors(p, s) for p in range(len(PROMPTS)) for s in e.models}
    g = np.array([e.tuple_prob[(p, "on")] @ vectors[(p, "on")][:, 0] for p in range(len(PROMPTS))])
    out["per group (the diagnostic's), group scaling, no KL"] = {
        n: relative_bias(
            np.array([e.tuple_prob[(p, "stale")] @ vectors[(p, "stale")][:, k] for p in range(len(PROMPTS))]), g
        )  # fmt: skip
        for k, n in enumerate(NAMES)
    }
    for scale, kl in OBJECTIVES:
        on = e.step_expectation("on", scale, kl)[0]
        stale = e.step_expectation("stale", scale, kl)
        label = f"per step (the trainer's), scale_rewards={scale}, " + (f"KL k3 at {kl:g}" if kl else "no KL")
        out[label] = {n: relative_bias(stale[k], on) for k, n in enumerate(NAMES)}
    return out


def measure(replicates: int = REPLICATES, seeds: int = SEEDS, steps: bool = True) -> dict:
    """At each behaviour perturbation of `STALENESS`: the agreement at seed 0 and its coverage over `seeds` sampling
    seeds (how often each exact value falls inside the diagnostic's interval); at the last, the objectives."""
    policy = tiny_policy(0)
    reference = perturbed(policy, 2, 0.3)
    result = {"design": {"vocabulary": VOCAB, "max_tokens": MAX_TOKENS, "group_size": G, "prompts": len(PROMPTS),
                         "completions": len(completions()), "reference_perturbation": 0.3}, "levels": {}}  # fmt: skip
    for staleness in STALENESS:
        e = Enumeration(policy, perturbed(policy, 1, staleness), reference)
        runs = [agreement(e, replicates, seed) for seed in range(seeds)]
        coverage = {n: sum(run["corrections"][n]["inside"] for run in runs) for n in NAMES}
        level = {"probability_sums": {f"{p}/{s}": float(v.sum()) for (p, s), v in e.prob.items()},
                 "agreement": runs[0], "coverage": coverage, "seeds": seeds}  # fmt: skip
        if steps and staleness == STALENESS[-1]:
            level["objectives"] = objectives(e)
        result["levels"][str(staleness)] = level
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicates", type=int, default=REPLICATES)
    parser.add_argument("--seeds", type=int, default=SEEDS)
    return parser


def main() -> int:
    args = build_parser().parse_args()
    torch.set_num_threads(1)
    started = time.time()
    result = {"meta": provenance(), **measure(args.replicates, args.seeds), "seconds": round(time.time() - started, 1)}
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["levels"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
