"""Tensor parallelism in the runner (autopp.run.tensor_parallel): the model's TP plan checked against the plan's, the
export at local-shard shapes with the full modules put back, and the all-reduces torch then runs."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

import pytest
import torch
from torch import fx, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

from autopp.data.layout import Layout
from autopp.errors import RunError, TpPlanError
from autopp.model import load_model_file
from autopp.model.split import split_model
from autopp.model.tp import find_tp_plan, local_shard, narrow_planned, resolve, sequence_modules, torch_styles
from autopp.run.tensor_parallel import (local_shapes, parallelize_stage, planned_modules, restore_planned,
                                        sequence_planned, sequence_styles, shared_input_styles)

from .conftest import GPT, ROOT, pipeline_plan

LLAMA = ROOT / "examples" / "hf_llama.py"


def test_the_plans_tp_plan_must_be_the_models() -> None:
    mf = load_model_file(LLAMA)
    plan = pipeline_plan(LLAMA, ["model.layers.2"], layout=Layout(pp=2, tp=2))
    resolved = planned_modules(mf, mf.build(0), plan)
    assert resolved["model.layers.0.self_attn.q_proj"] == "colwise" and resolved["lm_head"] == "colwise_gather_output"
    assert resolved["model.embed_tokens"] == "embedding_rowwise" and len(resolved) == 2 + 7 * 4
    other = replace(plan, tp_plan={**plan.tp_plan, "model.layers.*.mlp.down_proj": "colwise"})
    with pytest.raises(RunError, match=r"^plan field 'tp_plan' differs from the model's TP plan .* at "
                                       r"'model.layers.\*.mlp.down_proj': re-plan"):
        planned_modules(mf, mf.build(0), other)
    # a plan counted with the head loss-parallel (or gathered) where the model's is the other runs its own head
    sharded = replace(plan, tp_plan={**plan.tp_plan, "lm_head": "colwise_loss_parallel"})
    assert planned_modules(mf, mf.build(0), sharded)["lm_head"] == "colwise_loss_parallel"
    gpt = pipeline_plan(GPT, ["h.2"], layout=Layout(pp=2, tp=2))
    with pytest.raises(RunError, match="has no tensor-parallel plan .*: plan with --tp 1$"):
        planned_modules(load_model_file(GPT), load_model_file(GPT).build(0), gpt)
    with pytest.raises(TpPlanError, match="degree 8 does not divide"):
        planned_modules(mf, mf.build(0), replace(plan, layout=replace(plan.layout, tp=8)))


def test_local_shapes_narrow_the_sharded_linears_of_a_copy() -> None:
    mf = load_model_file(LLAMA)
    model = mf.build(0)
    resolved = resolve(find_tp_plan(mf, model), model)  # type: ignore[arg-type]
    local = local_shapes(model, resolved, 2)
    get = local.get_submodule
    assert (get("model.layers.0.self_attn.q_proj").out_features, get("model.layers.0.self_attn.k_proj").out_features,
            get("model.layers.0.self_attn.o_proj").in_features, get("model.layers.1.mlp.down_proj").in_features) == (
        32, 16, 32, 128)
    assert get("lm_head").out_features == 2048 and get("model.embed_tokens").num_embeddings == 2048
    assert model.get_submodule("model.layers.0.self_attn.q_proj").out_features == 64  # the original is untouched


def test_local_shapes_and_local_shard_narrow_with_one_function() -> None:
    """Issue 17 review (d): the export's narrowing is autopp.model.tp.narrow_planned, the one local_shard uses: the
    same weights for colwise and rowwise, no hooks, and the embedding / gathered head left whole."""
    mf = load_model_file(LLAMA)
    model = mf.build(0)
    resolved = resolve(find_tp_plan(mf, model), model)  # type: ignore[arg-type]
    exported, measured = local_shapes(model, resolved, 2), local_shard(mf.build(0), resolved, 2)
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        assert torch.equal(exported.get_submodule(name).weight, measured.get_submodule(name).weight)
    head = exported.get_submodule("lm_head")
    assert head.out_features == 2048 and not head._forward_hooks
    same = narrow_planned(mf.build(0), resolved, 2, styles=("colwise", "rowwise"), hooks=False)
    assert [p.shape for p in same.parameters()] == [p.shape for p in exported.parameters()]


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_pieces_exported_at_local_shapes_get_the_full_modules_back() -> None:
    """The route that works (autopp/run/tensor_parallel.py): export at local shapes, put the full nn.Linears back, and give
    the parents of siblings reading one tensor (q/k/v, gate/up) a PrepareModuleInput on that input."""
    mf = load_model_file(LLAMA)
    model = mf.build(0)
    resolved = resolve(find_tp_plan(mf, model), model)  # type: ignore[arg-type]
    example, _ = mf.sample_batch(2, seed=0)
    piece = split_model(local_shapes(model, resolved, 2), example, ["model.layers.2"]).get_stage_module(0)
    assert type(piece.get_submodule("model.layers.0.self_attn.q_proj")).__name__ == "InterpreterModule"
    present = restore_planned(piece, model, resolved)
    assert len(present) == 1 + 7 * 2 and "lm_head" not in present
    q = piece.get_submodule("model.layers.0.self_attn.q_proj")
    assert isinstance(q, nn.Linear) and q is model.get_submodule("model.layers.0.self_attn.q_proj")
    styles = shared_input_styles(piece, [n for n in present if resolved[n] == "colwise"])
    assert sorted(styles) == [f"model.layers.{i}.{m}" for i in (0, 1) for m in ("mlp", "self_attn")]
    attn = styles["model.layers.0.self_attn"]
    assert isinstance(attn, PrepareModuleInput) and sum(p is not None for p in attn.input_layouts) == 1


class _Attention(nn.Module):
    """q and k read the input x, which the residual reads too: x cannot become one replicated DTensor input."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.q(x) * self.k(x)


