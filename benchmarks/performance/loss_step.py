"""Forward+backward of the GRPO loss from hidden states: hf_rlloss vs TRL 1.16's chunked kernel vs naive logits.

Every measurement runs in a fresh subprocess (peak memory = RSS high-water mark minus the RSS once the inputs exist;
on CUDA, `torch.cuda.max_memory_allocated`), methods interleaved A/B/C within each repeat. Each
subprocess times `--steps` steps after one warm-up and reports their median; the reported time is the median of that
over repeats. The "GEMM floor" is the measured time of the three `tokens × hidden × vocab` matmuls
(logits, grad of hidden, grad of weight) that any exact method must do; `time / floor` says how close a method is.

    python -m benchmarks.performance.loss_step                       # 4096 tokens × {49k, 152k} vocab, hidden 576,
    fp32
    python -m benchmarks.performance.loss_step --dtype bf16          # the same in bfloat16 (hidden states and head
    weight)
    python -m benchmarks.performance.loss_step --tokens 1024 4096 8192 --vocab 151936 --repeats 5

`hf_rlloss` runs with the default epilogue (compiled for half precision, and for float32 from a 100k vocabulary);
`hf_rlloss_eager` and `hf_rlloss_compiled` force one or the other (`compile_epilogue`). In bf16 the naive method
computes bf16 logits and a float32 log-softmax (what a bf16 model's `logits.float()` does), and the floor is the
three GEMMs in bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

from benchmarks.shared.launch import python_module
from benchmarks.shared.memory import peak_rss_mb, reset_peak_rss, rss_mb
from benchmarks.shared.provenance import ROOT, provenance

METHODS = ("hf_rlloss", "trl_chunked", "naive", "gemm_floor")
EXTRA_METHODS = ("hf_rlloss_eager", "hf_rlloss_compiled")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _inputs(tokens, vocab, hidden, device, dtype):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=g) / hidden**0.5).to(device, dtype).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device, dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (tokens,), generator=g).to(device)
    adv = torch.randn(tokens, generator=g).to(device)
    old = (-torch.rand(tokens, generator=g) * 8).to(device)
    ref = old + 0.01 * torch.randn(tokens, generator=g).to(device)
    return h, w, labels, adv, old, ref


def _dapo_loss(logp, old, ref, adv, eps_low=0.2, eps_high=0.28, beta=0.001):
    """TRL's `dapo` per-token loss with its k3 KL, token mean (what `_compute_loss` does on the log-probs)."""
    import torch

    ratio = torch.exp(logp - old)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)
    kl = torch.exp(ref - logp) - (ref - logp) - 1
    return (per_token + beta * kl).sum() / logp.numel()


