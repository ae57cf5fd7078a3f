"""`tests/engine_matrix_script.py` under a real FSDP2 state on CPU, plus probes of what FSDP2 did to the LM head.

Launched by `tests/test_fsdp2.py` as `accelerate launch --config_file <fsdp2 on CPU> tests/fsdp2_script.py ARGS`
(ARGS: those of the engine-matrix script, plus ``--untied`` for a model whose LM head is not tied to the
embeddings). It installs the test-only CPU FSDP shim (`tests/_cpu_fsdp.py`; a no-op under a config without FSDP,
so the DDP baseline of an ``--untied`` run uses this script too), records what `get_head_weight` sees during the
loss and log-prob passes and the state of the policy and the reference after `train()`, then runs the engine-matrix
script unchanged; rank 0 adds the probes of each case to its record as ``"fsdp2"``:

* ``head_calls``: per `get_head_weight` call, whether the module's LM-head weight was still a sharded DTensor (it
  must not be: every pass runs inside the root module's forward, which unshards it), the shape given to the loss,
  and whether gradients were on; ``sharded_after_logps``: after each no-gradient log-prob pass (old, reference),
  whether the model's LM-head weight was a shard again;
* ``after_train``: the policy and the reference are `FSDPModule`s whose parameters are all DTensors again (the full
  head weight is not kept), the head's local shard shape, and whether the head is still tied to the embeddings.
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _cpu_fsdp import enable_cpu_fsdp  # noqa: E402
from _trainer_utils import finish_distributed  # noqa: E402

enable_cpu_fsdp()

import engine_matrix_script  # noqa: E402
import torch  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from hf_rlloss.trainer import RLLossGRPOTrainer  # noqa: E402

PROBES: dict[str, dict] = {}  # case (the run folder's name) -> probes


def _probe(trainer) -> dict:
    return PROBES.setdefault(
        os.path.basename(trainer.args.output_dir), {"head_calls": [], "sharded_after_logps": [], "after_train": None}
    )


def _get_head_weight(self, unwrapped):
    raw = self._causal_lm(unwrapped).get_output_embeddings().weight
    weight = _original_get_head_weight(self, unwrapped)
    _probe(self)["head_calls"].append(
        {"sharded": isinstance(raw, DTensor), "shape": tuple(weight.shape), "grad": torch.is_grad_enabled()}
    )
    return weight


def _compute_per_token_logps(self, model, *args, **kwargs):
    out = _original_compute_per_token_logps(self, model, *args, **kwargs)
    head = self._causal_lm(self.accelerator.unwrap_model(model)).get_output_embeddings().weight
    _probe(self)["sharded_after_logps"].append(isinstance(head, DTensor))
    return out


def _all_dtensor(module) -> bool:
    return module is not None and all(isinstance(p, DTensor) for p in module.parameters())


def _train(self, *args, **kwargs):
    out = _original_train(self, *args, **kwargs)
    lm = self._causal_lm(self.accelerator.unwrap_model(self.model))
    head = lm.get_output_embeddings().weight
    _probe(self)["after_train"] = {
        "policy_fsdp_module": isinstance(self.model, FSDPModule),
        "policy_all_dtensor": _all_dtensor(self.model),
        "ref_fsdp_module": isinstance(self.ref_model, FSDPModule),
        "ref_all_dtensor": _all_dtensor(self.ref_model),
        "head_local_shape": tuple(head.to_local().shape) if isinstance(head, DTensor) else None,
        "head_full_shape": tuple(head.shape),
        "tied": head is lm.get_input_embeddings().weight,
    }
    return out


_original_get_head_weight = RLLossGRPOTrainer.get_head_weight
_original_train = RLLossGRPOTrainer.train
_original_compute_per_token_logps = RLLossGRPOTrainer.compute_per_token_logps
RLLossGRPOTrainer.get_head_weight = _get_head_weight
RLLossGRPOTrainer.train = _train
RLLossGRPOTrainer.compute_per_token_logps = _compute_per_token_logps


def main() -> None:
    if "--untied" in sys.argv:  # a separate LM head (the engine-matrix model ties it to the embeddings)
        sys.argv.remove("--untied")
        engine_matrix_script.make_model = functools.partial(engine_matrix_script.make_model, tie=False)
    engine_matrix_script.main(finish=False)  # rank 0 still adds the probes below
    if int(os.environ.get("RANK", "0")) == 0:
        out = sys.argv[sys.argv.index("--out") + 1]
        results = torch.load(out, weights_only=False)
        for case, record in results.items():
            record["fsdp2"] = PROBES[case]
        torch.save(results, out)
    finish_distributed()


if __name__ == "__main__":
    main()
