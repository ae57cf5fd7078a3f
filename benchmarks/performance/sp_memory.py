"""Per-rank peak memory and step time of RLLossGRPOTrainer's training micro-batch at sp_size=1 vs sp_size=2.

What is measured is the trainer's sequence-parallel loss path on one long micro-batch: `pack_rows` (prompt +
completion packed into one row), `sp_shard_inputs`, the backbone forward under `ulysses_sequence_parallel` (with the
`"ulysses_sdpa"` attention; `sp=1` runs the same code without a mesh, i.e. plain SDPA), the loss layer from hidden
states (`cfg.build(data, sp_mesh)`, `build_batches`, `ctx(hidden_states=..., head_weight=...)`) and the backward.
Generation, DDP and the optimizer are left out: they do not depend on `sp_size`.

Every configuration runs in fresh processes (`python` for sp=1, `torchrun` for sp>1, gloo on CPU, NCCL on CUDA). A
warm-up step allocates the gradients first; the peak is then measured over the timed steps, per rank:

* CPU: RSS high-water mark minus the RSS before the timed steps (`/proc/self/clear_refs` resets the mark;
  `MALLOC_MMAP_THRESHOLD_` makes freed activations go back to the OS, so the baseline is not inflated);
* CUDA: `torch.cuda.max_memory_allocated` minus `memory_allocated` before the timed steps.

The step time is the median over the timed steps. Threads are split evenly: sp=1 gets all `--cores`, each of the
sp ranks `cores / sp` (no speed-up is expected on 2 CPU cores; memory per rank should drop by about `1/sp` for the
activations).

    python -m benchmarks.performance.sp_memory                                  # 2k, 4k, 8k tokens; sp 1 and 2
    python -m benchmarks.performance.sp_memory --tokens 2048 --sp 1 2 --steps 3 --hidden 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

from benchmarks.shared import launch
from benchmarks.shared.memory import reset_peak_rss, status_kb
from benchmarks.shared.provenance import ROOT, provenance


def _model(cli, device, mesh):
    """The Qwen2 model of the command line's shape (seed 0) on `device`, training, with the Ulysses attention under
    SP and activation checkpointing under `--grad-ckpt`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hf_rlloss.parallel import register_ulysses_attention
    from hf_rlloss.trainer.common.transformers_compat import enable_checkpointing

    config = Qwen2Config(
        vocab_size=cli.vocab,
        hidden_size=cli.hidden,
        intermediate_size=cli.intermediate or 3 * cli.hidden,
        num_hidden_layers=cli.layers,
        num_attention_heads=cli.heads,
        num_key_value_heads=cli.kv_heads,
        max_position_embeddings=cli.tokens + 64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device)
    model.set_attn_implementation(register_ulysses_attention() if mesh is not None else "sdpa")
    if cli.grad_ckpt:
        enable_checkpointing(model, {"use_reentrant": False})
    model.train()
    return model


def _micro_batch(cli, device):
    """One packed micro-batch of `--seqs` sequences of `--tokens / --seqs` tokens each (seed 1): the loss config, the
    packed layout, the labels, the old log-probs and the per-sequence advantages."""
    import torch

    from hf_rlloss import GRPOLossConfig
    from hf_rlloss.trainer.common.packing import pack_rows

    # one micro-batch of `seqs` sequences of tokens/seqs tokens each (a 128-token prompt, the rest completion)
    g = torch.Generator().manual_seed(1)
    per_seq = cli.tokens // cli.seqs
    prompt_len = min(128, per_seq // 2)
    prompt_ids = torch.randint(0, cli.vocab, (cli.seqs, prompt_len), generator=g).to(device)
    completion_ids = torch.randint(0, cli.vocab, (cli.seqs, per_seq - prompt_len), generator=g).to(device)
    packed = pack_rows(prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids))
    cfg = GRPOLossConfig(policy_loss_cfg={"loss_type": "vanilla"}, loss_agg_mode="token-mean")
    labels = packed.pack(completion_ids, cfg.ignore_idx)
    old = packed.pack(torch.full(completion_ids.shape, -8.3, device=device), 0.0)
    advantages = torch.randn(cli.seqs, generator=g).to(device)
    return cfg, packed, labels, old, advantages


def worker(cli) -> None:
    import torch
    import torch.distributed as dist

    from hf_rlloss import GRPOLossContext
    from hf_rlloss.parallel import build_sp_mesh, sp_shard_inputs, ulysses_sequence_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available() and not cli.cpu
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, cli.cores // world))
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    mesh = build_sp_mesh(world, device_type=device.type)

    model = _model(cli, device, mesh)
    cfg, packed, labels, old, advantages = _micro_batch(cli, device)
    input_ids, position_ids = sp_shard_inputs(packed.input_ids, packed.position_ids, mesh, 0)

    def step() -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        data = {
            "shifted_labels": labels,
            "advantages": advantages,
            "old_logprobs": old,
            "num_tokens": packed.num_tokens,
        }
        ctx = cfg.build(data, sp_mesh=mesh)
        GRPOLossContext.build_batches([ctx], grad_averaging_size=world)
        with ulysses_sequence_parallel(mesh):
            hidden = model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
            loss, _ = ctx(hidden_states=hidden, head_weight=model.lm_head.weight)
            loss.backward()
        del hidden, loss, ctx
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()  # warm-up: allocates the gradients (the same at every sp_size)
    if world > 1:
        dist.barrier()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
    else:
        if not reset_peak_rss():
            raise RuntimeError("cannot reset the RSS high-water mark (/proc/self/clear_refs)")
        baseline = status_kb("VmRSS") * 1024
    times = [step() for _ in range(cli.steps)]
    peak = (torch.cuda.max_memory_allocated(device) if cuda else status_kb("VmHWM") * 1024) - baseline
    result = {
        "rank": rank,
        "peak_mb": peak / 2**20,
        "baseline_mb": baseline / 2**20,
        "step_s": statistics.median(times),
        "times_s": times,
        "local_tokens": int(input_ids.shape[1]),
    }
    results = [None] * world
    if world > 1:
        dist.all_gather_object(results, result)
        dist.destroy_process_group()
    else:
        results = [result]
    if rank == 0:
        with open(cli.out, "w") as f:
            json.dump(results, f)


