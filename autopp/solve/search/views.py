"""Each tensor-parallel degree's view of a request, and each configuration's unit arrays with its tensor- and
data-parallel terms (autopp.costmodel.parallel): what the search, the judge and the plan builder read."""

from __future__ import annotations

from dataclasses import replace

from ...costmodel import ProfileTable, UnitArrays, attention_shape, group_table, group_terms, replica_terms
from ...data.layout import Layout, UnitView
from ...data.profile import Profile
from ...data.trainers import frees_outputs
from .request import Group, PlanRequest, cp_choices, tp_choices

__all__ = ["ArraysKey", "arrays_key", "Views"]

#: The view of one device alone (no axis beyond the pipeline): the profile's own rows.
_WHOLE = Layout().unit_view()

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
        self.tables: dict[UnitView, ProfileTable] = {_WHOLE: table or ProfileTable(profile)}
        self._requests: dict[int, PlanRequest] = {}
        self._arrays: dict[ArraysKey, UnitArrays] = {}

    def degrees(self) -> tuple[Group, ...]:
        """The groups' degrees to search: each tensor-parallel degree (`tp_choices` over the profile's `tp_degrees`)
        with each context-parallel degree the sequence allows beside it (`cp_choices`)."""
        shape = attention_shape(self.profile)
        seq = None if shape is None else shape.seq_len
        return tuple(Group(cp, tp) for tp in tp_choices(self.req, tuple(self.profile.meta.tp_degrees))
                     for cp in cp_choices(self.req, tp, seq))

    def request(self, layout: Layout | UnitView) -> PlanRequest:
        """The request as `layout`'s groups of devices see it (`PlanRequest.view`)."""
        if layout.group not in self._requests:
            self._requests[layout.group] = self.req.view(layout.group)
        return self._requests[layout.group]

    def arrays(self, b: int, layout: Layout = Layout()) -> UnitArrays:
        """Unit costs of one device of `layout`'s groups at microbatch size `b` with the terms of the axes inside the
        group (`costmodel.group_terms`: tensor parallelism's collectives on the group's link), sharded by its ZeRO
        stage over its synchronisation ranks (`costmodel.replica_terms`: all-gathers and reduce-scatters on the group
        of pipeline rank 0, `Cluster.dp_group`)."""
        return self._arrays_of(b, layout.unit_view())

    def _arrays_of(self, b: int, view: UnitView) -> UnitArrays:
        key = (b, view)
        if key not in self._arrays:
            if not view.sharded:  # one group's own costs
                if view not in self.tables:
                    self.tables[view] = group_table(self.profile, view)
                own = replace(self.tables[view].arrays(b), overlap=self.req.assumed_overlap,
                              frees_outputs=frees_outputs(self.req.trainer, self.req.frees_outputs))
                self._arrays[key] = group_terms(own, view, self.req.cluster)
            else:  # sharded from those, computed once per (b, group)
                self._arrays[key] = replica_terms(self._arrays_of(b, view.local()), view, self.request(view).cluster)
        return self._arrays[key]

    def whole(self, b: int) -> UnitArrays:
        """The unsharded costs of one microbatch of size `b` (no tensor or data parallelism): the ideal step's."""
        return self.tables[_WHOLE].arrays(b)
