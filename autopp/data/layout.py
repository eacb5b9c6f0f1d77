"""The parallel layout: every degree of a training step, its ZeRO stage, and the one map between a global rank and
its coordinates.

Modelled on torchtitan's `ParallelDims` (torchtitan/distributed/parallel_dims.py): one frozen value holds every
degree, is validated once, and numbers the ranks of the device mesh. Ranks are laid out row-major over `MESH_AXES`,
pipeline outermost and tensor parallelism innermost, as torchtitan's mesh ["pp", "dp", "cp", "tp"] and Megatron-LM's
default order "tp-cp-ep-dp-pp" (tp fastest, pp slowest; megatron/core/parallel_state.py) do: a tensor-parallel group
is consecutive devices, and a stage's replicas are neighbours. The planner costs links with this map
(`Cluster.placed`), `autopp run` numbers its processes and builds its DeviceMesh with it, and the exporters describe
it; nothing else spells it out.

Expert parallelism does not add devices: as in torchtitan, its groups are carved out of the data-parallel, context
and tensor-parallel ranks of a pipeline rank (ep divides dp x cp x tp); so are expert tensor parallelism's, beside
ep's (ep x etp divides them; autopp.data.axes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from ..errors import LayoutError
from .axes import AXES, UNPLANNED, check_planned, group_axes  # UNPLANNED, check_planned: re-exported
from .fields import is_int
from .zero import NO_ZERO, ZeroStage, zero_stage

__all__ = ["MESH_AXES", "Coords", "Layout", "LayoutPins", "UnitView", "UNPLANNED", "check_planned", "uses_mesh",
           "LAYOUT_FIELDS", "LAYOUT_KEYS", "layout_fields", "layout_of"]

#: The device mesh's dimensions, outermost first: the order in which `Layout.rank` numbers the ranks.
MESH_AXES = ("pp", "dp", "cp", "tp")
#: The axes whose ranks average their gradients (`Axis.syncs`: dp, cp), and those of them inside a pipeline rank's
#: group of devices (cp).
_SYNC_AXES = tuple(a.name for a in AXES.values() if a.syncs)
_SYNC_IN_GROUP = tuple(a.name for a in AXES.values() if a.syncs and a.in_group)


class Coords(NamedTuple):
    """A rank's place in the mesh."""

    pp: int
    """Pipeline rank."""
    dp: int
    """Data-parallel replica."""
    cp: int = 0
    """Context-parallel rank (the sequence shard)."""
    tp: int = 0
    """Tensor-parallel rank."""


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How one training step is spread over the devices: every parallel degree and the ZeRO stage."""

    pp: int = 1
    """Pipeline ranks per replica."""
    v: int = 1
    """Stages per pipeline rank (2 for V schedules, the interleaving degree for interleaved ones)."""
    dp: int = 1
    """Data-parallel replicas: each runs the whole pipeline on global batch / dp samples."""
    cp: int = 1
    """Context-parallel degree: each sequence sharded over cp ranks, attention as ring attention
    (autopp.costmodel.context)."""
    tp: int = 1
    """Tensor-parallel degree: each pipeline rank of each replica is a group of tp devices sharding its modules."""
    ep: int = 1
    """Expert-parallel degree, carved out of dp x cp x tp."""
    etp: int = 1
    """Expert-tensor-parallel degree, carved beside ep: each expert's GEMMs sharded over etp ranks (ep > 1)."""
    zero: ZeroStage = NO_ZERO
    """How the data parallelism shards parameters, gradients and optimizer state (autopp.data.zero)."""
    sp: bool = False
    """Sequence parallelism with the tensor parallelism (Korthikanti et al. 2022): the norms between the sharded
    projections run on 1/tp of the sequence, each TP all-reduce a reduce-scatter + all-gather. Needs tp > 1."""
    dp_replicate: int = 1
    """HSDP (torchtitan's `data_parallel_replicate_degree`, FSDP2's 2-D mesh (replicate, shard)): the dp replicas
    form dp_replicate groups of dp / dp_replicate neighbours (`shard`); a sharding ZeRO stage shards inside a group
    and the groups all-reduce their shards' gradients. 1: the ZeRO stage shards over all dp (plain FSDP)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in ("zero", "sp"):
                _check_degree(f.name, getattr(self, f.name))
        if not isinstance(self.zero, ZeroStage):  # a programming error: readers parse the stage number
            raise TypeError(f"Layout.zero must be a ZeroStage, got {self.zero!r}")
        _check_zero(self.zero, self.sync)
        _check_replicate(self.dp_replicate, self.dp, self.zero, self.ep)
        _check_ep(self.ep, self.etp, self.dp, self.cp, self.tp)
        _check_sp(self.sp, self.tp)

    @property
    def world(self) -> int:
        """Processes (devices) in all: pp x dp x cp x tp."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def group(self) -> int:
        """Devices that act together as one pipeline rank of one replica (cp x tp): the planner sees each such group
        as one rank (`Cluster.tp_groups`)."""
        return self.cp * self.tp

    @property
    def sync(self) -> int:
        """Ranks that hold the same parameters and average their gradients after a step, and over which a sharding
        ZeRO stage shards: dp x cp (as torchtitan's `dp_shard_cp` mesh and Megatron-LM's data-parallel group with
        context parallelism: a context-parallel rank computes gradients of the same weights on its share of the
        sequence). The cost model's gradient synchronisation and ZeRO terms read it here, never dp alone."""
        return math.prod(getattr(self, a) for a in _SYNC_AXES)

    @property
    def shard(self) -> int:
        """The ranks a sharding ZeRO stage shards over: `sync` / dp_replicate (all of `sync` without HSDP)."""
        return self.sync // self.dp_replicate

    @property
    def sync_per_group(self) -> int:
        """The `sync` ranks among the devices of one pipeline rank's group (`group`; cp): on a cluster of nodes they
        sit on the group's node, so the synchronisation group spans sync / sync_per_group groups
        (`terms.allreduce_time`)."""
        return math.prod(getattr(self, a) for a in _SYNC_IN_GROUP)

    @property
    def sync_axes(self) -> tuple[str, ...]:
        """The mesh's dimensions (`mesh_axes`) whose ranks make up the `sync` group, outermost first."""
        return tuple(a for a in self.mesh_axes if a in _SYNC_AXES)

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's size along each of `MESH_AXES`."""
        return tuple(getattr(self, axis) for axis in MESH_AXES)

    @property
    def stages(self) -> int:
        """Pipeline stages of one replica: pp x v."""
        return self.pp * self.v

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The device mesh's dimensions as the runner builds it, in `MESH_AXES` order: pp, dp and tp always (its
        groups; a dimension of size 1 is a group of one), cp only above 1. Dimensions of size 1 do not change the
        numbering, so the mesh's ranks are the ones `rank` numbers."""
        return tuple(a for a in MESH_AXES if a != "cp" or self.cp > 1)

    def rank(self, coords: Coords) -> int:
        """The global rank (and device slot) at `coords`: row-major over `MESH_AXES`."""
        rank = 0
        for axis, size in zip(MESH_AXES, self.shape):
            index = getattr(coords, axis)
            if not 0 <= index < size:
                raise LayoutError(f"{axis} coordinate {index} is outside 0..{size - 1}")
            rank = rank * size + index
        return rank

    def coords(self, rank: int) -> Coords:
        """The coordinates of global rank `rank` (the inverse of `rank`)."""
        if not 0 <= rank < self.world:
            raise LayoutError(f"rank {rank} is outside 0..{self.world - 1} of {self.describe()}")
        out: list[int] = []
        for size in reversed(self.shape):
            rank, index = divmod(rank, size)
            out.append(index)
        return Coords(*reversed(out))

    def along(self, axis: str, coords: Coords) -> tuple[int, ...]:
        """The global ranks that differ from `coords` only along `axis`, in order: its group on that axis."""
        return tuple(self.rank(coords._replace(**{axis: i})) for i in range(getattr(self, axis)))

    def check_devices(self, devices: int) -> None:
        """A LayoutError unless the layout uses exactly `devices` devices."""
        if self.world != devices:
            raise LayoutError(f"{self.describe(' * ')} = {self.world} != devices ({devices})")

    def unit_view(self) -> UnitView:
        """The part of the layout a unit's costs depend on (the planner's cache key beside the microbatch size)."""
        sync = self.shard if not self.zero.replicated else 1
        return UnitView(tp=self.tp, cp=self.cp, ep=self.ep, sync=sync, zero=self.zero if self.sync > 1 else NO_ZERO,
                        sp=self.sp, fsdp=self.fsdp, ep_replicas=self.dp // (self.ep * self.etp) if self.ep > 1 else 1,
                        replicate=self.dp_replicate, etp=self.etp)

    @property
    def fsdp(self) -> bool:
        """Whether the ZeRO stage runs as FSDP2 outside a pipeline: pp 1 and a stage that reshards after forward
        (3), sharded over more than one rank. FSDP2 then reshards each unit after its forward and after its
        backward and reduce-scatters every microbatch's gradients, as torchtitan's FSDP runs; under torch's
        pipelining (pp > 1) the stage keeps parameters gathered and gradients whole until the last microbatch
        (autopp.costmodel.parallel)."""
        return self.pp == 1 and bool(self.zero.fsdp_reshard_after_forward) and self.sync > 1

    def describe(self, sep: str = " x ") -> str:
        """The degrees as messages print them: "pp(2) x dp(2) x tp(2)", degrees of 1 beyond pp and dp left out;
        "tp(2)+sp" with sequence parallelism."""
        shown = [a for a in AXES if a in ("pp", "dp") or getattr(self, a) > 1]
        hsdp = f"[{self.dp_replicate}x{self.dp // self.dp_replicate}]" if self.dp_replicate > 1 else ""
        return sep.join(f"{a}({getattr(self, a)})" + ("+sp" if a == "tp" and self.sp else "")
                        + (hsdp if a == "dp" else "") for a in shown)


