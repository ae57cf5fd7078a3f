"""The architecture matrix under sequence parallelism: every family's tiny model and micro-batch with sp_size=2.

Launched once by `tests/test_architectures.py` (`test_sequence_parallel_matrix`, HF_RLLOSS_FULL_MATRIX=1) through
torchrun with 2 gloo processes, one SP group: for each family given, each micro-batch of `SP_BATCHES` and each
layout the trainer packs an SP micro-batch into (`padding_free`, `shared_prefix`), `_architectures.run_sp_cell`
gives the `(B, C)` log-probs and the gradients of `Σ w · log p`, which rank 0 saves; the test compares them with
`run_cell` of `off` on one process.
`--force` families are switched to the Ulysses attention without the rule's check (to measure what it refuses);
`--broken` families run with the shard positions of rank 1 off by one, which the comparison must catch.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _architectures import SP_BATCHES, run_sp_cell, sp_model  # noqa: E402
from _trainer_utils import finish_distributed  # noqa: E402

from hf_rlloss.parallel.sequence import build_sp_mesh, sp_rank  # noqa: E402
from hf_rlloss.trainer.common import sp_batch  # noqa: E402

SP_SIZE = 2
MODES = ("padding_free", "shared_prefix")


def shifted_positions(sp_mesh):
    """`sp_shard_inputs` with rank 1's shard positions one too high, as a wrong shard offset would give."""
    original = sp_batch.sp_shard_inputs

    def broken(input_ids, position_ids, mesh, pad_token_id=0):
        ids, positions = original(input_ids, position_ids, mesh, pad_token_id)
        return ids, positions + int(sp_rank(sp_mesh) == 1)

    return original, broken


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", nargs="*", default=[])
    parser.add_argument("--force", nargs="*", default=[])
    parser.add_argument("--broken", nargs="*", default=[])
    cli = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = build_sp_mesh(SP_SIZE)
    results = {}
    runs = [(f, f, False) for f in cli.families] + [(f"forced:{f}", f, True) for f in cli.force]
    runs += [(f"broken:{f}", f, False) for f in cli.broken]
    for key, family, force in runs:
        original = None
        if key.startswith("broken:"):
            original, sp_batch.sp_shard_inputs = shifted_positions(mesh)
        try:
            for name, truncated in SP_BATCHES.items():
                for mode in MODES:
                    try:
                        cell = run_sp_cell(sp_model(family, SP_SIZE, force), mode, mesh, truncated)
                    except ValueError as error:  # recorded, the test reports it (both ranks raise alike)
                        cell = {"error": str(error)}
                    results.setdefault(key, {})[name, mode] = cell
        finally:
            if original is not None:
                sp_batch.sp_shard_inputs = original
    if dist.get_rank() == 0:
        torch.save(results, cli.out)
    finish_distributed()


if __name__ == "__main__":
    main()
