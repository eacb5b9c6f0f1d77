"""Each tensor-parallel degree's view of a request, and each configuration's unit arrays with its tensor- and
data-parallel terms (autopp.costmodel.parallel): what the search, the judge and the plan builder read."""

from __future__ import annotations

from ...costmodel import ProfileTable, UnitArrays, allreduce_times, data_sharded, tensor_parallel
from ...data.profile import Profile
from .request import PlanRequest, tp_choices

__all__ = ["ArraysKey", "arrays_key", "Views"]

#: (microbatch size, tp, ZeRO stage, dp): what a configuration's unit arrays depend on.
ArraysKey = tuple[int, int, int, int]


def arrays_key(b: int, tp: int, zero: int, dp: int) -> ArraysKey:
    """The key of the arrays of (b, tp, zero, dp): without replicas ZeRO changes nothing, and only ZeRO depends on
    dp."""
    zero = zero if dp > 1 else 0
    return (b, tp, zero, dp if zero else 1)


class Views:
    """The request as each tensor-parallel degree sees it (`PlanRequest.view`) and the unit arrays of each
    (microbatch size, tp, zero, dp), built once per search."""

    def __init__(self, profile: Profile, req: PlanRequest, table: ProfileTable | None = None) -> None:
        self.profile, self.req = profile, req
        self.tables: dict[int, ProfileTable] = {1: table or ProfileTable(profile)}
        self._requests: dict[int, PlanRequest] = {}
        self._arrays: dict[ArraysKey, UnitArrays] = {}

    def degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees to search (`tp_choices` over the profile's `tp_degrees`)."""
        return tuple(tp_choices(self.req, tuple(self.profile.meta.tp_degrees)))

    def request(self, tp: int) -> PlanRequest:
        if tp not in self._requests:
            self._requests[tp] = self.req.view(tp)
        return self._requests[tp]

    def arrays(self, b: int, tp: int = 1, zero: int = 0, dp: int = 1) -> UnitArrays:
        """Unit costs of one tensor-parallel rank at microbatch size `b` with its collectives (on the group's link,
        `Cluster.tp_link`), sharded by ZeRO stage `zero` over `dp` replicas (all-gathers and reduce-scatters on the
        data-parallel group of pipeline rank 0, `Cluster.dp_group`)."""
        key = arrays_key(b, tp, zero, dp)
        if key not in self._arrays:
            if key[3] == 1:  # no ZeRO sharding: the tensor-parallel rank's own costs
                if tp not in self.tables:
                    self.tables[tp] = ProfileTable(self.profile, tp)
                self._arrays[key] = tensor_parallel(self.tables[tp].arrays(b), tp, self.req.cluster.tp_link(tp))
            else:  # sharded from those, computed once per (b, tp)
                group = self.request(tp).cluster
                self._arrays[key] = data_sharded(self.arrays(b, tp), key[2], key[3],
                                                 lambda s: allreduce_times(s, key[3], group))
        return self._arrays[key]

    def whole(self, b: int) -> UnitArrays:
        """The unsharded costs of one microbatch of size `b` (no tensor or data parallelism): the ideal step's."""
        return self.tables[1].arrays(b)