@dataclass(frozen=True, kw_only=True)
class LayoutPins:
    """A partial Layout: the degrees and ZeRO stage a planning request fixes; None leaves one to the search. The
    defaults are the planner's: dp, cp, tp and ep 1 and ZeRO 0 unless asked for, pp and v searched (v over 2 and 4;
    V schedules always use 2)."""

    pp: int | None = None
    v: int | None = None
    dp: int | None = 1
    cp: int | None = 1
    tp: int | None = 1
    ep: int | None = 1
    etp: int | None = 1
    zero: ZeroStage | None = NO_ZERO
    sp: bool | None = False
    """Sequence parallelism pinned on or off; None: searched where tp > 1 and the profile has its rows."""
    dp_replicate: int | None = 1
    """HSDP's replicate degree (`Layout.dp_replicate`) pinned; None: searched (every divisor of dp below it, with a
    sharding ZeRO stage)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("zero", "sp") and value is not None:
                _check_degree(f.name, value)
        if self.zero is not None and self.dp is not None and self.cp is not None:
            _check_zero(self.zero, self.dp * self.cp)
        if self.ep is not None:  # etp beside ep 1 at once; the divisibility once dp, cp and tp are pinned
            _check_ep(self.ep, self.etp or 1, self.dp, self.cp, self.tp)
        if self.sp and self.tp is not None:
            _check_sp(self.sp, self.tp)
        if self.dp_replicate not in (1, None) and self.dp is not None:
            _check_replicate(self.dp_replicate, self.dp, self.zero, self.ep or 1)

    def check_devices(self, devices: int) -> None:
        """A LayoutError unless the pinned degrees can multiply to `devices`: each divides it, and so does their
        product (the other degrees searched), or it equals `devices` (none searched)."""
        pinned = {a: getattr(self, a) for a in MESH_AXES if getattr(self, a) is not None}
        for axis, value in pinned.items():
            if devices % value:
                raise LayoutError(f"{axis}({value}) does not divide the {devices} devices: give `{axis}` one of "
                                  f"{[d for d in range(1, devices + 1) if devices % d == 0]}")
        product = math.prod(pinned.values())
        shown = " * ".join(f"{a}({v})" for a, v in pinned.items() if a in ("pp", "dp", "tp") or v > 1)
        if len(pinned) == len(MESH_AXES) and product != devices:
            raise LayoutError(f"{shown} = {product} != devices ({devices})")
        if devices % product:
            raise LayoutError(f"{shown} = {product} does not divide the {devices} devices")
        r = self.dp_replicate or 1
        rest = self.dp if self.dp is not None else devices // product
        if r > 1 and (rest % r or rest == r):  # HSDP needs a dp it divides, above it
            raise LayoutError(f"`dp_replicate` {r} must divide dp and be below it, and the {devices} devices leave "
                              f"dp {rest} at most: give `dp_replicate` 1, or more devices")

    def per_group(self) -> LayoutPins:
        """The pins as the search over groups of devices sees them (`PlanRequest.view`): the axes inside a group
        (`Axis.in_group`: cp, tp) at 1, each group one pipeline rank; a ZeRO stage that shards over cp alone (dp
        pinned 1) left out: the groups' replicas shard nothing."""
        zero = self.zero if self.zero is None or self.zero.replicated or self.dp != 1 else None
        return LayoutPins(**{**{f.name: getattr(self, f.name) for f in fields(self)},
                             **{a.name: 1 for a in group_axes()}, "sp": False, "zero": zero})

    @staticmethod
    def of(layout: Layout) -> LayoutPins:
        """Every field of `layout` pinned."""
        return LayoutPins(**{f.name: getattr(layout, f.name) for f in fields(layout)})


