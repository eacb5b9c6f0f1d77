"""Activation policies as descriptors (autopp.schedule.activation): what each keeps, redoes and holds, how the trainers
spell it, and the per-stage helpers."""

from __future__ import annotations

import numpy as np
import pytest

from autopp.errors import ScheduleError
from autopp.schedule import POLICIES, Activation, chosen, order_key, parse_activation, policy

KEEP, RECOMPUTE = Activation.KEEP, Activation.RECOMPUTE


def test_one_descriptor_per_policy_spelled_by_its_value() -> None:
    assert [a.value for a in Activation] == ["keep", "recompute"]
    assert list(POLICIES) == list(Activation) and all(policy(a).name is a for a in Activation)
    assert Activation("recompute") is RECOMPUTE


def test_what_a_policy_adds_to_the_backward() -> None:
    assert policy(KEEP).redo_s(2.5) == 0.0 and policy(RECOMPUTE).redo_s(2.5) == 2.5
    forward = np.array([1.0, 2.0, 3.0])  # the bounds pass a whole array of units' forward times
    assert policy(RECOMPUTE).redo_s(forward) is forward and policy(KEEP).redo_s(forward) == 0.0


def test_what_a_microbatch_keeps_and_what_is_allocated_again() -> None:
    assert (policy(KEEP).kept(100, 7), policy(KEEP).redone(100)) == (100, 0)
    assert (policy(RECOMPUTE).kept(100, 7), policy(RECOMPUTE).redone(100)) == (7, 100)


def test_microbatches_charged_in_the_splits_memory_check() -> None:
    assert [policy(KEEP).held(n) for n in (1, 3, 8)] == [1, 3, 8]
    assert [policy(RECOMPUTE).held(n) for n in (1, 3, 8)] == [1, 1, 1]


def test_behaviour_flags() -> None:
    keep, again = policy(KEEP), policy(RECOMPUTE)
    assert (keep.redoes_forward, keep.keeps_input_only, keep.checkpoint) == (False, False, False)
    assert (again.redoes_forward, again.keeps_input_only, again.checkpoint) == (True, True, True)


def test_how_the_trainers_spell_each_policy() -> None:
    keep, again = policy(KEEP), policy(RECOMPUTE)
    assert (keep.torchtitan, keep.megatron, keep.deepspeed_interval, keep.trainer_note) == ("none", (), 0, "")
    assert (again.torchtitan, again.deepspeed_interval) == ("full", 1)
    assert again.megatron == ("--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1")
    assert again.trainer_note.startswith("the trainer's full recomputation covers the transformer blocks only")


def test_parse_a_policy_at_the_boundary() -> None:
    assert parse_activation("keep") is KEEP and parse_activation("recompute", where="stage 1") is RECOMPUTE
    with pytest.raises(ScheduleError, match=r"^activation: activation policy 'RECOMPUTE' does not exist; give one of "
                                            r"\['keep', 'recompute'\]$"):
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
