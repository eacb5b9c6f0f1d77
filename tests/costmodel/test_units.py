"""A profile as per-unit arrays: interpolation between and beyond profiled sizes, cut bytes, the inputs per-unit
checkpoints keep, optimizer shares, work, the master copy."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from autopp.costmodel import unit_arrays
from autopp.data.profile import EDGE_COLUMNS, UNIT_COLUMNS, Profile, ProfileMeta, TiedGroup, ValueAction
from autopp.data.profile_values import LiveValue
from autopp.schedule import Activation

#: (unit, size) -> F, B, I, W, recompute, activation bytes. Unit 0 has no I (torch's first stage); unit 1 was
#: profiled without a recompute time (0: the forward again is assumed).
ROWS = {(0, 1): (1.0, 2.0, 0.0, 2.0, 1.0, 100), (0, 3): (2.0, 6.0, 0.0, 6.0, 2.0, 300),
        (1, 1): (3.0, 4.0, 2.5, 2.0, 0.0, 50), (1, 3): (5.0, 8.0, 5.0, 4.0, 0.0, 150)}
PARAMS = (10, 30)


def tiny_profile(rows: dict[tuple[int, int], tuple[float, float, float, float, float, int]] = ROWS,
                 optimizer_step_s: float = 0.8, tied: tuple[TiedGroup, ...] = ()) -> Profile:
    """Two units profiled at microbatch sizes 1 and 3; 40 (size 1) or 120 (size 3) bytes cross the cut."""
    sizes = sorted({b for _, b in rows})
    units = []
    for (u, b), (f, back, i, w, redo, act) in sorted(rows.items()):
        row: dict[str, object] = {c: 0 for c in UNIT_COLUMNS}
        row.update(unit=u, name=f"u{u}", modules=f"u{u}", microbatch_size=b, forward_s=f, backward_s=back,
                   backward_input_s=i, backward_weight_s=w, recompute_s=redo, activation_bytes=act,
                   param_bytes=PARAMS[u], grad_bytes=PARAMS[u], optimizer_bytes=2 * PARAMS[u])
        units.append(row)
    edges = [{"src": 0, "dst": 1, "microbatch_size": b, "bytes": 40 * b} for b in sizes]
    meta = ProfileMeta(model_path="tiny.py", fingerprint="tiny", unit_names=("u0", "u1"), split_points=("u1",),
                       microbatch_sizes=tuple(sizes), device="cpu", torch_version="none", num_threads=1,
                       optimizer="adam", repeats=1, warmup=0, optimizer_step_s=optimizer_step_s,
                       tied_parameters=tied)
    return Profile(meta, pd.DataFrame(units, columns=list(UNIT_COLUMNS)), pd.DataFrame(edges, columns=list(EDGE_COLUMNS)))


def test_profiled_size_is_read_as_is() -> None:
    a = unit_arrays(tiny_profile(), 1)
    assert list(a.forward) == [1.0, 3.0] and list(a.backward) == [2.0, 4.0]
    assert list(a.backward_input) == [0.0, 2.5] and list(a.backward_weight) == [2.0, 2.0]
    assert list(a.static) == [40.0, 120.0] and list(a.params) == [10.0, 30.0] and list(a.grads) == [10.0, 30.0]
    assert list(a.cut) == [0.0, 40.0, 0.0] and not a.split_assumed


def test_between_sizes_is_linear_and_a_missing_recompute_time_is_the_forward() -> None:
    a = unit_arrays(tiny_profile(), 2)
    assert list(a.forward) == [1.5, 4.0] and list(a.backward) == [4.0, 6.0]
    assert list(a.backward_input) == [0.0, 3.75] and list(a.backward_weight) == [4.0, 3.0]
    assert list(a.activation) == [200.0, 100.0] and list(a.cut) == [0.0, 80.0, 0.0]
    assert list(a.recompute) == [1.5, 4.0]


def test_beyond_sizes_extends_the_end_segment_and_one_size_scales_proportionally() -> None:
    assert list(unit_arrays(tiny_profile(), 5).forward) == [3.0, 7.0]  # 1 + (2 - 1) x (5 - 1) / 2; 3 + 2 x 2
    one = tiny_profile({k: v for k, v in ROWS.items() if k[1] == 3})
    assert list(unit_arrays(one, 6).forward) == [4.0, 10.0] and list(unit_arrays(one, 6).cut) == [0.0, 240.0, 0.0]


def test_no_input_weight_split_assumes_halves() -> None:
    rows = {k: (f, b, 0.0, 0.0, r, act) for k, (f, b, _, _, r, act) in ROWS.items()}
    a = unit_arrays(tiny_profile(rows), 1)
    assert a.split_assumed and list(a.backward_input) == [1.0, 2.0] and list(a.backward_weight) == [1.0, 2.0]


def test_optimizer_step_shared_by_trainable_bytes_counting_tied_copies_once() -> None:
    assert list(unit_arrays(tiny_profile(), 1).optimizer) == pytest.approx([0.2, 0.6])  # 0.8 x 10/40, 0.8 x 30/40
    # An 8-byte weight tied between the units was stepped once in the timed model: 0.8 / 32 per trainable byte.
    tied = tiny_profile(tied=(TiedGroup(names=("u0.w", "u1.w"), units=(0, 1), bytes=8),))
    assert list(unit_arrays(tied, 1).optimizer) == pytest.approx([0.25, 0.75])


def test_the_profiles_runtime_cost_per_action_reaches_the_arrays_unscaled_by_the_microbatch() -> None:
    plain = tiny_profile()
    assert (unit_arrays(plain, 2).runtime_forward_s, unit_arrays(plain, 2).runtime_backward_s) == (0.0, 0.0)
    costly = Profile(replace(plain.meta, runtime_forward_s=0.1, runtime_backward_s=0.2, resume_s=0.3), plain.units,
                     plain.edges)
    for b in (1, 2, 5):
        a = unit_arrays(costly, b)
        assert (a.runtime_forward_s, a.runtime_backward_s, a.resume_s) == (0.1, 0.2, 0.3)
        assert list(a.forward) == list(unit_arrays(plain, b).forward)  # the units' own times stay as profiled


def test_work_is_forward_plus_the_cheaper_backward_plus_recompute() -> None:
    a = unit_arrays(tiny_profile(), 2)
    assert list(a.work()) == [5.5, 10.0]  # 1.5 + min(4, 0 + 4); 4 + min(6, 3.75 + 3)
    assert list(a.work(Activation.RECOMPUTE)) == [7.0, 14.0]
    assert list(a.prefix(a.work())) == [0.0, 5.5, 15.5]



def test_transient_is_the_peak_beyond_activation_output_and_gradients_interpolated() -> None:
    plain = tiny_profile()
    assert unit_arrays(plain, 1).transient is None and list(unit_arrays(plain, 1).transient_bytes()) == [0.0, 0.0]
    # unit 0: 100 activation + 10 gradient bytes held at size 1 (300 + 10 at 3); unit 1's peak is below what the
    # model already charges it (50 + 30), and it has no peak at size 3
    peaks = {"0": {"1": 610, "3": 1410}, "1": {"1": 20}}
    for key in ("peak_bytes", "cuda_peak_bytes"):  # the old CUDA-only key is read too
        plain.meta.extra.clear()
        plain.meta.extra[key] = peaks
        assert list(unit_arrays(plain, 1).transient_bytes()) == [500.0, 0.0]
        assert list(unit_arrays(plain, 3).transient_bytes()) == [1100.0, 0.0]
        assert list(unit_arrays(plain, 2).transient_bytes()) == [800.0, 0.0]


def test_a_peak_holds_the_gradients_in_the_parameters_dtype() -> None:
    """The bf16 and fp8 recipes keep fp32 gradients (`grad_bytes`, twice `param_bytes`: charged by the memory
    model), and the peak was counted with autograd's gradients in bf16, the parameters' bytes: the working memory is
    the peak less those. Gradients kept as made (fp32, pure bf16, profiles before the recipes) count as they are."""
    plain = tiny_profile()
    plain.meta.extra.update(peak_bytes={"0": {"1": 610}})
    assert list(unit_arrays(plain, 1).transient_bytes()) == [500.0, 0.0]  # 610 - 100 - 10
    kept_fp32 = replace(plain, units=plain.units.assign(grad_bytes=2 * plain.units.grad_bytes))
    assert list(unit_arrays(kept_fp32, 1).transient_bytes()) == [500.0, 0.0]  # 610 - 100 - min(10, 20)


def _valued(values: list[tuple[int, tuple[int, ...], int, ValueAction]], units: int = 4) -> Profile:
    """`units` units profiled at sizes 1 and 3, with live values (src, dsts, bytes at size 1, action), 3 x those
    bytes at size 3."""
    base = tiny_profile()
    rows = pd.concat([base.units[base.units.unit == 0].assign(unit=u, name=f"u{u}") for u in range(units)])
    live = tuple(LiveValue(name=f"v{k}", src=s, dsts=d, action=act, bytes={1: n, 3: 3 * n})
                 for k, (s, d, n, act) in enumerate(values))
    names = tuple(f"u{u}" for u in range(units))
    meta = replace(base.meta, unit_names=names, split_points=names[1:], live_values=live)
    return Profile(meta, rows.reset_index(drop=True), base.edges)


SEND, RELAY, RECOMPUTE = ValueAction.SEND, ValueAction.RELAY, ValueAction.RECOMPUTE


def test_per_unit_checkpoints_keep_a_value_read_by_several_units_once() -> None:
    """A chain of 10-byte hidden states and a 5-byte value unit 0 makes for units 1-3 (crossing three cuts): torch's
    checkpoint keeps a reference to each unit's inputs, so the 5 bytes are one tensor held once per microbatch, not
    once per cut (15 + 10 + 10 = 35 bytes for units 1-3, where the cuts sum to 45). A value every stage recomputes
    crosses no cut."""
    p = _valued([(0, (1,), 10, SEND), (0, (1, 2, 3), 5, RELAY), (1, (2,), 10, SEND), (2, (3,), 10, SEND),
                 (0, (1, 2, 3), 7, RECOMPUTE)])
    a = unit_arrays(p, 1)
    assert list(a.cut) == [0.0, 15.0, 15.0, 15.0, 0.0] and a.born is not None and list(a.born) == [15, 10, 10, 0]
    assert a.checkpoint_inputs(1, 4) == 15 + 10 + 10 and a.checkpoint_inputs(0, 4) == 35
    assert a.checkpoint_inputs(2, 4) == 15 + 10 and a.checkpoint_inputs(3, 4) == 15 and a.checkpoint_inputs(2, 2) == 0
    assert list(a.checkpoint_charge()) == [0, 15, 10, 10]  # summed over a stage: at most checkpoint_inputs
    assert unit_arrays(p, 3).checkpoint_inputs(1, 4) == 3 * 35
    # without live values (the edges alone) every value counts at each cut it crosses, as before
    old = unit_arrays(tiny_profile(), 1)
    assert old.born is None and old.checkpoint_inputs(0, 2) == 40 and list(old.checkpoint_charge()) == [0, 40]


def test_a_recipe_with_a_master_copy_is_marked() -> None:
    """The bf16 and fp8 recipes count an fp32 master copy in the optimizer bytes (autopp.data.precision), which ZeRO's
    sharding reads (autopp.costmodel.parallel); fp32 and pure bf16 have none (the weights are the master). A profile
    that records no recipe has its dtype's (autopp.data.precision.plan_recipe)."""
    p = tiny_profile()
    assert not unit_arrays(p, 1).master
    # bfloat16 without a recorded recipe is bf16 (measured profiles record only recipes their dtype does not imply;
    # profiles made before the recipes counted an fp32 master copy below float32 too)
    assert unit_arrays(replace(p, meta=replace(p.meta, dtype="bfloat16")), 1).master
    for name, master in (("fp8", True), ("bf16", True), ("fp32", False), ("bf16-pure", False)):
        assert unit_arrays(replace(p, meta=replace(p.meta, extra={"precision": name})), 1).master is master


