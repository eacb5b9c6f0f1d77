"""Stages of non-chain models in one process: relayed and locally held values, the model's output structure for the
loss, tied parameters, activation checkpointing (all stages on one rank of a one-rank gloo group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from autopp.model.contract import load_model_file
from autopp.model.split import split_model
from autopp.run.chain import chain_io
from autopp.run.outputs import rebuild_last_output
from autopp.run.pipeline import build_stages, make_schedule
from autopp.run.tied import aliases, shared_params
from autopp.data.layout import Layout
from autopp.data.plan import Plan
from autopp.schedule import Activation, ScheduleName, build_schedule, chosen, parse_action

from .conftest import GPT, ROOT, pipeline_plan, two_stage_plan

MASKED = ROOT / "tests" / "models" / "masked.py"
MASKED_CUTS = ["blocks.1", "blocks.2", "head"]
KEEP, RECOMPUTE, SELECTIVE, OFFLOAD = Activation.KEEP, Activation.RECOMPUTE, Activation.SELECTIVE, Activation.OFFLOAD
BLOCKS, SELECTIVE_UNITS = Activation.BLOCKS, Activation.SELECTIVE_UNITS


def test_a_residual_is_relayed_and_a_mask_held_by_its_readers() -> None:
    mf = load_model_file(MASKED)
    pipe = split_model(mf.build(0), mf.sample_batch(2, seed=0)[0], MASKED_CUTS)
    io, sources = chain_io(pipe)
    assert len(io) == 4 and io[0].inputs == ("x",) and io[3].outputs == ()
    # The embedding h0 is made by stage 0 and read by stage 2 (before the head): stage 1 receives and passes it on.
    residual = [n for n in io[1].outputs if sources[n].piece == 0]
    assert len(residual) == 1 and residual[0] in io[1].inputs and residual[0] in io[2].inputs
    assert residual[0] not in io[2].outputs
    # The causal mask depends on constants only: stages 1 and 2 hold it, nobody sends it.
    assert io[1].constants and io[1].constants == io[2].constants
    assert all(c not in s.outputs for s in io for c in io[1].constants)
    for s in range(3):
        assert io[s + 1].inputs == io[s].outputs


def test_a_value_computed_between_stages_is_refused() -> None:
    import operator

    from torch import fx

    from autopp.errors import RunError
    from autopp.run.chain import Source, value_path

    graph = fx.Graph()
    x = graph.placeholder("x")
    piece = graph.call_module("submod_0", (x,))
    item = graph.call_function(operator.getitem, (piece, 1))
    added = graph.call_function(torch.add, (item, 1))
    assert value_path(item, {"submod_0": 0}, [x]) == Source(0, (1,))
    assert value_path(x, {"submod_0": 0}, [x]) == Source(-1, (0,))
    with pytest.raises(RunError, match=r"value 'add' of the split graph is computed between stages"):
        value_path(added, {"submod_0": 0}, [x])


@pytest.mark.parametrize("policies", [None, chosen(4, {1, 3}), (SELECTIVE, KEEP, SELECTIVE, RECOMPUTE),
                                      (OFFLOAD, RECOMPUTE, OFFLOAD, KEEP), (BLOCKS, RECOMPUTE, BLOCKS, BLOCKS),
                                      (SELECTIVE_UNITS, SELECTIVE, SELECTIVE_UNITS, KEEP)])
def test_relayed_stages_match_one_process(one_rank_group: None, tmp_path: Path,
                                          policies: tuple[Activation, ...] | None) -> None:
    order = build_schedule(ScheduleName.LOOPED_BFS, 1, 2, 4)  # one rank holding four stages, 2 microbatches
    plan = pipeline_plan(MASKED, MASKED_CUTS, "Custom", Layout(pp=1), num_microbatches=2, microbatch_size=2,
                         ranks=[0, 0, 0, 0], custom_order=(tuple(order[0]),))
    if policies is not None:
        from dataclasses import replace
        plan = replace(plan, stages=tuple(replace(s, activation=a) for s, a in zip(plan.stages, policies)))
    mf = load_model_file(MASKED)
    built = build_stages(mf, plan, 0, torch.device("cpu"), None)
    schedule = make_schedule(plan, built.stages, built.loss_fn, tmp_path / "order.csv")
    inputs, target = mf.sample_batch(4, seed=1)
    losses: list[torch.Tensor] = []
    schedule.step(*inputs, target=target, losses=losses)
    reference = mf.build(0)
    loss = mf.loss_fn(reference(*inputs), target)
    loss.backward()
    assert sum(float(x.detach()) for x in losses) / 2 == pytest.approx(float(loss.detach()), rel=1e-5)
    expected = dict(reference.named_parameters())
    for name, copies in built.params.items():
        assert len(copies) == 1
        torch.testing.assert_close(copies[0].grad, expected[name].grad, rtol=1e-5, atol=1e-7)
    assert set(built.params) == set(expected) and built.shared == {}
    assert set(built.relayed) == {1}


def test_tied_parameters_have_one_canonical_name_and_are_shared_across_ranks() -> None:
    head = nn.Linear(4, 4, bias=False)
    model = nn.Sequential(nn.Linear(4, 4), head)
    model.add_module("again", head)
    assert aliases(model) == {"0.weight": "0.weight", "0.bias": "0.bias", "1.weight": "1.weight",
                              "again.weight": "1.weight"}
    names = {0: ["0.weight", "1.weight"], 1: ["1.weight"], 2: ["1.weight"]}
    assert shared_params(names, [0, 1, 0]) == {"1.weight": (0, 1)}
    assert shared_params(names, [0, 0, 0]) == {}


def test_the_loss_sees_the_models_output_structure() -> None:
    from torch.utils import _pytree as pytree

    from autopp.run.chain import Source

    spec = pytree.tree_flatten({"logits": torch.zeros(1), "encoder": torch.zeros(1)})[1]
    out = rebuild_last_output(spec, [Source(3, (1,)), None], (torch.ones(1), torch.full((1,), 2.0)))
    assert out["encoder"] is None and float(out["logits"]) == 2.0


def test_an_output_made_from_weights_only_is_found() -> None:
    from autopp.run.chain import weight_only_outputs

    x = torch.randn(3, requires_grad=True)
    w = nn.Parameter(torch.randn(3))
    assert weight_only_outputs((x,), (x * w, w * 2, torch.ones(1), x.detach())) == [1]


def test_split_backward_schedules_are_told_apart() -> None:
    assert pipeline_plan(MASKED, MASKED_CUTS, "ZBVZeroBubble", Layout(pp=2, v=2)).splits_backward
    assert not pipeline_plan(MASKED, MASKED_CUTS, "Interleaved1F1B", Layout(pp=2, v=2)).splits_backward
    def custom(*rows: str) -> Plan:
        order = tuple(tuple(parse_action(t) for t in row.split()) for row in rows)
        return pipeline_plan(MASKED, ["blocks.1"], "Custom", ranks=[0, 1], custom_order=order)

    full, split = custom("0F0 0B0", "1F0 1B0"), custom("0F0 0I0 0W0", "1F0 1I0 1W0")
    assert not full.splits_backward and split.splits_backward


@pytest.mark.integration
def test_the_planners_weight_only_rule_agrees_with_the_runners_check_on_t5() -> None:
    # The planner finds, from the profile's live values (needs_grad, reads), the stages that would send on a value
    # made from their parameters alone; the runner finds them on real tensors (`weight_only_outputs`). T5: the
    # relative-position biases and the decoder's token embedding.
    pytest.importorskip("transformers")
    from autopp.model.units import discover_units
    from autopp.run.chain import ChainPiece, constant_values, example_io
    from autopp.solve.search.runnable import weight_only_sends
    from autopp.model.split import live_values

    mf = load_model_file(ROOT / "examples" / "hf_t5.py")
    model = mf.build(0)
    units = discover_units(mf, model)
    example, _ = mf.sample_batch(2, seed=0)
    by_unit = split_model(model, example, [str(u.split_point) for u in units[1:]])
    values = live_values(by_unit)
    for cuts, expected in (((3, 4, 5), [1, 2]), ((2, 3, 5), [2])):
        pipe = split_model(model, example, [str(units[c].split_point) for c in cuts])
        io, sources = chain_io(pipe)
        consts = constant_values(pipe, sorted({c for s in io for c in s.constants}), example)
        pieces = [ChainPiece(pipe.get_stage_module(i), i, io[i], sources, {c: consts[c] for c in io[i].constants},
                             last=i == len(io) - 1) for i in range(len(io))]
        example_io(pieces, example)
        bounds = tuple(zip((0,) + cuts, cuts + (len(units),)))
        assert [p.index for p in pieces if p.weight_only and not p.last] == expected
        assert sorted({s for s, _ in weight_only_sends(values, bounds)}) == expected


def test_selective_checkpoint_keeps_the_saved_ops_outputs_and_recomputes_the_rest() -> None:
    """Under `selective_context(SAVED_OPS)` the backward does not rerun the matmul (its output, which the sine's
    backward reads, is kept); under full checkpointing it reruns it."""
    from collections import Counter
    from typing import Any

    from torch.utils.checkpoint import checkpoint

    from autopp.run.chain import selective_context
    from autopp.schedule.activation import SAVED_OPS

    from ..opcount import OpCount as Count

    def backward_ops(**kw: Any) -> Counter[str]:
        x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
        out = checkpoint(lambda a, b: torch.mm(a, b).sin(), x, w, use_reentrant=False, **kw)
        with Count() as count:
            out.sum().backward()
        return count.ops

    full, selective = backward_ops(), backward_ops(context_fn=selective_context(SAVED_OPS))
    assert full["aten.mm"] == 3 and selective["aten.mm"] == 2  # the two gradient matmuls, + the rerun under full
    assert full["aten.cos"] == selective["aten.cos"] == 1  # the sine's backward, on the kept or rerun output


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_per_unit_recomputation_checkpoints_each_unit_of_the_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `recompute-units` stage runs one checkpoint per unit (stage 0 of the masked model: its embedding, then its
    first block, which also reads the mask made between them), a `recompute` stage one for the whole stage; a
    `selective-units` stage one per unit under the selective policy, whose backward reruns the block's softmax but
    none of its matmuls (as keeping), where per-unit recomputation reruns them; all give the stage's own outputs and
    input gradients."""
    from typing import Any

    from autopp.run import chain
    from autopp.schedule.activation import SAVED_OPS

    from ..opcount import OpCount

    plan = pipeline_plan(MASKED, ["blocks.1"], "GPipe", Layout(pp=2))
    mf = load_model_file(MASKED)
    example = mf.sample_batch(2, seed=0)[0]
    calls: list[bool] = []
    real = chain.checkpoint

    def counted(fn: Any, *args: Any, **kw: Any) -> Any:
        calls.append("context_fn" in kw)
        return real(fn, *args, **kw)

    monkeypatch.setattr(chain, "checkpoint", counted)
    results, backward = {}, {}
    policies = (KEEP, RECOMPUTE, BLOCKS, SELECTIVE_UNITS)
    for a in policies:
        pipe = split_model(mf.build(0), example, ["blocks.1"])
        io, sources = chain_io(pipe)
        piece = chain.ChainPiece(pipe.get_stage_module(0), 0, io[0], sources, {}, last=False, activation=a,
                                 units=plan.stages[0].unit_names)
        calls.clear()
        x = example[0].clone().requires_grad_()
        out = piece(x)
        with OpCount() as count:
            sum(o.sum() for o in out if isinstance(o, torch.Tensor) and o.requires_grad).backward()
        results[a], backward[a] = (out, x.grad, list(calls)), count.ops
    assert plan.stages[0].unit_names == ("emb", "blocks.0")
    assert [results[a][2] for a in policies] == [[], [False], [False, False], [True, True]]
    matmuls = {a: sum(n for op, n in backward[a].items() if op in SAVED_OPS) for a in policies}
    softmax = {a: backward[a]["aten._softmax"] for a in policies}
    assert matmuls[SELECTIVE_UNITS] == matmuls[KEEP] < matmuls[BLOCKS]
    assert softmax[KEEP] == 0 < softmax[SELECTIVE_UNITS] == softmax[BLOCKS]
    for a in policies[1:]:
        for got, want in zip(results[a][0], results[KEEP][0]):
            torch.testing.assert_close(got, want)
        torch.testing.assert_close(results[a][1], results[KEEP][1])


