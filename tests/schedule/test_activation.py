"""Activation policies as descriptors (autopp.schedule.activation): what each keeps, redoes and holds, how the trainers
spell it, and the per-stage helpers."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from autopp.costmodel import UnitArrays
from autopp.errors import ScheduleError
from autopp.schedule.activation import Figures
from autopp.schedule import (POLICIES, Activation, StageCost, by_saving, chosen, order_key, parse_activation, policy,
                             tally)

KEEP, RECOMPUTE, SELECTIVE, OFFLOAD = Activation.KEEP, Activation.RECOMPUTE, Activation.SELECTIVE, Activation.OFFLOAD
BLOCKS, SELECTIVE_UNITS = Activation.BLOCKS, Activation.SELECTIVE_UNITS
COST = StageCost(forward_s=2.5, backward_input_s=1.0, backward_weight_s=1.0, activation_bytes=100, input_bytes=7,
                 own=((Activation.SELECTIVE, Figures(40, 0.25)),))


def _units(forward: list[float], recompute: list[float], activation: list[int],
           selective: tuple[list[int], list[float]] | None = None) -> UnitArrays:
    z = np.zeros(len(forward))
    a = UnitArrays(np.array(forward), z, z, np.array(recompute), z, np.array(activation, dtype=float), z, z,
                   np.zeros(len(forward) + 1), False, z)
    if selective is None:
        return a
    return replace(a, own={SELECTIVE: (np.array(selective[0], dtype=float), np.array(selective[1]))})


def test_selective_keeps_the_saved_ops_outputs_and_redoes_the_rest() -> None:
    sel = policy(SELECTIVE)
    assert (sel.redo_s(COST), sel.kept(COST), sel.redone(COST)) == (0.25, 40 + 7, 60)
    a = _units([1.0, 2.0], [1.0, 2.0], [10, 20], ([4, 8], [0.1, 0.2]))
    assert list(sel.unit_redo(a)) == [0.1, 0.2]
    assert list(sel.unit_bytes(a, 3)) == [3 * 4 + 6, 3 * 8 + 12]  # in flight: the kept; one microbatch: the redone
    assert sel.offered(a, 0.0) and not sel.offered(_units([1.0], [1.0], [1]), 1e9)
    assert sel.checkpoint and sel.saves_ops >= {"aten.mm", "aten._scaled_dot_product_flash_attention"}
    assert (sel.saving, by_saving(tuple(Activation))) == (1, (KEEP, SELECTIVE, SELECTIVE_UNITS, OFFLOAD, RECOMPUTE,
                                                              BLOCKS))
    # the trainers' selective recomputation is per block (`selective-units`): whole-stage is what none exports
    assert (sel.torchtitan, sel.megatron, sel.deepspeed_interval, sel.trainer_note) == ("none", (), None, "")
    assert "activation_checkpoint_interval" in str(sel.refusal("deepspeed"))
    assert "`selective-units`" in str(sel.refusal("torchtitan"))
    assert "recomputes whole submodules" in str(sel.refusal("megatron"))  # another policy, per unit or whole


def test_one_descriptor_per_policy_spelled_by_its_value() -> None:
    assert [a.value for a in Activation] == ["keep", "recompute", "selective", "offload", "recompute-units",
                                          "selective-units"]
    assert list(POLICIES) == list(Activation) and all(policy(a).name is a for a in Activation)
    assert Activation("recompute") is RECOMPUTE


def test_what_a_policy_adds_to_the_backward() -> None:
    assert policy(KEEP).redo_s(COST) == 0.0 and policy(RECOMPUTE).redo_s(COST) == 2.5
    a = _units([1.0, 2.0, 3.0], [0.5, 1.5, 2.5], [10, 20, 30])  # the split reads the units' recompute column
    assert list(policy(RECOMPUTE).unit_redo(a)) == [0.5, 1.5, 2.5] and list(policy(KEEP).unit_redo(a)) == [0.0] * 3


def test_what_a_microbatch_keeps_and_what_is_allocated_again() -> None:
    assert (policy(KEEP).kept(COST), policy(KEEP).redone(COST)) == (100, 0)
    assert (policy(RECOMPUTE).kept(COST), policy(RECOMPUTE).redone(COST)) == (7, 100)


def test_bytes_charged_in_the_splits_memory_check() -> None:
    a = _units([1.0, 1.0], [1.0, 1.0], [10, 20])
    assert [list(policy(KEEP).unit_bytes(a, n)) for n in (1, 3)] == [[10, 20], [30, 60]]
    assert [list(policy(RECOMPUTE).unit_bytes(a, n)) for n in (1, 3)] == [[10, 20], [10, 20]]


def test_behaviour_flags() -> None:
    keep, again = policy(KEEP), policy(RECOMPUTE)
    assert (keep.redoes_forward, keep.checkpoint, keep.saving) == (False, False, 0)
    assert (again.redoes_forward, again.checkpoint) == (True, True) and again.saving > keep.saving
    a = _units([1.0], [1.0], [1])
    assert keep.offered(a, 0.0) and again.offered(a, 0.0)
    assert by_saving((RECOMPUTE, KEEP, RECOMPUTE)) == (KEEP, RECOMPUTE)


def test_how_the_trainers_spell_each_policy() -> None:
    """The trainers' full recomputation checkpoints layer by layer: it is `recompute-units`, and whole-stage
    recomputation is what none of them exports."""
    keep, units, whole = policy(KEEP), policy(BLOCKS), policy(RECOMPUTE)
    assert (keep.torchtitan, keep.megatron, keep.deepspeed_interval, keep.trainer_note) == ("none", (), 0, "")
    assert (units.torchtitan, units.deepspeed_interval) == ("full", 1)
    assert units.megatron == ("--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1")
    assert units.trainer_note.startswith("the trainer's full recomputation covers the transformer blocks only")
    assert all(units.refusal(t) is None for t in ("torchtitan", "megatron", "deepspeed"))
    assert "wraps each transformer block" in str(whole.refusal("torchtitan"))
    assert "--recompute-num-layers 1" in str(whole.refusal("megatron"))
    assert "activation_checkpoint_interval 1" in str(whole.refusal("deepspeed"))


def _chain(forward: list[float], activation: list[int], cut: list[int]) -> UnitArrays:
    return replace(_units(forward, forward, activation), cut=np.array(cut, dtype=float))


def test_per_unit_recomputation_keeps_each_units_input_and_redoes_one_unit_at_a_time() -> None:
    """Per microbatch the inputs of every unit of the stage (the cuts before them), in its backward the largest unit's
    activations, and the whole forward again, as whole-stage recomputation."""
    p, a = policy(BLOCKS), _chain([1.0, 2.0, 3.0], [10, 40, 20], [0, 3, 5, 0])
    assert p.from_units is not None
    assert p.from_units(a, 1, 3) == Figures(3 + 5, 0.0, 40) and p.from_units(a, 0, 1) == Figures(0, 0.0, 10)
    c = replace(COST, own=((BLOCKS, p.from_units(a, 1, 3)),))
    assert (p.kept(c), p.redone(c), p.redo_s(c)) == (8, 40, 2.5)
    assert list(p.unit_redo(a)) == [1.0, 2.0, 3.0]
    assert [list(p.unit_bytes(a, n)) for n in (1, 3)] == [[0, 3, 5], [0, 9, 15]]  # the kept inputs; the rest: walks
    assert (p.checkpoint, p.per_unit, p.redoes_forward, p.to_host) == (True, True, True, False)
    assert p.offered(a, 0.0) and policy(RECOMPUTE).saving < p.saving and not policy(RECOMPUTE).per_unit


def test_per_unit_checkpoints_keep_each_value_once_and_the_split_charges_a_lower_bound() -> None:
    """With the values each unit makes for later ones (`UnitArrays.born`: a 2-byte value unit 0 makes for units 1
    and 2 beside 3-byte hidden states, so cut = 0, 5, 5, 0), a stage keeps the values entering it and those its units
    make for its later units, each once: units 1-2 keep 5 + 3 (not 5 + 5). The split's additive charge per unit
    (what the unit before made for later units) sums to at most that; the order walks charge the exact figure."""
    a = replace(_chain([1.0, 2.0, 3.0], [10, 40, 20], [0, 5, 5, 0]), born=np.array([5.0, 3.0, 0.0]))
    units, selective = policy(BLOCKS), policy(SELECTIVE_UNITS)
    assert units.from_units is not None and selective.from_units is not None
    assert units.from_units(a, 1, 3) == Figures(5 + 3, 0.0, 40) and units.from_units(a, 0, 3) == Figures(8, 0.0, 40)
    assert [list(units.unit_bytes(a, n)) for n in (1, 2)] == [[0, 5, 3], [0, 10, 6]]
    a = replace(a, own={SELECTIVE: (np.array([4.0, 16.0, 8.0]), np.array([0.1, 0.2, 0.4]))})
    assert selective.from_units(a, 1, 3) == Figures(16 + 8 + 5 + 3, 0.2 + 0.4, 24)
    assert list(selective.unit_bytes(a, 1)) == [4, 21, 11]


def test_per_unit_selective_keeps_each_units_input_and_saved_ops_and_redoes_one_unit_at_a_time() -> None:
    """Per microbatch each unit's input (the cuts) and its saved ops' outputs; in the backward the largest of the
    units' other activations; the units' selective recompute redone. Against whole-stage selective: more kept per
    microbatch (the inputs), far less re-materialised at once."""
    p, a = policy(SELECTIVE_UNITS), _chain([1.0, 2.0, 3.0], [10, 40, 20], [0, 3, 5, 0])
    a = replace(a, own={SELECTIVE: (np.array([4.0, 16.0, 8.0]), np.array([0.1, 0.2, 0.4]))})
    assert p.from_units is not None
    assert p.from_units(a, 1, 3) == Figures(16 + 8 + 3 + 5, 0.2 + 0.4, max(40 - 16, 20 - 8))
    assert p.from_units(a, 0, 1) == Figures(4, 0.1, 6)
    c = replace(COST, own=((SELECTIVE_UNITS, p.from_units(a, 1, 3)),))
    assert (p.kept(c), p.redone(c), p.redo_s(c)) == (32, 24, 0.6000000000000001)
    assert list(p.unit_redo(a)) == [0.1, 0.2, 0.4]
    assert [list(p.unit_bytes(a, n)) for n in (1, 2)] == [[4, 19, 13], [8, 38, 26]]  # in flight; the redone: walks
    assert (p.checkpoint, p.per_unit, p.saves_ops, p.to_host) == (True, True, policy(SELECTIVE).saves_ops, False)
    assert p.offered(a, 0.0) and not p.offered(_chain([1.0], [1], [0, 0]), 1e9)  # the profile's columns, as selective
    assert policy(SELECTIVE).saving < p.saving < policy(OFFLOAD).saving
    assert (p.torchtitan, p.megatron) == ("selective", ())
    assert "every second matmul" in p.trainer_note and p.refusal("torchtitan") is None
    assert "recomputes whole submodules (megatron-core's recompute_modules, default core_attn" in str(
        p.refusal("megatron"))  # not autopp's selective policy: its memory would not hold
    assert p.deepspeed_interval is None and "activation_checkpoint_interval" in str(p.refusal("deepspeed"))


def test_parse_a_policy_at_the_boundary() -> None:
    assert parse_activation("keep") is KEEP and parse_activation("recompute", where="stage 1") is RECOMPUTE
    with pytest.raises(ScheduleError, match=r"^activation: activation policy 'RECOMPUTE' does not exist; give one of "
                                            r"\['keep', 'recompute', 'selective', 'offload', 'recompute-units', "
                                            r"'selective-units'\]$"):
        parse_activation("RECOMPUTE")
    with pytest.raises(ScheduleError, match=r"^plan\.json stage 2: activation policy True does not exist"):
        parse_activation(True, where="plan.json stage 2")  # the bool of plans before version 2 is not a policy


def test_order_key_puts_keeping_first() -> None:
    assert order_key((RECOMPUTE, KEEP, RECOMPUTE)) == (1, 0, 1) and order_key(()) == ()
    ties = [(RECOMPUTE, KEEP), (KEEP, RECOMPUTE), (KEEP, KEEP), (RECOMPUTE, RECOMPUTE)]
    assert sorted(ties, key=order_key) == [(KEEP, KEEP), (KEEP, RECOMPUTE), (RECOMPUTE, KEEP), (RECOMPUTE, RECOMPUTE)]


def test_chosen_gives_one_policy_per_stage() -> None:
    assert chosen(4, {0, 2}) == (RECOMPUTE, KEEP, RECOMPUTE, KEEP)
    assert chosen(3, ()) == (KEEP,) * 3 and chosen(2, frozenset({0, 1})) == (RECOMPUTE,) * 2
    assert chosen(2, (1, 5)) == (KEEP, RECOMPUTE)  # a stage the configuration lacks changes nothing
    assert chosen(0, {0}) == ()


def test_tally_names_each_policy_a_fallback_chose() -> None:
    """Stages that offload are not reported as keeping (the published 405B row once printed "0 of 64 stages
    recomputing" for a plan whose stages offloaded: a count of recomputing stages only)."""
    assert tally((OFFLOAD, KEEP, OFFLOAD, Activation.BLOCKS)) == "1 keep, 2 offload, 1 recompute-units"
    assert tally((RECOMPUTE,) * 3) == "3 recompute" and tally(()) == ""


def _offload_stages(host: float) -> list[StageCost]:
    """Three stages: 64 activation bytes each; forward 1 s, I 1 s, W 1 s (stage 0: no I, W 2 s)."""
    costs = [StageCost(forward_s=1.0, backward_input_s=0.0 if s == 0 else 1.0, backward_weight_s=2.0 if s == 0
                       else 1.0, activation_bytes=64, input_bytes=8) for s in range(3)]
    figures = policy(OFFLOAD).derive
    assert figures is not None
    return [replace(c, own=((OFFLOAD, figures(costs, s, host)),)) for s, c in enumerate(costs)]


def test_offload_hides_where_the_trip_fits_between_forward_and_backward() -> None:
    """PipeOffload's condition: the trip out and back (2 x bytes / host bandwidth) against the window the later
    stages' forward and input-gradient passes leave (stage 0: 4 s, stage 1: 2 s, the last: none)."""
    off = policy(OFFLOAD)
    first, middle, last = _offload_stages(host=32.0)  # 2 s each way
    assert [off.redo_s(c) for c in (first, middle, last)] == [0.0, 2.0, 4.0]
    assert off.redo_s(_offload_stages(host=16.0)[0]) == 4.0  # 4 s each way: 8 s trip, 4 s window
    # a long window (20 s) but 8 s each way against 2 s of the stage's own compute per microbatch: transfers queue
    short, long = (StageCost(forward_s=f, backward_input_s=i, backward_weight_s=w, activation_bytes=64)
                   for f, i, w in ((1.0, 0.0, 1.0), (10.0, 10.0, 1.0)))
    assert off.derive is not None and off.derive([short, long], 0, 8.0) == Figures(0, 6.0)  # max(16 - 20, 8 - 2)
    # memory: the input kept per microbatch; in its backward its activations and the next microbatch's (prefetched)
    assert (off.kept(first), off.redone(first)) == (8, 128)
    assert list(off.unit_bytes(_units([1.0, 1.0], [1.0, 1.0], [10, 20]), 3)) == [20, 40]
    assert list(off.unit_redo(_units([1.0], [1.0], [10]))) == [0.0]  # a lower bound: the stages decide


def test_offload_needs_a_host_link_and_runs_without_a_checkpoint() -> None:
    off, a = policy(OFFLOAD), _units([1.0], [1.0], [1])
    assert off.offered(a, 64e9) and not off.offered(a, 0.0) and "host link" in off.unoffered
    assert (off.to_host, off.checkpoint, off.redoes_forward) == (True, False, False)
    assert policy(SELECTIVE).saving < off.saving < policy(RECOMPUTE).saving


def test_no_trainer_applies_offload_and_each_says_why() -> None:
    off = policy(OFFLOAD)
    assert "no activation offload" in str(off.refusal("torchtitan"))
    assert "Pipeline parallelism with CPU offloading" in str(off.refusal("megatron"))
    assert "cpu_checkpointing" in str(off.refusal("deepspeed"))
