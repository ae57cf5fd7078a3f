"""The engine matrix: each shipped accelerate config × sp_size trains one model: ran, engine, parity, memory, time.

Every cell is one `accelerate launch` of `tests/engine_matrix_script.py` (one case per launch, so that the peak RSS is
that case's) with the shipped config made to run on CPU (`tests/_launch.py`: `use_cpu`, fp32, sharding unchanged):
the same in-memory model, 3 steps with a KL to the reference and token-level rollout IS, AdamW (so that ZeRO's
optimizer-state sharding shows in the memory). Each cell is compared with DDP with the same number of processes and
sp_size: the largest difference of a final parameter, and of a per-step loss.

    python -m benchmarks.performance.engine_matrix                      # the default: 42M-parameter model (hidden
    768, 8 layers)
    python -m benchmarks.performance.engine_matrix --hidden-size 32 --layers 2 --optim sgd   # the tests' tiny model

Peak memory on CPU is the RSS high-water mark of each process: over the whole run (`ru_maxrss`, engine set-up
included), and over the training steps (`VmHWM` reset once the engine has run its first micro-batch). Both include
the Python, torch, transformers and DeepSpeed libraries (`start_rss_mb`: rank 0's RSS after the imports).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.shared import launch as _launch
from benchmarks.shared.provenance import ROOT, provenance

SCRIPT = ROOT / "tests" / "engine_matrix_script.py"
# FSDP2 on CPU needs the test-only shim that gives Accelerate a real FSDP state (tests/_cpu_fsdp.py); this script
# installs it and runs SCRIPT.
SCRIPTS = {"fsdp2": ROOT / "tests" / "fsdp2_script.py"}

# The shipped zero3.yaml's settings plus DeepSpeed's gathered-parameter cache turned off; "auto" is filled by
# transformers from the training arguments.
ZERO3_LOW_MEMORY = {
    "zero_optimization": {
        "stage": 3,
        "stage3_max_live_parameters": 1e6,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
        "stage3_param_persistence_threshold": "auto",
        "reduce_bucket_size": "auto",
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}

# name -> (accelerate config, processes, DDP reference, extra script arguments)
ENGINES = {
    "ddp": ("multi_process_cpu", 2, None, []),
    "zero2": ("zero2", 2, "ddp", []),
    "zero3": ("zero3", 2, "ddp", ["--zero3-init"]),
    # ZeRO-3 with DeepSpeed's parameter cache off (a DeepSpeed JSON, see ZERO3_LOW_MEMORY): what sharding saves on a
    # model below DeepSpeed's default 1e9-parameter live/reuse thresholds, which otherwise keep it all gathered
    "zero3_lowmem": ("zero3", 2, "ddp", ["--zero3-init"]),
    "fsdp2": ("fsdp2", 2, "ddp", []),
    "ddp4": ("multi_process_cpu", 4, None, []),
    "two_node": ("two_node_cpu", 4, "ddp4", []),
}


def launch(name: str, sp: int, cli, work: Path) -> dict:
    config_name, processes, _, extra = ENGINES[name]
    out_dir = work / f"{name}_sp{sp}"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / "out.pt"
    if cli.reuse and out.exists():
        record = torch.load(out, weights_only=False)[f"sp{sp}"]
        return {**record, "ran": True, "launch_s": float("nan")}
    args = [
        *extra,
        *["--cases", f"sp{sp}", "--out", str(out), "--steps", str(cli.steps)],
        *["--hidden-size", str(cli.hidden_size), "--layers", str(cli.layers)],
        *["--optim", cli.optim, "--learning-rate", str(cli.learning_rate), "--no-snapshot"],
    ]
    start = time.perf_counter()
    if config_name == "two_node_cpu":
        config = ROOT / "accelerate_configs" / "two_node_cpu.yaml"
        results = _launch.run_all(_launch.accelerate_launch_machines(config, SCRIPT, *args), cli.timeout, out_dir)
    else:
        overrides = {}
        if name == "zero3_lowmem":
            ds_config = out_dir / "ds_zero3_low_memory.json"
            ds_config.write_text(json.dumps(ZERO3_LOW_MEMORY, indent=1))
            overrides["deepspeed_config"] = {"deepspeed_config_file": str(ds_config), "zero3_init_flag": True}
        config = _launch.cpu_accelerate_config(config_name, out_dir, processes, **overrides)
        if overrides:  # with a DeepSpeed JSON, precision comes from it: accelerate refuses mixed_precision as well
            config.write_text(
                "\n".join(line for line in config.read_text().splitlines() if "mixed_precision" not in line)
            )
        script = SCRIPTS.get(name, SCRIPT)
        results = [_launch.run(_launch.accelerate_launch(config, script, *args), cli.timeout, out_dir)]
    launch_s = time.perf_counter() - start
    failed = [r.stderr[-3000:] for r in results if r.returncode != 0]
    if failed:
        return {"ran": False, "error": failed[0]}
    record = torch.load(out, weights_only=False)[f"sp{sp}"]
    record.update(ran=True, launch_s=launch_s)
    return record


# The package modules (and recipes) this benchmark measures: its results are stale once they change.
MEASURES = ("hf_rlloss", "accelerate_configs", "tests/engine_matrix_script.py")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--sp", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--optim", default="adamw_torch")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument(
        "--malloc-mmap-threshold", type=int, default=65536, help="glibc MALLOC_MMAP_THRESHOLD_ (bytes)"
    )
    parser.add_argument("--reuse", action="store_true", help="read the cells already in --work-dir, launch the rest")
    parser.add_argument("--work-dir", default="/tmp/hf_rlloss_engine_matrix")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "engine_matrix.json"))
    return parser


def main() -> None:
    parser = build_parser()
    cli = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if cli.malloc_mmap_threshold:  # freed buffers go back to the OS, so that RSS peaks are not the allocator's cache
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(cli.malloc_mmap_threshold)
    work = Path(cli.work_dir)
    records: dict[tuple[str, int], dict] = {}
    rows = []
    for name in cli.engines:
        for sp in cli.sp:
            record = records[(name, sp)] = launch(name, sp, cli, work)
            reference_name = ENGINES[name][2]
            reference = records.get((reference_name, sp)) if reference_name else None
            row = {"config": name, "sp": sp, "ran": record["ran"]}
            if record["ran"]:
                engine = record["engine"]
                row.update(
                    engine=engine["wrapper"] + (f" ZeRO-{engine['zero_stage']}" if engine["zero_stage"] else ""),
                    ref=f"{engine['ref_wrapper']}"
                    + (f" ZeRO-{engine['ref_zero_stage']}" if engine["ref_zero_stage"] is not None else ""),
                    processes=record["world_size"],
                    sp_groups=[r["sp_group_ranks"] for r in record["ranks"]],
                    local_ranks=[r["local_process_index"] for r in record["ranks"]],
                    peak_rss_mb=[round(x) for x in record["peak_rss_mb"]],
                    train_peak_rss_mb=[round(x) for x in record["train_peak_rss_mb"]],
                    start_rss_mb=round(record["start_rss_mb"]),
                    train_s=round(record["wall_s"], 1),
                    launch_s=round(record["launch_s"], 1),
                    losses=record["losses"],
                    moved=record["moved"],
                )
                if reference is not None and reference["ran"]:
                    row["max_param_diff_vs_ddp"] = max(
                        (reference["params"][k] - record["params"][k]).abs().max().item() for k in record["params"]
                    )
                    row["max_loss_diff_vs_ddp"] = max(
                        abs(a - b) for a, b in zip(reference["losses"], record["losses"])
                    )
            else:
                row["error"] = record["error"][-500:]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    model = {"hidden_size": cli.hidden_size, "layers": cli.layers, "optim": cli.optim, "steps": cli.steps}
    model["malloc_mmap_threshold"] = cli.malloc_mmap_threshold
    Path(cli.out).parent.mkdir(parents=True, exist_ok=True)
    with open(cli.out, "w") as f:
        json.dump({"meta": provenance(), "model": model, "torch": torch.__version__, "rows": rows}, f, indent=1)
    print("| config | sp | ran | engine (policy / reference) | max param diff vs DDP | max loss diff | peak RSS per "
          "rank, whole run (MiB) | peak RSS per rank, training steps (MiB) | train s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        if not row["ran"]:
            print(f"| {row['config']} | {row['sp']} | no | | | | | | |")
            continue
        diff = row.get("max_param_diff_vs_ddp")
        loss = row.get("max_loss_diff_vs_ddp")
        print(
            f"| {row['config']} | {row['sp']} | yes | {row['engine']} / {row['ref']} | "
            f"{'reference' if diff is None else f'{diff:.1e}'} | {'' if loss is None else f'{loss:.1e}'} | "
            f"{', '.join(map(str, row['peak_rss_mb']))} | {', '.join(map(str, row['train_peak_rss_mb']))} | "
            f"{row['train_s']} |"
        )


if __name__ == "__main__":
    main()
