"""A plan's stages: the simulator's costs of each and the least work per microbatch on the busiest rank."""

from __future__ import annotations

from autopp.data.stage_plan import StagePlan, busiest_rank
from autopp.schedule import ScheduleName
from autopp.schedule.sim_state import hidden_s


def _v(comm_s: float) -> tuple[StagePlan, ...]:
    """Two ranks in a V (stages 0 and 3 on rank 0, 1 and 2 on rank 1): F 1 s, B 2 s (I 1.5 + W 1), `comm_s` of
    all-to-alls in each F and B."""
    return tuple(StagePlan(index=i, rank=r, units=(i, i + 1), unit_names=("x",), split_point="x" if i else None,
                           forward_s=1.0, backward_s=2.0, backward_input_s=1.5, backward_weight_s=1.0,
                           memory_bytes=10, comm_s=comm_s) for i, r in enumerate([0, 1, 1, 0]))


def test_each_rank_runs_its_forwards_and_shorter_backwards() -> None:
    # F 1 + min(B 2, I + W 2.5) = 3 per stage, two stages per rank; nothing overlapped under ZB-V.
    assert busiest_rank(_v(0.25), ScheduleName.ZBV_ZERO_BUBBLE, 2) == (0, 6.0)


def test_dualpipev_takes_off_what_its_overlapped_pairs_hide() -> None:
    # The planner's DualPipeV MoE plans were refused on load ("field 'num_microbatches' is 16, but ... the file was
    # edited after planning"): the all-to-alls each F + B pair hides were still counted.
    stages = _v(0.25)
    costs = [s.cost() for s in stages]
    assert costs[0].forward_comm_s == costs[0].backward_comm_s == 0.25
    hid = hidden_s(costs[3], costs[0])  # min(compute 0.75 + 1.75, comm 0.25 + 0.25)
    assert hid == 0.5
    assert busiest_rank(stages, ScheduleName.DUAL_PIPE_V, 2) == (0, 6.0 - 2 * hid)
    assert busiest_rank(_v(0.0), ScheduleName.DUAL_PIPE_V, 2) == (0, 6.0)  # nothing to hide


def test_the_combined_1f1b_pairs_a_backward_with_any_forward_on_its_rank() -> None:
    """Interleaved1F1B under `ep_a2a` (Megatron-Core's combined 1F1B): a backward may run beside a forward of its
    own stage (another microbatch's), so each takes off the most any forward on its rank hides; without the switch,
    nothing."""
    stages = _v(0.25)
    costs = [s.cost() for s in stages]
    most = max(hidden_s(costs[t], costs[0]) for t in (0, 3))
    assert busiest_rank(stages, ScheduleName.INTERLEAVED_1F1B, 2, 2, ep_a2a=True) == (0, 6.0 - 2 * most)
    assert busiest_rank(stages, ScheduleName.INTERLEAVED_1F1B, 2, 2) == (0, 6.0)


def test_chimera_ranks_share_their_mirrored_replicas_work() -> None:
    stages = tuple(StagePlan(index=i, rank=i, units=(i, i + 1), unit_names=("x",), split_point="x" if i else None,
                             forward_s=f, backward_s=2 * f, memory_bytes=10) for i, f in enumerate([1.0, 3.0]))
    assert busiest_rank(stages, ScheduleName.ONE_F_ONE_B, 2) == (1, 9.0)
    assert busiest_rank(stages, ScheduleName.CHIMERA, 2) == (0, 6.0)  # (3 + 9) / 2 on each rank


def test_a_stage_without_its_split_backward_costs_half_each() -> None:
    old = StagePlan(index=0, rank=0, units=(0, 1), unit_names=("x",), split_point=None, forward_s=1.0,
                    backward_s=2.0, memory_bytes=10)
    c = old.cost()
    assert (c.backward_input_s, c.backward_weight_s, c.backward_s) == (1.0, 1.0, None)
