"""How the loss step's time and memory grow with the number of completion tokens (1k → 16k).

Runs `loss_step.py`'s measurement (fresh subprocess per point) for hf_rlloss, TRL 1.16's chunked kernel and naive
full logits, then fits peak memory against tokens: a method that materializes the logits grows by about
`vocab × 4 bytes` per token (196 MB per 1k tokens at vocab 49k); hf_rlloss should grow only with the hidden states.
Per-rank memory under sequence parallelism (sp=1 vs sp=2) is measured by `sp_memory.py`.

    python -m benchmarks.performance.scaling
    python -m benchmarks.performance.scaling --tokens 1024 4096 16384 --vocab 151936
"""

from __future__ import annotations

import argparse
import json
import os
import time

from benchmarks.performance.loss_step import measure
from benchmarks.shared.provenance import provenance


def _slope(xs, ys):
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


# The package modules (and recipes) this benchmark measures: its results are stale once they change.
MEASURES = ("hf_rlloss/loss",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--methods", nargs="+", default=["hf_rlloss", "trl_chunked", "naive"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="benchmarks/results/scaling.json")
    return parser


def main():
    parser = build_parser()
    args = parser.parse_args()

    rows = []
    for tokens in args.tokens:
        row = {"tokens": tokens}
        for method in args.methods:
            r = measure(method, tokens, args.vocab, args.hidden, args.device, "float32")
            row[f"{method}_s"], row[f"{method}_peak_mb"] = r["seconds"], r["peak_mb"]
        rows.append(row)
        print(" | ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    logits_mb_per_1k = 1000 * args.vocab * 4 / 2**20
    print(f"\nmemory slope, MB per 1k tokens (one fp32 logits row block: {logits_mb_per_1k:.0f} MB per 1k tokens)")
    slopes = {}
    for method in args.methods:
        slopes[method] = 1000 * _slope([r["tokens"] for r in rows], [r[f"{method}_peak_mb"] for r in rows])
        time_per_1k = 1000 * _slope([r["tokens"] for r in rows], [r[f"{method}_s"] for r in rows])
        print(f"  {method:<12} {slopes[method]:8.1f} MB/1k tokens   {time_per_1k:6.2f} s/1k tokens")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        meta = provenance() | {
            "vocab": args.vocab,
            "hidden": args.hidden,
            "date": time.strftime("%Y-%m-%d"),
            "cpus": os.cpu_count(),
        }
        json.dump({"meta": meta, "rows": rows, "memory_mb_per_1k_tokens": slopes}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