def _run_once(method, tokens, vocab, hidden, device, dtype_name, chunk_size=0, steps=1):
    import torch

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    h, w, labels, adv, old, ref = _inputs(tokens, vocab, hidden, device, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    if method.startswith("hf_rlloss"):
        from hf_rlloss import GRPOLossConfig, GRPOLossContext

        compile_epilogue = {"hf_rlloss": None, "hf_rlloss_eager": False, "hf_rlloss_compiled": True}[method]
        cfg = GRPOLossConfig(
            policy_loss_cfg={"cliprange_low": 0.2, "cliprange_high": 0.28},
            use_kl_loss=True,
            kl_loss_type="k3",
            chunk_size=chunk_size or None,
            compile_epilogue=compile_epilogue,
        )
        ctx = cfg.build(
            {
                "shifted_labels": labels[None],
                "advantages": adv[None],
                "old_logprobs": old[None],
                "ref_logprobs": ref[None],
            }
        )
        GRPOLossContext.build_batches([ctx])

        def step():
            loss, _ = ctx(hidden_states=h[None], head_weight=w)
            loss.backward()

    elif method == "trl_chunked":
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        def step():
            logp, entropy, *_ = ChunkedLogProbFunction.apply(h, w, None, labels, 1.0, 32768, None, 1.0, ("entropy",))
            _dapo_loss(logp, old, ref, adv).backward()

    elif method == "naive":

        def step():
            logits = (h @ w.t()).float()
            logp = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
            _dapo_loss(logp, old, ref, adv).backward()

    elif method == "gemm_floor":
        h, w = h.detach(), w.detach()

        def step():
            logits = h @ w.t()
            _ = logits @ w
            _ = logits.t() @ h

    else:
        raise ValueError(method)

    step()  # warm-up (allocator, lazy imports, kernels)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    h.grad = w.grad = None
    reset_peak_rss()
    baseline = rss_mb()
    times = []
    for _ in range(steps):
        h.grad = w.grad = None
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = peak_rss_mb() - baseline
    return {"seconds": seconds, "peak_mb": peak, "step_times": times}


def measure(method, tokens, vocab, hidden, device, dtype, chunk_size=0, steps=1):
    cmd = [*python_module("benchmarks.performance.loss_step"), "--_one", method, str(tokens), str(vocab), str(hidden)]
    cmd += [device, dtype, str(chunk_size), str(steps)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# The package modules (and recipes) this benchmark measures: its results are stale once they change.
MEASURES = ("hf_rlloss/loss",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (or a torch dtype name)")
    parser.add_argument("--chunk-size", type=int, default=0, help="hf_rlloss tokens per chunk (0: its default)")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--repeats", type=int, default=3, help="fresh subprocesses per method, interleaved")
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps per subprocess after one warm-up; their median is its time"
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS + EXTRA_METHODS)
    parser.add_argument(
        "--skip-naive-above", type=float, default=16.0, help="GiB of logits above which naive is skipped"
    )
    parser.add_argument("--out", default="benchmarks/results/loss_step.json")
    parser.add_argument("--_one", nargs=8, help=argparse.SUPPRESS)
    return parser


def main():
    parser = build_parser()
    args = parser.parse_args()
    if args._one:
        method, tokens, vocab, hidden, device, dtype, chunk, steps = args._one
        result = _run_once(method, int(tokens), int(vocab), int(hidden), device, dtype, int(chunk), int(steps))
        print(json.dumps(result))
        return
    args.dtype = DTYPES.get(args.dtype, args.dtype)

    rows = []
    for vocab in args.vocab:
        for tokens in args.tokens:
            methods = [
                m
                for m in args.methods
                if not (m == "naive" and tokens * vocab * 4 * 3 / 2**30 > args.skip_naive_above)
            ]
            samples = {m: [] for m in methods}
            for _ in range(args.repeats):
                for m in methods:  # interleaved: machine noise hits every method alike
                    samples[m].append(
                        measure(m, tokens, vocab, args.hidden, args.device, args.dtype, args.chunk_size, args.steps)
                    )
            row = {"tokens": tokens, "vocab": vocab, "hidden": args.hidden, "dtype": args.dtype}
            for m, runs in samples.items():
                row[f"{m}_s"] = statistics.median(r["seconds"] for r in runs)
                row[f"{m}_peak_mb"] = statistics.median(r["peak_mb"] for r in runs)
                row[f"{m}_runs_s"] = [round(r["seconds"], 3) for r in runs]
                row[f"{m}_runs_peak_mb"] = [r["peak_mb"] for r in runs]
            if "hf_rlloss" in samples and "gemm_floor" in samples:  # per repeat: the spread of the ratio itself
                pairs = zip(samples["hf_rlloss"], samples["gemm_floor"])
                row["floor_ratio_per_repeat"] = [round(a["seconds"] / b["seconds"], 3) for a, b in pairs]
            rows.append(row)
            _print_row(row)
    meta = provenance() | {
        "cpus": os.cpu_count(),
        "device": args.device,
        "dtype": args.dtype,
        "date": time.strftime("%Y-%m-%d"),
        "repeats": args.repeats,
        "steps_per_repeat": args.steps,
        "chunk_size": args.chunk_size or "default",
        "load_average_at_end": os.getloadavg(),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


def _cuda():
    import torch

    return torch.cuda.is_available()


def _print_row(row):
    t = row
    ours, floor = t.get("hf_rlloss_s"), t.get("gemm_floor_s")
    parts = [f"{t['dtype']} tokens={t['tokens']:>6} vocab={t['vocab']:>6}"]
    for m in METHODS + EXTRA_METHODS:
        if f"{m}_s" in t:
            parts.append(f"{m}: {t[f'{m}_s']:.2f}s {t[f'{m}_peak_mb']:.0f}MB")
    if ours and t.get("trl_chunked_s"):
        memory = t["hf_rlloss_peak_mb"] / t["trl_chunked_peak_mb"]
        parts.append(f"speedup vs TRL {t['trl_chunked_s'] / ours:.2f}x, memory ratio {memory:.2f}")
    if ours and t.get("naive_s"):
        parts.append(f"vs naive {t['naive_s'] / ours:.2f}x")
    if ours and floor:
        parts.append(f"time/GEMM floor {ours / floor:.2f} (per repeat {t.get('floor_ratio_per_repeat')})")
    for m in EXTRA_METHODS:
        if floor and t.get(f"{m}_s"):
            parts.append(f"{m}/floor {t[f'{m}_s'] / floor:.2f}")
    print(" | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