def _print_table(rows: list[dict]) -> None:
    """The rows as a Markdown table, each against `sp_size` 1 at its length."""
    print("| tokens | sp | tokens/rank | peak MB/rank (max) | vs sp=1 | step s | vs sp=1 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = next((b for b in rows if b["tokens"] == r["tokens"] and b["sp"] == 1), None)
        mem = f"{r['peak_mb_max'] / base['peak_mb_max']:.2f}×" if base else "-"
        speed = f"{r['step_s'] / base['step_s']:.2f}×" if base else "-"
        print(
            f"| {r['tokens']} | {r['sp']} | {r['local_tokens']} | {r['peak_mb_max']:.0f} | {mem} | "
            f"{r['step_s']:.2f} | {speed} |"
        )


def run(cli) -> None:
    model_args = [
        "--hidden", str(cli.hidden), "--layers", str(cli.layers), "--heads", str(cli.heads),
        "--kv-heads", str(cli.kv_heads), "--vocab", str(cli.vocab), "--intermediate", str(cli.intermediate),
        "--seqs", str(cli.seqs), "--steps", str(cli.steps), "--cores", str(cli.cores),
    ]  # fmt: skip
    if cli.grad_ckpt:
        model_args.append("--grad-ckpt")
    if cli.cpu:
        model_args.append("--cpu")
    os.makedirs(cli.results_dir, exist_ok=True)
    rows = []
    for tokens in cli.tokens:
        for sp in cli.sp:
            out = os.path.join(cli.results_dir, f".sp_memory_{tokens}_{sp}.json")
            launcher = launch.torchrun(sp)  # free port, timeout, every worker killed by PID
            cmd = [*launcher, "-m", "benchmarks.performance.sp_memory", "--worker", "--tokens", str(tokens)]
            cmd += ["--out", out, *model_args]
            env = {
                **os.environ,
                "OMP_NUM_THREADS": str(max(1, cli.cores // sp)),
                "MALLOC_MMAP_THRESHOLD_": "65536",  # freed activations go back to the OS
            }
            start = time.perf_counter()
            proc = launch.run(cmd, cli.timeout, cwd=ROOT, env=env)  # on timeout: every worker killed by PID
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"tokens={tokens} sp={sp} failed")
            with open(out) as f:
                ranks = json.load(f)
            os.remove(out)
            rows.append(
                {
                    "tokens": tokens,
                    "sp": sp,
                    "peak_mb_per_rank": [r["peak_mb"] for r in ranks],
                    "peak_mb_max": max(r["peak_mb"] for r in ranks),
                    "step_s": max(r["step_s"] for r in ranks),
                    "local_tokens": ranks[0]["local_tokens"],
                    "wall_s": time.perf_counter() - start,
                }
            )
            r = rows[-1]
            print(
                f"  tokens={tokens} sp={sp}: peak {r['peak_mb_max']:.0f} MB/rank, step {r['step_s']:.2f} s", flush=True
            )

    print()
    _print_table(rows)
    import torch

    meta = provenance() | {
        "device": "cuda" if torch.cuda.is_available() and not cli.cpu else "cpu",
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "model": {
            "hidden": cli.hidden,
            "layers": cli.layers,
            "heads": cli.heads,
            "kv_heads": cli.kv_heads,
            "vocab": cli.vocab,
            "intermediate": cli.intermediate or 3 * cli.hidden,
        },
        "seqs_per_micro_batch": cli.seqs,
        "timed_steps": cli.steps,
        "cores": cli.cores,
        "gradient_checkpointing": cli.grad_ckpt,
    }
    path = cli.out or os.path.join(cli.results_dir, f"sp_memory_{time.strftime('%Y%m%d-%H%M%S')}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"\nwrote {path}")


# The package modules (and recipes) this benchmark measures: its results are stale once they change.
MEASURES = ("hf_rlloss/loss", "hf_rlloss/trainer", "hf_rlloss/parallel")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192], help="tokens per micro-batch")
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--seqs", type=int, default=1, help="sequences packed into the micro-batch")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=0, help="MLP width (default 3 × hidden)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up step)")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="threads in all, split over ranks")
    parser.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing (non-reentrant)")
    parser.add_argument("--cpu", action="store_true", help="stay on CPU even if CUDA is available")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help="the results file (default: sp_memory_<date-time>.json in --results-dir)")
    return parser


def main() -> None:
    parser = build_parser()
    cli = parser.parse_args()
    if cli.worker:
        cli.tokens = cli.tokens[0]
        worker(cli)
    else:
        run(cli)


if __name__ == "__main__":
    main()