class UnitView(NamedTuple):
    """What a unit's costs depend on beyond the microbatch size (`Layout.unit_view`): its tensor-parallel, context
    and expert degrees, and the gradient-synchronisation ranks (`Layout.sync`) only where its ZeRO stage shards over
    them."""

    tp: int
    cp: int
    ep: int
    sync: int
    """`Layout.sync` under a sharding ZeRO stage, else 1."""
    zero: ZeroStage
    sp: bool = False
    """Sequence parallelism with the tensor parallelism (`Layout.sp`)."""
    ep_replicas: int = 1
    """With ep > 1, the data-parallel ranks holding the same experts (dp / (ep x etp)), over which their gradients
    are averaged; 1 without expert parallelism."""
    fsdp: bool = False
    """ZeRO as FSDP2 outside a pipeline (`Layout.fsdp`)."""
    replicate: int = 1
    """HSDP's replicas of each shard group (`Layout.dp_replicate`): they all-reduce the shards' gradients."""
    etp: int = 1
    """Expert tensor parallelism beside ep (`Layout.etp`): each expert's GEMMs and bytes over etp more ranks."""

    @property
    def group(self) -> int:
        """Devices acting as one pipeline rank (`Layout.group`)."""
        return self.cp * self.tp

    @property
    def sharded(self) -> bool:
        """Whether a ZeRO stage shards the unit's bytes over the synchronisation ranks."""
        return self.sync > 1

    @property
    def sync_per_group(self) -> int:
        """`Layout.sync_per_group` where the view is `sharded`, else 1."""
        return math.prod(getattr(self, a) for a in _SYNC_IN_GROUP) if self.sharded else 1

    def local(self) -> UnitView:
        """The view of one group of devices alone (no ZeRO sharding): what `sharded` views are computed from."""
        return self._replace(sync=1, zero=NO_ZERO, fsdp=False, replicate=1)