def test_a_tp_rank_takes_its_own_working_memory_where_the_profile_counted_it() -> None:
    """At tp 2 the working memory is the rank's own peak (`extra.tp_peak_bytes`, counted on its shard) beyond its
    rows' activation and gradient bytes; without those peaks the whole model's (an upper bound): a head's gathered
    logits are not what a rank holds under loss parallelism. The last unit's output (the model's) is not held at its
    measured peak (the piece hands it to the loss), so it is not taken off."""
    from autopp.data.synthetic_profile import synthetic_profile
    from autopp.costmodel.units import ProfileTable

    profile = synthetic_profile(3, tp_degrees=(2,))
    assert profile.tp_units is not None
    rows = profile.units[profile.units.microbatch_size == profile.meta.microbatch_sizes[0]]
    tp_rows = profile.tp_units[profile.tp_units.microbatch_size == profile.meta.microbatch_sizes[0]]
    b = str(profile.meta.microbatch_sizes[0])
    held = [int(r.activation_bytes + r.output_bytes * (r.unit < 2) + r.grad_bytes) for r in rows.itertuples()]
    tp_held = [int(t.activation_bytes + r.output_bytes * (r.unit < 2) + t.grad_bytes)
               for t, r in zip(tp_rows.itertuples(), rows.itertuples())]
    profile.meta.extra["peak_bytes"] = {str(u): {b: held[u] + 1000} for u in range(3)}
    whole = ProfileTable(profile, tp=2).transient
    assert whole is not None and list(whole[:, 0]) == [1000.0] * 3  # the whole model's peak beyond its own bytes
    profile.meta.extra["tp_peak_bytes"] = {"2": {str(u): {b: tp_held[u] + 100} for u in range(3)}}
    own = ProfileTable(profile, tp=2).transient
    assert own is not None and list(own[:, 0]) == [100.0, 100.0, 100.0]
    assert list(ProfileTable(profile, tp=1).transient[:, 0]) == [1000.0] * 3  # type: ignore[index]


