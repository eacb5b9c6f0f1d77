"""Each tensor-parallel degree's view of a request, and each configuration's unit arrays with its tensor- and
data-parallel terms (autopp.costmodel.parallel): what the search, the judge and the plan builder read."""

from __future__ import annotations

from ...costmodel import ProfileTable, UnitArrays, allreduce_times, data_sharded, tensor_parallel
from ...data.layout import Layout, UnitView
from ...data.profile import Profile
from .request import PlanRequest, tp_choices

__all__ = ["ArraysKey", "arrays_key", "Views"]

#: (microbatch size, the layout's unit view): what a configuration's unit arrays depend on.
ArraysKey = tuple[int, UnitView]


def arrays_key(b: int, layout: Layout) -> ArraysKey:
    """The key of the arrays of microbatch size `b` under `layout` (`Layout.unit_view`)."""
    return (b, layout.unit_view())


class Views:
    """The request as each tensor-parallel degree sees it (`PlanRequest.view`) and the unit arrays of each
    (microbatch size, layout), built once per search."""

    def __init__(self, profile: Profile, req: PlanRequest, table: ProfileTable | None = None) -> None:
        self.profile, self.req = profile, req
        self.tables: dict[int, ProfileTable] = {1: table or ProfileTable(profile)}
        self._requests: dict[int, PlanRequest] = {}
        self._arrays: dict[ArraysKey, UnitArrays] = {}

    def degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees to search (`tp_choices` over the profile's `tp_degrees`)."""
        return tuple(tp_choices(self.req, tuple(self.profile.meta.tp_degrees)))

    def request(self, layout: Layout | UnitView) -> PlanRequest:
        """The request as `layout`'s groups of devices see it (`PlanRequest.view`)."""
        if layout.group not in self._requests:
            self._requests[layout.group] = self.req.view(layout.group)
        return self._requests[layout.group]

    def arrays(self, b: int, layout: Layout = Layout()) -> UnitArrays:
        """Unit costs of one tensor-parallel rank of `layout` at microbatch size `b` with its collectives (on the
        group's link, `Cluster.tp_link`), sharded by its ZeRO stage over its replicas (all-gathers and
        reduce-scatters on the data-parallel group of pipeline rank 0, `Cluster.dp_group`)."""
        key = arrays_key(b, layout)
        view = key[1]
        if key not in self._arrays:
            if view.zero.replicated:  # no ZeRO sharding: the tensor-parallel rank's own costs
                tp = view.tp
                if tp not in self.tables:
                    self.tables[tp] = ProfileTable(self.profile, tp)
                self._arrays[key] = tensor_parallel(self.tables[tp].arrays(b), tp, self.req.cluster.tp_link(tp))
            else:  # sharded from those, computed once per (b, tp)
                group = self.request(view).cluster
                self._arrays[key] = data_sharded(self.arrays(b, Layout(tp=view.tp)), view.zero, view.dp,
                                                 lambda s: allreduce_times(s, view.dp, group))
        return self._arrays[key]

    def whole(self, b: int) -> UnitArrays:
        """The unsharded costs of one microbatch of size `b` (no tensor or data parallelism): the ideal step's."""
        return self.tables[1].arrays(b)