def _check_degree(name: str, value: object) -> None:
    if not is_int(value, 1):
        raise LayoutError(f"`{name}` must be an integer >= 1, got {value!r}")


def _check_zero(zero: ZeroStage, sync: int) -> None:
    if not zero.replicated and sync == 1:  # dp x cp
        raise LayoutError(f"{zero} shards over data-parallel replicas, and dp is 1: give `dp` > 1 (or search `dp`), "
                          "or `zero` 0")


def _check_replicate(replicate: int, dp: int, zero: ZeroStage | None, ep: int) -> None:
    if replicate == 1:
        return
    if dp % replicate or replicate == dp:
        raise LayoutError(f"`dp_replicate` {replicate} must divide dp({dp}) and be below it (HSDP shards over dp / "
                          "dp_replicate ranks)")
    if zero is not None and zero.replicated:
        raise LayoutError(f"`dp_replicate` {replicate} replicates ZeRO's shards, and ZeRO 0 shards nothing: give "
                          "`zero` 1 or 3, or `dp_replicate` 1")
    if ep > 1:
        raise LayoutError(f"`dp_replicate` {replicate} with `ep` {ep}: autopp plans HSDP without expert "
                          "parallelism; give `dp_replicate` 1 or `ep` 1")


def _check_sp(sp: object, tp: int) -> None:
    if not isinstance(sp, bool):
        raise LayoutError(f"`sp` must be true or false, got {sp!r}")
    if sp and tp == 1:
        raise LayoutError("`sp` (sequence parallelism) shards the sequence over the tensor-parallel ranks, and tp is "
                          "1: give `tp` > 1, or `sp` off")