def test_an_offloaded_stage_saves_its_activations_in_host_memory(one_rank_group: None, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An offloaded stage's forward runs under torch's `save_on_cpu` (pinned buffers only on CUDA: here not), and
    only that stage's: what it saves goes through the hook's pack and comes back through its unpack."""
    from autopp.run import chain

    calls: list[bool] = []
    real = torch.autograd.graph.save_on_cpu

    def counted(pin_memory: bool = False, device_type: str = "cuda") -> torch.autograd.graph.save_on_cpu:
        calls.append(pin_memory)
        return real(pin_memory=pin_memory, device_type=device_type)

    monkeypatch.setattr(chain.torch.autograd.graph, "save_on_cpu", counted)
    order = build_schedule(ScheduleName.LOOPED_BFS, 1, 2, 4)  # one rank holding four stages, 2 microbatches
    plan = pipeline_plan(MASKED, MASKED_CUTS, "Custom", Layout(pp=1), num_microbatches=2, microbatch_size=2,
                         ranks=[0, 0, 0, 0], custom_order=(tuple(order[0]),))
    from dataclasses import replace
    plan = replace(plan, stages=tuple(replace(s, activation=OFFLOAD if s.index == 2 else KEEP) for s in plan.stages))
    mf = load_model_file(MASKED)
    built = build_stages(mf, plan, 0, torch.device("cpu"), None)
    schedule = make_schedule(plan, built.stages, built.loss_fn, tmp_path / "order.csv")
    inputs, target = mf.sample_batch(4, seed=1)
    schedule.step(*inputs, target=target, losses=[])
    # stage 2's forward of each microbatch (and of the runtime's shape check), on CPU: no pinned memory
    assert len(calls) >= 2 and not any(calls)


@pytest.mark.integration
@pytest.mark.parametrize("pp, policies", [(2, (OFFLOAD, BLOCKS)), (2, (SELECTIVE_UNITS, OFFLOAD)),
                                          (4, (BLOCKS, SELECTIVE, RECOMPUTE, SELECTIVE_UNITS))])
def test_offloaded_stages_on_cpu_ranks_match_one_process(pp: int, policies: tuple[Activation, ...]) -> None:
    """Issue 27: offload runs on gloo CPU ranks and its gradients and losses match one process (the mechanism: on
    CPU the host link is a memory copy and saves nothing; the planner does not choose it there); so do per-unit
    recomputation (`recompute-units`: each unit of a stage under its own checkpoint) and per-unit selective
    recomputation (`selective-units`: each unit under its own checkpoint with the selective policy). Three runs
    hold them, each policy on a first and a last stage, beside stage-level selective and full recomputation."""
    from dataclasses import replace

    from autopp.run import GRAD_RTOL, RunOptions, run_plan

    plan = two_stage_plan(GPT, "h.2") if pp == 2 else pipeline_plan(GPT, ["h.1", "h.2", "h.3"], "1F1B",
                                                                    Layout(pp=4), num_microbatches=4)
    plan = replace(plan, stages=tuple(replace(s, activation=a) for s, a in zip(plan.stages, policies)))
    report = run_plan(plan, RunOptions(steps=2, timeout_s=180))
    assert report.passed and report.grad_max_rel_diff is not None and report.grad_max_rel_diff <= GRAD_RTOL
    assert report.losses == pytest.approx(report.reference_losses, rel=1e-5)
