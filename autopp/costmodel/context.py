"""Context parallelism's terms of each unit's cost: a rank's share of the sequence, and the K/V exchange of its ring
of cp ranks on the link it crosses, overlapped with the attention compute (docs/parallelism.md).

The scheme is ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers", arXiv:2310.01889) as
torch's `context_parallel` runs it (torch/distributed/tensor/experimental/_context_parallel/_attention.py, used by
torchtitan's `context_parallel_degree`) and Megatron-Core's context parallelism (`--context-parallel-size`, P2P ring
in transformer_engine's attention): each sequence is cut into 2 cp chunks, rank r holds chunks r and 2 cp - 1 - r
(head-tail load balancing for causal masks), and every attention layer passes each rank's K/V shard around the ring.

The model, per attention layer and microbatch, on a rank of a cp group (b samples of s tokens, tp ranks beside it):
- compute: the rank computes 1 / cp of every token-wise op and, balanced, 1 / cp of the causal attention's work
  (its 2 chunks of queries against the whole sequence's keys, half the pairs masked). Both are the profile's rows at
  b / cp samples of the full sequence (`ContextTable`: `ProfileTable` interpolates between sizes), which counts the
  quadratic part right; rows counted at s / cp tokens would count only (1 / cp)^2 of it. Activations, boundary
  tensors and working memory are those of b / cp samples as well: each rank keeps its own tokens only.
- exchange: a K/V shard is 2 x b x (s / cp) x ceil(kv heads / tp) x head size x dtype bytes; the forward passes it
  cp - 1 times (a ring step each), the backward passes K/V and returns dK/dV (twice the bytes per step). A step costs
  bytes / bandwidth + latency on the link the cp x tp devices of a group cross (`Cluster.tp_link`: inside a node
  when they fit one, else across nodes).
- overlap: each step's transfer runs under the previous step's block of attention compute (one block: the layer's
  attention time / cp on this rank), so a step is hidden when its transfer fits under one block, and only the excess
  is exposed: forward (cp - 1) x max(0, t - c), backward (cp - 1) x max(0, 2 t - c_b). The attention time is the
  unit's forward (backward) time times the attention's share of its FLOPs: 4 s^2 x heads x head size (/ 2 causal)
  against 2 x parameters x s of its matmuls, per sample, the attention's weighted by how much slower it runs (an
  analytic profile's e_c / e_a, `attention_slowdown`: its share of the time); embeddings' parameters count as
  matmuls, which only lowers the share (more exposure: an upper bound). The exposed time is added to F, the
  recomputed forward, I and B.
- memory: beside the profile's working memory, a step holds the next K/V shard and, in the backward, the dK/dV
  shards in flight: 2 shards (`transient`). The gradient synchronisation over dp x cp ranks is `Layout.sync`'s.
The ring is Megatron-Core's P2P exchange and torch's "alltoall" rotation; torch's default ("allgather", the only
one torchtitan 0.3 uses) gathers the cp - 1 shards in one collective overlapped with the first block only, which
exposes more when cp - 1 transfers outlast one block (the export says so: autopp.data.axes).

Limits (the short route of docs/architecture.md, "Add a parallel axis"): measured profiles are scaled, not measured
at the sharded shapes: a kernel's efficiency at s / cp tokens and per-call overheads are those of the profiled
sizes, extrapolated along their end segment below the smallest (`ProfileTable`); the attention's shape comes from
the HF config the profile was made from (`meta.extra["hf_config"]["attention"]`, autopp.data.hf_config), and its
layers from the units' module names (`attention_layers`): a model file's profile has neither, and cp is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np

from ..data.cluster import Link
from ..data.layout import UnitView
from ..data.profile import Profile
from ..errors import ProfileError
from .units import ProfileTable, UnitArrays

__all__ = ["AttentionShape", "attention_shape", "attention_layers", "attention_slowdown", "attention_flops",
           "causal_share", "check_sequence", "ContextTable", "context_parallel"]

#: Bytes per element of a profile's dtype (its activations').
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
#: A decoder layer (HF: model.layers.N, transformer.h.N, encoder.layer.N) or an attention module of a finer split.
_LAYER = re.compile(r"(^|\.)(layers|h|layer|blocks)\.\d+$|(^|\.)(self_attn|attn|attention)$")


@dataclass(frozen=True)
class AttentionShape:
    """The model's attention as context parallelism's cost needs it."""

    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    seq_len: int
    """Tokens per sample of the profile."""
    dtype_bytes: int


def attention_shape(profile: Profile) -> AttentionShape | None:
    """The attention's shape the profile records (`meta.extra["hf_config"]`: profiles of HF configs made since
    context parallelism), or None."""
    hf = profile.meta.extra.get("hf_config") or {}
    att = hf.get("attention")
    if not isinstance(att, dict):
        return None
    return AttentionShape(heads=int(att["heads"]), kv_heads=int(att["kv_heads"]), head_dim=int(att["head_dim"]),
                          causal=bool(att["causal"]), seq_len=int(hf["seq_len"]),
                          dtype_bytes=_DTYPE_BYTES.get(profile.meta.dtype, 4))


def attention_layers(profile: Profile) -> np.ndarray:
    """Per unit, how many attention layers it holds: its modules named as decoder layers or attention modules."""
    rows = profile.units[profile.units.microbatch_size == profile.units.microbatch_size.min()].sort_values("unit")
    return np.array([sum(bool(_LAYER.search(m)) for m in str(mods).split()) for mods in rows.modules],
                    dtype=np.float64)


def attention_slowdown(profile: Profile) -> float:
    """How much slower the profile's times run attention's FLOPs than its matmuls': an analytic profile's compute
    over attention efficiency (`extra.analytic`, autopp.costmodel.roofline.Efficiency.attention: 2 on a GPU by
    default), else 1 (measured, or attention at the compute efficiency)."""
    counted = profile.meta.extra.get("analytic") or {}
    attention, compute = counted.get("attention_efficiency"), counted.get("compute_efficiency")
    return float(compute) / float(attention) if attention and compute else 1.0


def attention_flops(profile: Profile, shape: AttentionShape) -> tuple[np.ndarray, np.ndarray]:
    """Per unit and sample, the attention's FLOPs (QK^T and PV: 4 s^2 x heads x head size, halved when causal) and
    all its FLOPs (those plus 2 x parameters x s of its matmuls; embeddings' parameters count as matmuls, which only
    lowers the attention's share), the attention's x `attention_slowdown` in both: FLOPs at the matmuls' speed, so
    that their ratio is the attention's share of the unit's time."""
    rows = profile.units[profile.units.microbatch_size == profile.units.microbatch_size.min()].sort_values("unit")
    params = rows.param_bytes.to_numpy(dtype=np.float64) / shape.dtype_bytes
    s = float(shape.seq_len)
    attention = (attention_layers(profile) * 4 * s * s * shape.heads * shape.head_dim * (0.5 if shape.causal else 1.0)
                 * attention_slowdown(profile))
    return attention, attention + 2 * params * s


def causal_share(profile: Profile) -> float | None:
    """The causal attention's share of the model's time (`attention_flops` summed over units), which sequence
    pipelining's chunk costs read (autopp.schedule.seqpipe, COST); None when the profile records no attention shape
    or a non-causal one (not a causal LM: no sequence pipelining)."""
    shape = attention_shape(profile)
    if shape is None or not shape.causal:
        return None
    attention, total = attention_flops(profile, shape)
    return float(attention.sum() / total.sum()) if total.sum() > 0 else None


def _required(profile: Profile, cp: int) -> AttentionShape:
    shape = attention_shape(profile)
    if shape is None:
        raise ProfileError(f"`cp` {cp}: the profile of {profile.meta.model_path} records no attention shape "
                           "(profiles of HF configs made since context parallelism do): profile the HF config again, "
                           "or plan with `cp` 1")
    return shape


def check_sequence(seq_len: int, cp: int, tp: int) -> str | None:
    """Why a sequence of `seq_len` tokens cannot be sharded over `cp` ranks beside `tp` (None: it can): causal load
    balancing cuts it into 2 cp chunks, each split again over the tp ranks by sequence parallelism, so torchtitan
    requires seq % (2 x cp x tp) == 0 (torchtitan/distributed/parallel_dims.py, `seq_len_divisor`)."""
    parts = 2 * cp * tp
    if seq_len % parts:
        return (f"`cp` {cp} with `tp` {tp}: context parallelism needs seq % (2 x cp x tp) == 0 for causal load "
                f"balancing, and {seq_len} % {parts} = {seq_len % parts}")
    return None


class ContextTable(ProfileTable):
    """A `ProfileTable` (at `tp`) of one rank of a cp group: the rows of b / cp samples, with per unit the K/V
    shard bytes and attention time of one ring step (module docstring) for `context_parallel`."""

    def __init__(self, profile: Profile, tp: int, cp: int) -> None:
        super().__init__(profile, tp)
        shape = _required(profile, cp)
        self.cp, self.shape = cp, shape
        self.layers = attention_layers(profile)
        attention, total = attention_flops(profile, shape)
        self.share = np.divide(attention, total, out=np.zeros(self.n), where=total > 0)
        s = float(shape.seq_len)
        kv_local = -(-shape.kv_heads // tp)
        self.shard_per_sample = 2 * (s / cp) * kv_local * shape.head_dim * shape.dtype_bytes

    def arrays(self, b: float) -> UnitArrays:
        a = super().arrays(b / self.cp)
        shard = b * self.shard_per_sample
        per_layer = np.divide(1.0, self.layers, out=np.zeros(self.n), where=self.layers > 0)
        block_f = a.forward * self.share * per_layer / self.cp
        block_b = a.backward * self.share * per_layer / self.cp
        transient = a.transient_bytes() + np.where(self.layers > 0, np.round(2 * shard), 0.0)
        return replace(a, transient=transient, cp_ring=(np.where(self.layers > 0, shard, 0.0), self.layers,
                                                         block_f, block_b))


def context_parallel(a: UnitArrays, view: UnitView, link: Link) -> UnitArrays:
    """`a` with the exposed part of its ring's K/V exchange (`a.cp_ring`, module docstring) on `link` added: the
    forward's to F and the recomputed forward, the backward's to I and B."""
    if view.cp == 1 or a.cp_ring is None:
        return a
    shard, layers, block_f, block_b = a.cp_ring
    step = shard / link.bandwidth_bytes_per_s + link.latency_s
    steps = layers * (view.cp - 1)
    forward = steps * np.maximum(0.0, step - block_f)
    backward = steps * np.maximum(0.0, 2 * step - block_b)
    return replace(a, forward=a.forward + forward, recompute=a.recompute + forward,
                   backward_input=a.backward_input + backward, backward=a.backward + backward)
