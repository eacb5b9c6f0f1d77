"""Count one piece's work without running it: under torch's FakeTensorMode (on meta parameters), per aten op of the
forward, the full backward, the input-gradient and the weight-gradient phase, its FLOPs (torch.utils.flop_counter's
own formulas, and `grouped_mm_flops` for mixture-of-experts layers) and the bytes it reads and writes; the bytes
autograd saves; the most tensor bytes live at once during a forward and backward, temporaries included. Nothing is
materialized."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from ..costmodel.roofline import ATTENTION_OPS, OpCounts
from ..schedule.activation import SAVED_OPS
from .fusion import Kept, OpTouches, fuse_elementwise, fusible, kept_of
from .memory import LiveBytes, SavedOps, saved_storages, storage_key, tensors_in, value_bytes
from .timing import Piece, run_phases

__all__ = ["FLOP_FORMULAS", "LINEAR_MATMULS", "NAMED_FLOP_FORMULAS", "grouped_mm_flops", "expert_weight_bytes_unread",
           "expert_weight_bytes", "Tiles", "CPU_TILES", "GPU_TILES", "attention_tiles", "causal_computed",
           "causal_share_of_formula", "PieceCounts", "OpCounter", "count_piece"]

#: torch's FLOP formulas, plus its CPU attention kernels under the formulas of the GPU ones (same arguments first:
#: query, key, value; and grad_out before them for the backward), which torch.utils.flop_counter leaves out.
FLOP_FORMULAS = {**flop_registry,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
                     flop_registry[torch.ops.aten._scaled_dot_product_flash_attention],
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
                     flop_registry[torch.ops.aten._scaled_dot_product_flash_attention_backward]}


@dataclass(frozen=True)
class Tiles:
    """The blocks a fused attention kernel computes its scores in: `key` keys against `query(q_len)` queries. Under a
    causal mask the kernel skips every block whose keys all lie after its queries, and computes the others whole
    (the diagonal's masked half included), so its work is `causal_computed` of the q_len x k_len pairs."""

    key: int
    query_blocks: tuple[tuple[int, int], ...]
    """(least query length, query block) pairs, longest first: the block of the first the query length reaches."""

    def query(self, q_len: int) -> int:
        return next(block for least, block in self.query_blocks if q_len >= least)


#: torch's CPU flash kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp, `flash_attention_kernel_impl` and its
#: backward): 512 keys a block; 256 queries at 768 or more, 64 at 192 or more, else 32; causal: each query block
#: runs its key blocks up to the last key its last query sees (`num_keys`). Measured against the count on this
#: machine: scripts/bench_causal_attention.py (docs/analytic.md, "Causal attention on this CPU").
CPU_TILES = Tiles(512, ((768, 256), (192, 64), (0, 32)))
#: A GPU's fused kernels: FlashAttention-2's blocks of 128 x 128 (Dao 2023, arXiv:2307.08691, s.3.1: blocks of 64 or
#: 128 a side; under a causal mask the blocks whose keys all come after their queries, about half at long sequences,
#: are skipped, for a 1.7-1.8x speed-up). Blocks of 64 or 256 would count -1.5 % or +3 % of this at 4,096 tokens.
GPU_TILES = Tiles(128, ((0, 128),))


def attention_tiles(fused: bool) -> Tiles:
    """The blocks of the attention kernel counted: a GPU's (`fused`, autopp.model.fake_cpu.fused_attention) or the
    CPU's."""
    return GPU_TILES if fused else CPU_TILES


def causal_computed(q_len: int, k_len: int, tiles: Tiles) -> float:
    """The share of the q_len x k_len query-key pairs a kernel of `tiles` computes under torch's causal mask
    (query i sees keys 0..i, the top-left alignment of `is_causal`): per block of queries, its key blocks up to
    the one holding the last key its last query sees."""
    q_block, computed = tiles.query(q_len), 0
    for first in range(0, q_len, q_block):
        rows = min(q_block, q_len - first)
        seen = min(first + rows, k_len)
        computed += rows * min(k_len, -(-seen // tiles.key) * tiles.key)
    return computed / (q_len * k_len) if q_len * k_len else 1.0


def _arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments by their schema's names, defaults included."""
    named = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
    named.update(zip((a.name for a in func._schema.arguments), args))
    return {**named, **kwargs}


def causal_share_of_formula(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], tiles: Tiles) -> float:
    """The share of a fused attention op's FLOP formula (torch's: every query-key pair) that its kernel computes:
    `causal_computed` when the op is a `scaled_dot_product` kernel called with is_causal, else 1. Its bytes are
    left whole (a kernel reads every key block at least once per query block)."""
    if not func.name().startswith(ATTENTION_OPS):
        return 1.0
    named = _arguments(func, args, kwargs)
    query, key = named.get("query"), named.get("key")
    if not named.get("is_causal") or not isinstance(query, torch.Tensor) or not isinstance(key, torch.Tensor):
        return 1.0
    return causal_computed(query.shape[-2], key.shape[-2], tiles)


def _moved_bytes(t: torch.Tensor) -> int:
    """Bytes an op reads or writes through `t`: its elements, or its storage when smaller (broadcast views)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def grouped_mm_flops(mat_a: torch.Tensor, mat_b: torch.Tensor, *_args: Any, out_val: torch.Tensor, **_kw: Any
                     ) -> int:
    """FLOPs of `aten._grouped_mm(mat_a, mat_b, offs)`: 2 x M x K x N summed over the groups, which is 2 x the
    output's elements x the contraction, the grouped dimension taken whole: in a MoE layer's 2d x 3d forward the
    rows are the routed (token, expert) pairs, tokens x top-k, all computed (HF's experts drop no token), so the
    count does not depend on how the router spreads them; 2d x 2d (an expert weight's gradient, the contraction
    grouped) is 2 x M x N x K with K the whole; 3d x 2d and 3d x 3d likewise. Under fake tensors `offs` has no
    values: the count assumes every row (2d x 3d) or column (3d x 2d) is inside a group, `offs[-1]` the whole
    dimension, as transformers' offsets (a cumulative count of every routed pair) are."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return 2 * mat_a.shape[0] * mat_a.shape[1] * mat_b.shape[1]
    return 2 * out_val.numel() * mat_a.shape[-1]


def _fallback_flops(inp: torch.Tensor, weight: torch.Tensor, *_args: Any, **_kw: Any) -> int:
    """transformers' `grouped_mm_fallback(input (S, K), weight (G, K, N), offs)`, the loop of `torch.mm` per expert
    that transformers exports instead of `torch._grouped_mm` in float32 (transformers/integrations/moe.py): 2 S K N."""
    return 2 * inp.shape[0] * inp.shape[1] * weight.shape[2]


def _fallback_backward_flops(inp: torch.Tensor, weight: torch.Tensor, *_args: Any, **_kw: Any) -> int:
    """Its backward (`grouped_mm_fallback_backward`): the input's and the weights' gradients, 2 S K N each."""
    return 2 * _fallback_flops(inp, weight)


#: FLOP formulas of ops torch has none for, by operator name (an op of a library that may not be loaded).
NAMED_FLOP_FORMULAS: dict[str, Callable[..., int]] = {
    "aten::_grouped_mm": grouped_mm_flops,
    "transformers::grouped_mm_fallback": _fallback_flops,
    "transformers::grouped_mm_fallback_backward": _fallback_backward_flops}

#: Ops whose second argument stacks one weight per expert, read for the routed rows of the first (2d, (S, K)).
_EXPERT_WEIGHT_READS = frozenset({"aten::_grouped_mm", "transformers::grouped_mm_fallback",
                                  "transformers::grouped_mm_fallback_backward"})


def expert_weight_bytes_unread(name: str, args: tuple[Any, ...]) -> int:
    """Bytes of the stacked expert weights (G, K, N) that a grouped matmul of S routed rows does not read, under the
    routing assumption of the analytic profile: tokens spread evenly over the experts (as Megatron's MoE benchmarks
    force it), so min(G, S) experts get rows and the others' weights are not read; 0 for other ops and shapes."""
    if name not in _EXPERT_WEIGHT_READS or len(args) < 2:
        return 0
    rows, weight = args[0], args[1]
    if not (isinstance(rows, torch.Tensor) and isinstance(weight, torch.Tensor)) or rows.dim() != 2 \
            or weight.dim() != 3:
        return 0
    experts = weight.shape[0]
    idle = experts - min(experts, rows.shape[0])
    return _moved_bytes(weight) * idle // experts


def expert_weight_bytes(name: str, args: tuple[Any, ...], out: Any) -> int:
    """Bytes of stacked expert weights that a grouped GEMM of routed rows (its first argument 2-d, (S, K)) reads or
    writes: its 3-d operand (G, K, N), the weights of the forward and the input gradient, and its 3-d outputs, the
    weights' gradient (2-d x 2-d, the contraction grouped), less the experts no row reaches
    (`expert_weight_bytes_unread`): what expert parallelism divides among the ranks (autopp.costmodel.experts);
    0 for every other op."""
    if name not in _EXPERT_WEIGHT_READS or not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 2:
        return 0
    stacked = [t for t in tree_leaves((args[1:2], out)) if isinstance(t, torch.Tensor) and t.dim() == 3]
    return sum(_moved_bytes(t) for t in stacked) - expert_weight_bytes_unread(name, args)


#: The matmuls a linear layer dispatches to (`F.linear` folds a batch into `aten.mm`/`aten.addmm`; both gradients
#: are `aten.mm`), and the grouped GEMMs of MoE experts (`aten._grouped_mm`): what an FP8 recipe runs in FP8
#: (torchao's Float8Linear and float8 grouped GEMMs, Transformer Engine's Linear and GroupedLinear replace exactly
#: these). Attention's kernels and batched matmuls stay at the compute dtype.
LINEAR_MATMULS = frozenset({torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten._grouped_mm})

#: Ops that move no data: metadata queries and checks (torch.export's `_assert_tensor_metadata`, which asserts a
#: tensor's dtype and device) and aliasing (views are recognised by their schema; `_unsafe_view`, the view `reshape`
#: and `matmul` take of a fresh result, e.g. a linear layer's `mm` output back to (batch, seq, features), has no
#: view schema but is one: ATen's `_unsafe_view` is `view` without the alias bookkeeping, no kernel runs).
_FREE = {torch.ops.aten.detach.default, torch.ops.prim.device.default, torch.ops.aten.lift_fresh.default,
         torch.ops.aten.alias.default, torch.ops.aten._assert_tensor_metadata.default,
         torch.ops.aten._unsafe_view.default}


class OpCounter(TorchDispatchMode):
    """Records, per aten op that reaches dispatch, its FLOPs (FLOP_FORMULAS; 0 without one), the bytes of its
    tensor inputs and outputs and, of those, the stacked expert weights' (`expert_weight_bytes`). Unlike
    FlopCounterMode, an op without a formula is not decomposed: the kernel that runs is counted (a fused
    `silu_backward` is one op that allocates one output, not seven). A causal fused attention counts the share of
    its formula its kernel computes with `tiles` (`causal_share_of_formula`; torch's formula has no causal term).
    `fuse`: the counts as fused elementwise kernels run them (autopp.measure.fusion), from the storages each op
    touched, which op made each, and which outlived the mode."""

    def __init__(self, tiles: Tiles = CPU_TILES, fuse: bool = False) -> None:
        super().__init__()
        self.tiles = tiles
        self.fuse = fuse
        self.flops: list[int] = []
        self.bytes: list[int] = []
        self.linear: list[bool] = []
        self.expert_weight: list[int] = []
        self.names: list[str] = []
        self._touched: list[tuple[tuple[int, int], ...]] = []
        self._fusible: list[bool] = []
        self._kept: list[bool] = []  # the op's output is one selective recomputation keeps (`SAVED_OPS`)
        self._serials: dict[int, int] = {}  # storage_key -> serial, while the storage lives
        self._made: dict[int, int] = {}
        self._rewritten: dict[int, list[int]] = {}  # serial -> the ops that wrote it after its maker (in place)
        self._sizes: dict[int, int] = {}  # serial -> its storage's bytes
        self._keys: dict[int, int] = {}  # serial -> storage_key
        self._saved: dict[int, int] = {}  # serial -> bytes, of what autograd saved (`saved`)
        self._saved_untracked: dict[int, int] = {}  # storage_key -> bytes, saved but touched by no op counted
        self._alive_or_gone: dict[int, bool] = {}  # serial -> whether its storage is alive
        self._outlived: frozenset[int] = frozenset()

    def _serial(self, t: torch.Tensor) -> tuple[int, bool]:
        """The serial of `t`'s storage (its key may be reused once it is freed) and whether it was seen first now."""
        key = storage_key(t)
        if key in self._serials:
            return self._serials[key], False
        serial = self._serials[key] = len(self._alive_or_gone) + 1
        self._alive_or_gone[serial] = True
        self._sizes[serial], self._keys[serial] = t.untyped_storage().nbytes(), key
        weakref.finalize(t.untyped_storage(), self._freed, key, serial)
        return serial, True

    def _freed(self, key: int, serial: int) -> None:
        if self._serials.get(key) == serial:
            del self._serials[key]
        self._alive_or_gone[serial] = False

    def _touch(self, func: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        """Record the storages the op read and wrote, and those it made (autopp.measure.fusion.OpTouches)."""
        touched = [(self._serial(t)[0], _moved_bytes(t)) for t in inputs]
        for t in outputs:
            serial, new = self._serial(t)
            if new:
                self._made[serial] = len(self._touched)
            else:  # an in-place write (views never reach here): the storage's value is this op's too
                self._rewritten.setdefault(serial, []).append(len(self._touched))
            touched.append((serial, _moved_bytes(t)))
        self._touched.append(tuple(touched))
        self._fusible.append(fusible(func) and len({t.device for t in inputs + outputs}) <= 1)  # no offload copy
        self._kept.append(str(func.overloadpacket) in SAVED_OPS)

    def __exit__(self, *exc: Any) -> None:
        self._outlived = frozenset(s for s, alive in self._alive_or_gone.items() if alive)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _FREE or getattr(func, "is_view", False):
            return out
        name = func.name()
        formula = FLOP_FORMULAS.get(func._overloadpacket) or NAMED_FLOP_FORMULAS.get(name)
        f = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        f = round(f * causal_share_of_formula(func, args, kwargs, self.tiles)) if f else 0
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        moved = sum(_moved_bytes(t) for t in inputs + outputs) - expert_weight_bytes_unread(name, args)
        if self.fuse:
            self._touch(func, inputs, outputs)
        self.flops.append(int(f))
        self.bytes.append(int(moved))
        self.linear.append(func._overloadpacket in LINEAR_MATMULS)
        self.expert_weight.append(expert_weight_bytes(name, args, out))
        self.names.append(name)
        return out

    def counts(self, rerun: bool = False) -> OpCounts:
        """What was counted, as fused kernels run it under `fuse`; `rerun` (under `fuse`, of a forward): what
        selective recomputation reruns of it, its kernels less the ops whose outputs it keeps
        (autopp.measure.fusion)."""
        counted = OpCounts(tuple(self.flops), tuple(self.bytes), tuple(self.linear), tuple(self.expert_weight),
                           tuple(self.names))
        if not self.fuse:
            if rerun:
                raise ValueError("a forward's rerun is derived under fuse only (eager counts run it)")
            return counted
        return fuse_elementwise(counted, self._touches(), self._kept if rerun else ())

    def _touches(self) -> OpTouches:
        return OpTouches(tuple(self._touched), tuple(self._fusible), dict(self._made), self._outlived,
                         dict(self._sizes), {s: tuple(ops) for s, ops in self._rewritten.items()})

    def saved(self, t: torch.Tensor) -> None:
        """Note that autograd saved `t` (a `memory.saved_storages` hook, called while its storage lives)."""
        key = storage_key(t)
        if key in self._serials:
            self._saved[self._serials[key]] = t.untyped_storage().nbytes()
        else:
            self._saved_untracked[key] = t.untyped_storage().nbytes()

    def kept(self, static: set[int]) -> Kept:
        """After a forward under `fuse`: what fused kernels keep for its backward (`fusion.kept_of`), params free."""
        if not self.fuse:
            raise ValueError("what fused kernels keep is derived under fuse only")
        free = {self._serials[k] for k in static if k in self._serials}
        return kept_of(self._touches(), self._saved, self._keys, free, self._saved_untracked)


@dataclass(frozen=True)
class PieceCounts:
    """What one piece does per microbatch, counted."""

    forward: OpCounts
    backward: OpCounts
    """The full backward (input and weight gradients at once)."""
    backward_input: OpCounts
    """torch's stage_backward_input (empty for a piece without input gradients, as measured profiles record it)."""
    backward_weight: OpCounts
    """torch's stage_backward_weight after it (the whole backward for a piece without input gradients)."""
    activation_bytes: int
    output_bytes: int
    peak_bytes: int
    """Most bytes live at once during one forward and full backward, beyond the parameters and the inputs: saved
    activations, outputs, temporaries, and the gradients as they are made."""
    selective_recompute: OpCounts = OpCounts()
    """What selective recomputation reruns: the forward's ops outside `SAVED_OPS` (autopp.schedule.activation)."""
    selective_bytes: int = 0
    """What selective recomputation keeps: the outputs of the forward's ops in `SAVED_OPS` (`memory.SavedOps`)."""

    def passes(self) -> dict[str, OpCounts]:
        """The counted passes by name: forward, the full backward, its input and weight parts, and selective
        recomputation's rerun (the recomputed forward is the forward)."""
        return {"forward": self.forward, "backward": self.backward, "backward_input": self.backward_input,
                "backward_weight": self.backward_weight, "selective_recompute": self.selective_recompute}


def _counted(run: Callable[[], Any], tiles: Tiles, fuse: bool) -> tuple[Any, OpCounts]:
    """`run()`'s result and its counts (`OpCounter.counts`)."""
    with OpCounter(tiles, fuse) as counter:
        result = run()
    return result, counter.counts()


def _static_storages(piece: Piece, fake: Any) -> tuple[set[int], list[torch.Tensor]]:
    """Storages of the piece's parameters and buffers: the meta ones and their fake conversions, which FakeTensorMode
    memoises and hands to every op as long as they live (the caller keeps the returned conversions alive)."""
    tensors = [*piece.module.parameters(), *piece.module.buffers()]
    converted = [fake.from_tensor(t) for t in tensors if t.device.type == "meta"]
    return {storage_key(t) for t in tensors + converted}, converted


def count_piece(piece: Piece, fake: Any, tiles: Tiles = CPU_TILES, fuse: bool = False) -> PieceCounts:
    """Count `piece` (its args fake tensors of `fake`, a FakeTensorMode that is active) through the phases the
    profiler times (autopp.measure.timing.run_phases): forward and full backward (the live bytes, what autograd
    saves and what selective recomputation keeps counted across them), then input and weight gradients, then the
    ops selective recomputation reruns; the recompute forward is not run (it counts the same ops as the forward).
    `tiles`: the fused attention kernel's blocks (`GPU_TILES` where a GPU is counted); `fuse`: each pass's ops as
    fused elementwise kernels run them (autopp.measure.fusion), what they keep for the backward (`OpCounter.kept`)
    and their peak (the backward's from what they keep, the forward's less what it held then, not kept). The output's
    bytes are those of what the piece's module returns: for the last piece the model's output, before its `finish`
    (the loss), which torch's last stage holds per in-flight microbatch (`StageCost.output_bytes`)."""
    static, _alive = _static_storages(piece, fake)
    sizes: dict[str, int] = {}
    finish = piece.finish

    def measured(out: Any) -> Any:  # the bytes only: holding `out` would change the live bytes counted
        sizes["output"] = value_bytes(out)
        return finish(out)
    piece = replace(piece, finish=measured)
    counts: dict[str, OpCounts] = {"backward_input": OpCounts()}
    rerun: dict[str, OpCounts] = {}  # fused: selective recomputation's rerun, from the forward's record
    live = LiveBytes(static | {storage_key(t) for t in tensors_in(piece.args)})
    with contextlib.ExitStack() as across:  # the live bytes: from the forward to the end of the full backward

        def phase(_i: int, kind: str, run: Callable[[], Any] | None) -> Any:
            if run is None or kind == "recompute" or kind == "selective_recompute" and fuse:  # fused: the forward's
                return None
            if kind == "forward":
                across.enter_context(live)
                counter = OpCounter(tiles, fuse)

                def forward() -> Any:
                    with counter:
                        return run()
                with SavedOps(static) as selective:
                    (leaves, out), saved = saved_storages(forward, static, counter.saved if fuse else None)
                counts[kind], sizes["selective"] = counter.counts(), selective.bytes
                sizes["saved"] = sum(saved.values())
                if fuse:  # the forward's peak as eager's less what it held then and is not kept, the backward's
                    rerun["selective_recompute"] = counter.counts(rerun=True)  # counted from what is kept
                    kept = counter.kept(static)
                    sizes["saved"] = sum(kept.kept.values())
                    sizes["forward_peak"] = live.peak - live.held_at_peak(kept.dropped)
                    live.rebase(set(kept.dropped), kept.kept)
                return leaves, out
            result, counts[kind] = _counted(run, tiles, fuse)
            if kind == "backward":
                across.close()
            return result

        run_phases([piece], phase)
    counts.update(rerun)
    peak = max(sizes["saved"], live.peak, sizes.get("forward_peak", 0))
    return PieceCounts(forward=counts["forward"], backward=counts["backward"],
                       backward_input=counts["backward_input"], backward_weight=counts["backward_weight"],
                       activation_bytes=sizes["saved"], output_bytes=sizes["output"], peak_bytes=peak,
                       selective_recompute=counts["selective_recompute"], selective_bytes=sizes["selective"])