def _check_ep(ep: int, etp: int, dp: int | None, cp: int | None, tp: int | None) -> None:
    if etp > 1 and ep == 1:
        raise LayoutError(f"`etp` {etp} shards the experts of an ep group, and ep is 1: give `ep` > 1, or `etp` 1")
    if dp is not None and cp is not None and tp is not None and (dp * cp * tp) % (ep * etp):
        carved = f"ep({ep})" + (f" x etp({etp})" if etp > 1 else "")
        raise LayoutError(f"{carved} must divide dp({dp}) * cp({cp}) * tp({tp}) = {dp * cp * tp}")


def uses_mesh(layout: Layout) -> bool:
    """Whether the layout shards anything inside a pipeline rank (its `group`: tensor, context parallelism) or over
    its replicas (ZeRO, expert parallelism), which `autopp run` runs through a DeviceMesh, DTensor and FSDP2, not
    as plain pipeline replicas."""
    return layout.group > 1 or not layout.zero.replicated or layout.ep > 1


#: A layout's fields in plan and run-report JSON, with their least values: `num_ranks` (its world size), `pp` (0:
#: num_ranks // (dp x cp x tp), in files that predate the field), `dp`, `virtual_stages` (its v), `tp` and `zero`
#: (written when tp > 1 or ZeRO > 0), `cp`, `ep`, `etp` and `dp_replicate` (HSDP; written when above 1).
LAYOUT_FIELDS = {"num_ranks": 1, "pp": 0, "dp": 1, "virtual_stages": 1, "cp": 1, "tp": 1, "ep": 1, "zero": 0,
                 "dp_replicate": 1, "etp": 1}
#: Every JSON key of a layout: `LAYOUT_FIELDS` and the flag `sp` (true or false; written only when true, so plans
#: without sequence parallelism read and write as before it existed).
LAYOUT_KEYS = (*LAYOUT_FIELDS, "sp")


def layout_fields(layout: Layout) -> dict[str, int | bool]:
    """The layout's JSON fields (`LAYOUT_FIELDS`), as files written before the newer axes existed spell them."""
    out = {"num_ranks": layout.world, "pp": layout.pp, "dp": layout.dp, "virtual_stages": layout.v}
    if layout.tp > 1 or not layout.zero.replicated:
        out.update(tp=layout.tp, zero=layout.zero.stage)
    out.update({axis: getattr(layout, axis) for axis in ("cp", "ep", "dp_replicate", "etp")
                if getattr(layout, axis) > 1})
    return out | ({"sp": True} if layout.sp else {})


def layout_of(data: Mapping[str, Any]) -> Layout:
    """The Layout of JSON fields (`LAYOUT_FIELDS`, their types checked by the reader); a LayoutError naming
    `num_ranks` when the degrees do not multiply to it."""
    dp, cp, tp = data.get("dp", 1), data.get("cp", 1), data.get("tp", 1)
    pp = data.get("pp", 0) or data["num_ranks"] // max(dp * cp * tp, 1)
    try:
        zero = zero_stage(data.get("zero", 0))
    except LayoutError as exc:
        raise LayoutError(f"field 'zero': {exc}") from None
    if not isinstance(data.get("sp", False), bool):
        raise LayoutError(f"field 'sp' must be true or false, got {data['sp']!r}")
    layout = Layout(pp=pp, v=data.get("virtual_stages", 1), dp=dp, cp=cp, tp=tp, ep=data.get("ep", 1), zero=zero,
                    sp=data.get("sp", False), dp_replicate=data.get("dp_replicate", 1), etp=data.get("etp", 1))
    if layout.world != data["num_ranks"]:
        raise LayoutError(f"{layout.describe(' * ')} != num_ranks ({data['num_ranks']})")
    return layout
