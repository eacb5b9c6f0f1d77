"""Synthetic transformer-like profiles (embedding, n - 2 blocks, head) in the documented profile format, for benchmarks
and tests at sizes no machine here can measure."""

from __future__ import annotations

import random
from dataclasses import replace

import pandas as pd

from ..schedule.activation import Activation, policy
from .profile import EDGE_COLUMNS, UNIT_COLUMNS, Profile, ProfileMeta

__all__ = ["synthetic_profile", "synthetic_tp_rows"]

SIZES = (1, 8)
#: The plan a synthetic profile's TP rows stand for (a Megatron block: column-parallel in, row-parallel out).
SYNTHETIC_TP_PLAN = {"h.*.attn.qkv": "colwise", "h.*.attn.proj": "rowwise", "h.*.mlp.fc": "colwise",
                     "h.*.mlp.proj": "rowwise"}


def _row(unit: int, name: str, b: int, forward: float, params: int, activation: int, output: int) -> dict[str, object]:
    row: dict[str, object] = {c: 0 for c in UNIT_COLUMNS}
    backward = 2 * forward
    row.update(unit=unit, name=name, modules=name, microbatch_size=b, forward_s=forward, backward_s=backward,
               param_bytes=params, grad_bytes=params, optimizer_bytes=2 * params, activation_bytes=activation,
               output_bytes=output)
    if "backward_input_s" in row:  # the I/W split columns, when the profile format has them
        row.update(backward_input_s=backward / 2, backward_weight_s=backward / 2, recompute_s=forward)
    return row


def synthetic_tp_rows(units: pd.DataFrame, degrees: tuple[int, ...], *, hidden: int, seq: int,
                      sp: bool = False) -> pd.DataFrame:
    """`tp.csv` rows (docs/profile-format.md) for a synthetic profile's units at each degree: compute / t with 5 %
    lost per doubling (smaller matrices), every parameter sharded, activations as Korthikanti et al. count them
    without sequence parallelism (arXiv:2205.05198 eq. 2: 10 + 24 / t of 34 per s b h), and Megatron's collectives:
    per block 2 all-reduces of s b h float32 in F and 2 in B; the embedding 1 in F; the head 1 all-gather of its
    output (taken as 8 h wide) in F and 1 all-reduce in B. With `sp`, the column sequence parallelism reads
    (`sp_sequence_bytes`): a block's two LayerNorm inputs, 4 of its 34 s b h (Korthikanti et al.'s count)."""
    rows = []
    for t in degrees:
        slow = 1 + 0.05 * (t.bit_length() - 1)
        for r in units.itertuples():
            act = 4 * seq * hidden * int(r.microbatch_size)
            head, emb = r.name == "head", r.name == "emb"
            rows.append({"unit": r.unit, "microbatch_size": r.microbatch_size, "tp": t,
                         **{c: getattr(r, c) / t * slow for c in ("forward_s", "backward_s", "backward_input_s",
                                                                  "backward_weight_s", "recompute_s")},
                         **{c: getattr(r, c) // t for c in ("param_bytes", "grad_bytes", "optimizer_bytes")},
                         "activation_bytes": int(r.activation_bytes * (10 + 24 / t) / 34),
                         "tp_forward_allreduce_bytes": act * (1 if emb else 0 if head else 2),
                         "tp_backward_allreduce_bytes": act * (0 if emb else 1 if head else 2),
                         "tp_forward_allgather_bytes": 8 * act if head else 0,
                         "tp_forward_collectives": 1 if emb or head else 2,
                         "tp_backward_collectives": 0 if emb else 1 if head else 2,
                         **({"sp_sequence_bytes": 0 if emb or head else int(r.activation_bytes * 4 / 34)}
                            if sp else {})})
    return pd.DataFrame(rows)


#: With `selective`, the share of a unit's activation bytes it keeps and of its forward time it recomputes under
#: selective recomputation: the outputs of a block's matmuls and attention (q, k, v, the attention output, its
#: projection, the MLP's two matmuls: 16 of Korthikanti et al.'s 34 s b h) kept, the norms, activation function and
#: residual adds (a tenth of the forward here, being memory-bound) recomputed.
SELECTIVE_KEPT, SELECTIVE_REDONE = 16 / 34, 0.1


def synthetic_profile(num_units: int, *, hidden: int = 4096, seq: int = 2048, seed: int = 0,
                      jitter: float = 0.1, tp_degrees: tuple[int, ...] = (), selective: bool = False,
                      sp: bool = False) -> Profile:
    """A GPT-like profile: unit 0 embeds, units 1..n-2 are blocks, unit n-1 is the head; block times and sizes vary by
    +-`jitter` (seeded). Times follow 24 x seq x hidden^2 flops per sample at 100 TFLOP/s; float32 bytes. With
    `tp_degrees`, tensor-parallel rows of those degrees (`synthetic_tp_rows`; with `sp`, their sequence-parallel
    column); with `selective`, the selective recomputation columns (`SELECTIVE_KEPT`, `SELECTIVE_REDONE`)."""
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
    table = pd.DataFrame(units, columns=list(UNIT_COLUMNS))
    if selective:
        table = table.assign(**{c: v for c, v in zip(policy(Activation.SELECTIVE).columns, (
            (table.activation_bytes * SELECTIVE_KEPT).round().astype(int), table.forward_s * SELECTIVE_REDONE))})
    if tp_degrees:
        meta = replace(meta, tp_degrees=tuple(tp_degrees), tp_plan=dict(SYNTHETIC_TP_PLAN),
                       tp_plan_source="synthetic: Megatron's collectives per block (autopp.data.synthetic_profile)")
        return Profile(meta, table, pd.DataFrame(edges, columns=list(EDGE_COLUMNS)),
                       tp_units=synthetic_tp_rows(table, tp_degrees, hidden=hidden, seq=seq, sp=sp))
    return Profile(meta, table, pd.DataFrame(edges, columns=list(EDGE_COLUMNS)))
