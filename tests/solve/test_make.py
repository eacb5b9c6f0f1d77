"""autopp.solve.assemble.make: the notes `make_plan` adds to the plan it assembles."""

from __future__ import annotations

from autopp.cli.common import in_flags
from autopp.data.cluster import Cluster
from autopp.data.layout import LayoutPins
from autopp.data.synthetic_profile import synthetic_profile
from autopp.solve import PlanRequest, make_plan


def test_the_tp_note_is_a_whole_sentence_whatever_the_flags_said() -> None:
    """The tester saw "note: with --tp auto, only tp 1 was: the profile has no tensor-parallel rows" without giving
    --tp (auto is its default): the note says what was searched, in a finished sentence, with no flag it did not
    give."""
    profile = synthetic_profile(6)
    plan = make_plan(profile, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**40), global_batch=4,
                                          pins=LayoutPins(tp=None)))
    note = next(in_flags(n) for n in plan.notes if "tensor-parallel rows" in n)
    assert note.startswith("tensor parallelism: only tp 1 was searched, as the profile has no tensor-parallel rows")
    assert "--tp auto" not in note and note.endswith("profile with --tp T, T a degree the model's TP plan allows")
    pinned = make_plan(profile, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**40), global_batch=4))
    assert not any("tensor-parallel rows" in n for n in pinned.notes)
