"""Causal attention on this CPU, measured against the share the analytic count gives it (docs/analytic.md, "Causal
attention counted as its kernel computes it").

torch's FLOP formula for scaled_dot_product_attention counts every query-key pair; a causal fused kernel skips the
blocks above the diagonal. autopp counts `autopp.measure.counting.causal_computed` of the formula: per block of
queries, its key blocks up to the diagonal, with the blocks of torch's CPU flash kernel here (`CPU_TILES`) and
FlashAttention's 128 x 128 for a GPU (`GPU_TILES`). This times, in one process and one thread (as autopp's CPU ranks
and profiles run), the forward and the forward + backward of `F.scaled_dot_product_attention` with and without
`is_causal`, interleaved in every repeat (best of `--repeats`), and prints causal / full beside the counted share.

    .venv/bin/python scripts/bench_causal_attention.py            # 512-4,096 tokens, 8 heads of 64: ~1 min quiet
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from autopp.measure.counting import CPU_TILES, GPU_TILES, causal_computed


def _seconds(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, backward: bool) -> float:
    start = time.perf_counter()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    if backward:
        out.sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"# one thread, batch 1, {args.heads} heads of {args.head_dim}, float32; best of {args.repeats}, causal and "
          "full interleaved; timings of this machine at this moment")
    print("| tokens | pass | full ms | causal ms | causal / full | counted (CPU blocks) | counted (GPU blocks) |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for s in args.tokens:
        for backward in (False, True):
            q, k, v = (torch.randn(1, args.heads, s, args.head_dim, requires_grad=backward) for _ in range(3))
            best = {False: float("inf"), True: float("inf")}
            for _ in range(args.repeats):
                for causal in (False, True):
                    best[causal] = min(best[causal], _seconds(q, k, v, causal, backward))
            print(f"| {s:,} | {'forward + backward' if backward else 'forward'} | {best[False] * 1e3:.1f} | "
                  f"{best[True] * 1e3:.1f} | {best[True] / best[False]:.3f} | {causal_computed(s, s, CPU_TILES):.3f} "
                  f"| {causal_computed(s, s, GPU_TILES):.3f} |", flush=True)


if __name__ == "__main__":
    main()