def test_siblings_reading_a_tensor_that_gets_no_prepare_module_input_are_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 17 review (c): the profile counts one input-gradient all-reduce per tensor that colwise siblings read;
    torch runs one per sibling when the parent gets no PrepareModuleInput. That must not pass silently."""
    piece = nn.Module()
    piece.attn = fx.symbolic_trace(_Attention())
    with caplog.at_level(logging.WARNING, logger="autopp.run.tensor_parallel"):
        assert shared_input_styles(piece, ["attn.q", "attn.k"]) == {}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("attn: colwise ['k', 'q'] read one tensor (x) that gets no "
                                                   "PrepareModuleInput") and "\n" not in lines[0]
    caplog.clear()
    piece.attn = fx.symbolic_trace(_Attention())
    with caplog.at_level(logging.WARNING, logger="autopp.run.tensor_parallel"):
        assert shared_input_styles(piece, ["attn.q"]) == {}  # one colwise reader: nothing shared, nothing to say
    assert not caplog.records


def _stage0_allreduces(share: bool) -> int:
    """All-reduces CommDebugMode sees in one forward and backward of the tiny Llama's stage 0 (embedding + 2
    blocks) tensor-parallel over 2 ranks of a fake process group (counts only: its collectives return their input)."""
    mf = load_model_file(LLAMA)
    model = mf.build(0)
    resolved = resolve(find_tp_plan(mf, model), model)  # type: ignore[arg-type]
    example, _ = mf.sample_batch(2, seed=0)
    piece = split_model(local_shapes(model, resolved, 2), example, ["model.layers.2"]).get_stage_module(0)
    present = restore_planned(piece, model, resolved)
    styles = shared_input_styles(piece, [n for n in present if resolved[n] == "colwise"]) if share else {}
    styles.update(torch_styles(resolved, present))
    parallelize_module(piece, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), styles)
    with CommDebugMode() as comm:
        out = piece(*example)
        sum(o.float().sum() for o in out if isinstance(o, torch.Tensor) and o.requires_grad).backward()
    return int(sum(n for op, n in comm.get_comm_counts().items() if "all_reduce" in str(op)))


@pytest.mark.integration  # exports the tiny Llama (seconds)
def test_stage_allreduces_are_what_the_profiles_tp_rows_count(fake_world: Callable[[int], None]) -> None:
    """Issue 17 review (c): the all-reduces torch runs on a tp-2 stage equal the profile's TP rows for its units
    (forward + backward collectives; embedding 1 + 0, each block 2 + 2), and would not without PrepareModuleInput
    on the q/k/v and gate/up parents."""
    from autopp.measure.tp_rows import tp_collectives
    from autopp.model.units import discover_units

    mf = load_model_file(LLAMA)
    model = mf.build(0)
    resolved = resolve(find_tp_plan(mf, model), model)  # type: ignore[arg-type]
    units = discover_units(mf, model)
    cut = next(u.index for u in units if u.split_point == "model.layers.2")
    rows = tp_collectives(mf, model, resolved, units, 2, torch.float32)[:cut]
    counted = sum(r.forward_collectives + r.backward_collectives for r in rows)
    assert counted == 1 + 2 * (2 + 2)
    fake_world(2)
    assert _stage0_allreduces(share=True) == counted
    assert _stage0_allreduces(share=False) == counted + 2 * (2 + 1)  # q/k/v: 3 not 1, gate/up: 2 not 1


def test_sequence_parallelism_needs_the_sequence_to_divide_by_tp() -> None:
    mf = load_model_file(LLAMA)
    model = mf.build(0)
    plan = pipeline_plan(LLAMA, ["model.layers.2"], layout=Layout(pp=2, tp=2, sp=True))
    resolved = planned_modules(mf, model, plan)
    assert len(sequence_planned(mf, model, plan, resolved, [torch.zeros(2, 32, dtype=torch.long)])) == 9
    assert sequence_planned(mf, model, replace(plan, layout=Layout(pp=2, tp=2)), resolved, []) == []
    with pytest.raises(RunError, match=r"^sequence parallelism needs the sequence to divide by tp: 31 % 2 = 1; plan "
                                       r"with --sp off or another --tp$"):
        sequence_planned(mf, model, plan, resolved, [torch.zeros(2, 31, dtype=torch.long)])


def _stage_collectives(stage: int, units: list[str]) -> tuple[dict[str, int], tuple[dict[str, object], ...]]:
    """Collectives CommDebugMode sees in one forward and backward of one stage of the tiny Llama cut at layer 2,
    tensor- and sequence-parallel over 2 ranks of a fake process group, and the styles of `sequence_styles`."""
    mf = load_model_file(LLAMA)
    model = mf.build(0)
    found = find_tp_plan(mf, model)
    assert found is not None
    resolved = resolve(found, model)
    norms = sequence_modules(found, model, resolved)
    example, _ = mf.sample_batch(2, seed=0)
    pipe = split_model(local_shapes(model, resolved, 2), example, ["model.layers.2"])
    piece = pipe.get_stage_module(stage)
    styles = sequence_styles(piece, resolved, norms, units)
    args = example if stage == 0 else [torch.randn(2, 32, 64, requires_grad=True), *_stage0_outputs(pipe, example)]
    parallelize_stage(piece, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), resolved, model,
                      torch.device("cpu"), norms, units)
    with CommDebugMode() as comm:
        out = piece(*args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        assert tuple(outs[0].shape) == ((2, 32, 64) if stage == 0 else (2, 32, 2048))  # whole between stages
        sum(o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad).backward()
    counts = {str(op).split(".")[-1]: int(n) for op, n in comm.get_comm_counts().items()}
    return counts, tuple({k: type(v).__name__ for k, v in group.items()} for group in styles)


def _stage0_outputs(pipe: object, example: object) -> list[torch.Tensor]:
    """Stage 1's inputs after the hidden state (rotary tables, mask), from a plain forward of stage 0."""
    with torch.no_grad():
        return list(pipe.get_stage_module(0)(*example))[1:]  # type: ignore[attr-defined]


