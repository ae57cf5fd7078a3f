"""What a training step costs a GPU, counted on any device: operators dispatched and host syncs per step, against stock
TRL on the same batch (`benchmarks/shared/dispatch_counts.py` says what each counts and why it holds on a GPU).

Each variant trains one optimizer step of a tiny Llama with 2 and 4 layers on fixed completions (the same for every
variant: generation replaced, as in `train_step.py`); everything inside `Trainer.training_step` is counted (the
generation batch's scoring, the old and reference passes, the loss forward and backward). A forward of the
backbone (the decoder) counts its syncs as the model's (forward hooks); the layer-dependent part is the difference
between the two depths.

* `trl`: stock `GRPOTrainer`;
* `cuda_default`: `RLLossGRPOTrainer` with the layout `packing="auto"` takes on CUDA without flash-attn
  (`packing_for_device`);
* `shared_prefix`, `padding_free`, `off`: each layout forced (`shared_prefix` was the default on every device).

    python -m benchmarks.performance.cuda_proxies                # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.shared.provenance import ROOT, provenance

MEASURES = ("hf_rlloss/loss", "hf_rlloss/trainer", "hf_rlloss/parallel")
VARIANTS = ("trl", "cuda_default", "shared_prefix", "padding_free", "off")
LAYERS = (2, 4)


def cuda_default_packing() -> str:
    """The layout `packing="auto"` trains with on CUDA without flash-attn's varlen kernel, bf16."""
    from hf_rlloss.trainer.common.packing import packing_for_device

    return packing_for_device("cuda", half_precision=True, flash_varlen=False)[0]


def _fixed_completions(tokenizer, length: int, batch: int):
    """Generation replaced: completions that depend on the prompt's place in the batch only, of varied lengths (some
    end with EOS before `length`, so that the padded layouts pad), drawn once here so that generation dispatches
    nothing while counted."""
    import torch

    eos, vocab = tokenizer.eos_token_id, len(tokenizer)
    fixed = []
    for i in range(batch):
        n = 3 + i * 5 % (length - 2)
        fixed.append(torch.randint(16, vocab, (n,), generator=torch.Generator().manual_seed(i)).tolist() + [eos])

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        return [list(fixed[i % batch]) for i in range(len(prompt_ids))], None

    return generate


def count_step(variant: str, layers: int, batch: int = 8, length: int = 16) -> dict:
    """One optimizer step of `variant` (see the module docstring), counted: its operators, host syncs, and the host
    syncs inside a causal-LM forward."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.shared.dispatch_counts import DispatchCounts
    from benchmarks.shared.tiny_models import BASE_ARGS, make_tokenizer, reward_length, tiny_config
    from hf_rlloss import RLLossGRPOConfig, RLLossGRPOTrainer

    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(**tiny_config(tokenizer, 32, layers, 4, 2), intermediate_size=64))
    model.set_attn_implementation("sdpa")
    dataset = Dataset.from_list([{"prompt": f"Q{i}: what is {i} + {i}?"} for i in range(16)])
    common = {**BASE_ARGS, "output_dir": os.path.join("/tmp", f"cuda_proxies_{variant}"), "max_steps": 1,
              "per_device_train_batch_size": batch, "max_completion_length": length}  # fmt: skip
    if variant == "trl":
        trainer = GRPOTrainer(model, reward_length, args=GRPOConfig(**common), train_dataset=dataset,
                              processing_class=tokenizer)  # fmt: skip
    else:
        packing = cuda_default_packing() if variant == "cuda_default" else variant
        args = RLLossGRPOConfig(**common, packing=packing)
        trainer = RLLossGRPOTrainer(model, reward_length, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer._generate_single_turn = _fixed_completions(tokenizer, length, batch)
    counts = DispatchCounts()
    in_model = {"depth": 0, "syncs": 0}

    def enter(*_):
        in_model["depth"] += 1
        in_model["before"] = counts.total_syncs

    def leave(*_):
        in_model["depth"] -= 1
        in_model["syncs"] += counts.total_syncs - in_model.pop("before")

    backbone = model.get_decoder()  # both trainers run it: TRL through the causal LM, ours from hidden states
    backbone.register_forward_pre_hook(enter)
    backbone.register_forward_hook(leave)
    training_step = trainer.training_step

    def counted_step(*args, **kwargs):
        with counts:
            return training_step(*args, **kwargs)

    trainer.training_step = counted_step
    trainer.train()
    return {"ops": counts.total_ops, "syncs": counts.total_syncs, "syncs_in_model": in_model["syncs"],
            "syncs_by_kind": dict(counts.syncs)}  # fmt: skip


def summarize(rows: dict) -> dict:
    """Per variant: operators per step at each depth and their ratio to TRL's, host syncs per layer (the difference
    between the depths over the layers added), and host syncs outside the model per step."""
    out = {}
    low, high = LAYERS
    for variant in VARIANTS:
        a, b = rows[f"{variant}|{low}"], rows[f"{variant}|{high}"]
        out[variant] = {
            "ops_ratio_to_trl": [rows[f"{variant}|{n}"]["ops"] / rows[f"trl|{n}"]["ops"] for n in LAYERS],
            "model_syncs_per_layer": (b["syncs_in_model"] - a["syncs_in_model"]) / (high - low),
            "syncs_outside_model": [
                rows[f"{variant}|{n}"]["syncs"] - rows[f"{variant}|{n}"]["syncs_in_model"] for n in LAYERS
            ],  # fmt: skip
        }
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "cuda_proxies.json"))
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the counts do not depend on them)")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    import torch

    torch.set_num_threads(args.threads)
    meta = provenance()
    rows = {}
    for layers in LAYERS:
        for variant in VARIANTS:
            rows[f"{variant}|{layers}"] = count_step(variant, layers)
            print(variant, layers, {k: v for k, v in rows[f"{variant}|{layers}"].items() if k != "syncs_by_kind"})
    result = {"meta": meta | {"cuda_default_packing": cuda_default_packing(), "layers": list(LAYERS)},
              "rows": rows, "summary": summarize(rows)}  # fmt: skip
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