def test_the_last_stage_holds_the_models_output_a_tp_rank_its_shard_under_loss_parallelism() -> None:
    """The model's output (the last unit's `output_bytes`, an LM's logits) is what a stage ending at the last unit
    holds per in-flight microbatch (`held_outputs`: the cuts elsewhere), interpolated between profiled sizes; a TP
    rank holds all of it when the head gathers its logits and 1/tp of it under loss parallelism; the body of a
    vocabulary-parallel plan hands the output pass its hidden states instead."""
    import numpy as np

    from autopp.costmodel import stage_costs
    from autopp.costmodel.units import ProfileTable
    from autopp.costmodel.vocab import body_arrays
    from autopp.data.synthetic_profile import synthetic_profile
    from autopp.data.tp_plan import LOSS_PARALLEL

    profile = synthetic_profile(4, tp_degrees=(2,))
    head = profile.units[profile.units.unit == 3].set_index("microbatch_size").output_bytes
    a = unit_arrays(profile, 4)  # between the profiled sizes 1 and 8
    assert a.model_output == pytest.approx(head[1] + (head[8] - head[1]) * 3 / 7) and a.model_output > 0
    assert list(a.held_outputs()) == [*a.cut[:-1], a.model_output] and a.cut[-1] == 0
    assert [c.output_bytes for c in stage_costs(a, [(0, 2), (2, 4)], [1.0, 1.0])] == [a.cut[2], a.model_output]
    assert ProfileTable(profile, tp=2).arrays(4).model_output == a.model_output  # gathered logits, whole
    sharded = replace(profile, meta=replace(profile.meta, tp_plan={**profile.meta.tp_plan, "head": LOSS_PARALLEL}))
    assert ProfileTable(sharded, tp=2).arrays(4).model_output == a.model_output / 2
    assert body_arrays(a).model_output == a.cut[3] and np.array_equal(body_arrays(a).cut, a.cut)