@pytest.mark.integration  # exports the tiny Llama (seconds)
def test_sequence_parallel_stages_reduce_scatter_and_all_gather(fake_world: Callable[[int], None]) -> None:
    """With SP a block's all-reduces become reduce-scatters and all-gathers (Korthikanti et al. 2022): per block 2
    all-gathers (attention and MLP inputs) + 2 reduce-scatters (o_proj, down_proj) in F, as many in B; the stage
    input is split locally (an all-gather of its gradient in B) and its output gathered in F. The embedding, read by
    the blocks alone, reduce-scatters its output (an all-gather in B; torchtitan's tok_embeddings); the head's input
    gradient is still all-reduced, as without SP."""
    fake_world(2)
    counts, (split, inner, whole) = _stage_collectives(0, ["model.embed_tokens", "model.layers.0", "model.layers.1"])
    assert counts == {"all_gather_into_tensor": 2 * 4 + 1 + 1, "reduce_scatter_tensor": 2 * 4 + 1}
    assert split == {} and whole == {"model.layers.1": "PrepareModuleOutput"}
    assert inner["model.embed_tokens"] == "RowwiseParallel"
    assert sorted(k for k, v in inner.items() if v == "_SequenceParallel") == [
        f"model.layers.{i}.{n}" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")]
    assert inner["model.layers.0.self_attn"] == inner["model.layers.1.mlp"] == "PrepareModuleInput"
    counts, (split, inner, whole) = _stage_collectives(1, ["model.layers.2", "model.layers.3", "model.norm"])
    assert counts == {"all_reduce": 1, "all_gather_into_tensor": 2 * 4 + 3, "reduce_scatter_tensor": 2 * 4}
    assert split == {"model.layers.2": "PrepareModuleInput"} and whole == {"model.norm": "PrepareModuleOutput"}


def test_loss_parallel_runs_the_collectives_its_rows_count(fake_world: Callable[[int], None]) -> None:
    """torch's loss_parallel on a head of colwise_loss_parallel's style (tp 2, bfloat16): three all-reduces in the
    forward, the input gradient's one in the backward, as autopp.model.tp_collectives counts them; the logits stay
    a DTensor sharded on the vocabulary."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.nn import functional as F

    from autopp.model.tp_collectives import unit_collectives

    head = nn.Sequential(nn.Linear(8, 32, bias=False)).to(torch.bfloat16)
    x = torch.randn(3, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 32, (3, 5))
    (counted,) = unit_collectives(head, {"0": "colwise_loss_parallel"}, [["0"]], lambda: head(x))
    fake_world(2)
    parallelize_module(head, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)),
                       torch_styles({"0": "colwise_loss_parallel"}, ["0"]))
    with loss_parallel():
        with CommDebugMode() as forward:
            logits = head(x)
            loss = F.cross_entropy(logits.reshape(-1, 32), target.reshape(-1))
        with CommDebugMode() as backward:
            loss.backward()
    assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)

    def all_reduces(mode: CommDebugMode) -> int:
        return int(sum(n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op)))
    assert (all_reduces(forward), all_reduces(backward)) == (counted.forward_collectives, counted.backward_collectives)
    assert (counted.forward_collectives, counted.backward_collectives) == (3, 1)
