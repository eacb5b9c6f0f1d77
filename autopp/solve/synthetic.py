"""Synthetic transformer-like profiles (embedding, n - 2 blocks, head) in the documented profile format, for benchmarks
and tests at sizes no machine here can measure."""

from __future__ import annotations

import random

import pandas as pd

from ..data.profile import EDGE_COLUMNS, UNIT_COLUMNS, Profile, ProfileMeta

__all__ = ["synthetic_profile"]

SIZES = (1, 8)


def _row(unit: int, name: str, b: int, forward: float, params: int, activation: int, output: int) -> dict[str, object]:
    row: dict[str, object] = {c: 0 for c in UNIT_COLUMNS}
    backward = 2 * forward
    row.update(unit=unit, name=name, modules=name, microbatch_size=b, forward_s=forward, backward_s=backward,
               param_bytes=params, grad_bytes=params, optimizer_bytes=2 * params, activation_bytes=activation,
               output_bytes=output)
    if "backward_input_s" in row:  # the I/W split columns, when the profile format has them
        row.update(backward_input_s=backward / 2, backward_weight_s=backward / 2, recompute_s=forward)
    return row


def synthetic_profile(num_units: int, *, hidden: int = 4096, seq: int = 2048, seed: int = 0,
                      jitter: float = 0.1) -> Profile:
    """A GPT-like profile: unit 0 embeds, units 1..n-2 are blocks, unit n-1 is the head; block times and sizes vary by
    +-`jitter` (seeded). Times follow 24 x seq x hidden^2 flops per sample at 100 TFLOP/s; float32 bytes."""
    rng = random.Random(seed)
    flops = 24 * seq * hidden * hidden / 100e12
    units, edges = [], []
    for u in range(num_units):
        kind = "emb" if u == 0 else "head" if u == num_units - 1 else f"h.{u - 1}"
        scale = 0.5 if u in (0, num_units - 1) else 1 + rng.uniform(-jitter, jitter)
        params = int(12 * hidden * hidden * 4 * scale)
        for b in SIZES:
            act, out = int(34 * seq * hidden * b * scale), 4 * seq * hidden * b
            units.append(_row(u, kind, b, flops * b * scale, params, act, out))
            if u:
                edges.append({"src": u - 1, "dst": u, "microbatch_size": b, "bytes": 4 * seq * hidden * b})
    names = tuple("emb" if u == 0 else "head" if u == num_units - 1 else f"h.{u - 1}" for u in range(num_units))
    meta = ProfileMeta(model_path=f"synthetic-{num_units}.py", fingerprint=f"synthetic-{num_units}-{seed}",
                       unit_names=names, split_points=names[1:], microbatch_sizes=SIZES, device="synthetic",
                       torch_version="none", num_threads=1, optimizer="adam", repeats=1, warmup=0)
    return Profile(meta, pd.DataFrame(units, columns=list(UNIT_COLUMNS)),
                   pd.DataFrame(edges, columns=list(EDGE_COLUMNS)))
