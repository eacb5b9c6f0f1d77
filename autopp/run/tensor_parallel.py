"""Tensor parallelism on a rank's pipeline stages, with torch's own pieces: `parallelize_module` over the mesh's "tp"
dimension with the model's TP plan (autopp.model.tp; Megatron-LM's column -> row pattern, Shoeybi et al. 2019,
arXiv:1909.08053; torchtitan applies it the same way, torchtitan/models/llama3/infra/parallelize.py).

Why the model is exported at its local-shard shapes. The split's pieces are torch.export `InterpreterModule`s: a
planned `q_proj` is a graph calling aten.linear (torch's ColwiseParallel takes only nn.Linear / nn.Embedding), and
its parent's graph has the shapes of the export baked in (HF Llama's `repeat_kv`: `expand [b, kv_heads, n_rep, s,
d]`, `reshape [b, heads, s, d]`). Swapping the full-size nn.Linear back into a full-shape export and sharding it
fails there (the local shard has heads / t). So the model is exported with every colwise Linear narrowed to
out_features / t and every rowwise one to in_features / t (`local_shapes`: only shapes matter), and before
parallelize_module the full-size original modules (same seed, same weights as the one-process reference) are put
back in place of the planned leaves (`restore_planned`), which torch then shards to exactly those local shapes.

Sibling colwise modules reading one tensor (q/k/v, gate/up) share one input-gradient all-reduce: their parent gets
torch's `PrepareModuleInput` turning that input into a replicated DTensor (as torchtitan does), so the partial
gradients add up as a DTensor and are all-reduced once where the parent received the tensor.

Sequence parallelism (`Layout.sp`; Korthikanti et al. 2022, arXiv:2205.05198), as torchtitan applies it to Llama
(torchtitan/models/llama3/infra/parallelize.py, apply_tp): the sequence-wise modules (`autopp.model.tp.
sequence_modules`: the norms) run torch's `SequenceParallel` on 1/t of the sequence (dimension 1, [batch, sequence,
hidden]); the modules reading a norm's output (attention, MLP) get `PrepareModuleInput` Shard(1) -> Replicate()
(the all-gather in F, a reduce-scatter in B), and the rowwise projections inside them give Shard(1) (a
reduce-scatter in place of the all-reduce). The residual stream between the norms stays a local shard. A stage's
inputs and outputs stay whole tensors between pipeline stages, as torchtitan's PP x TP keeps them: the first
sequence-wise unit of a stage takes its share of a whole input (`PrepareModuleInput` Replicate() -> Shard(1), no
communication in F) and the last gives its output whole (`PrepareModuleOutput` Shard(1) -> Replicate(), an
all-gather), so SP applies inside a stage. An embedding read only by the stream gives its output sequence-sharded
(a reduce-scatter, as torchtitan's `tok_embeddings`); the head keeps its gathered input. A `LOSS_PARALLEL` head
(an HF config's, or one a TP_PLAN names) gives its logits as a DTensor sharded on the vocabulary, which the loss
reads under torch's `loss_parallel()` (autopp.run.pipeline.RankStages.running), as torchtitan runs it; a
colwise_gather_output head gathers them (a model file's own loss may read whole logits).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import replace
from typing import Iterable, Mapping, Sequence

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.utils._pytree import tree_map

from ..data.plan import Plan
from ..errors import RunError
from ..model.contract import ModelFile
from ..data.tp_plan import LOSS_PARALLEL
from ..model.tp import check_degree, find_tp_plan, narrow_planned, resolve, sequence_modules, torch_styles

__all__ = ["planned_modules", "sequence_planned", "local_shapes", "restore_planned", "shared_input_styles",
           "sequence_styles", "parallelize_stage"]

logger = logging.getLogger(__name__)


#: Styles whose modules the export at local shapes narrows (the others keep full-size outputs under torch's styles).
_EXPORT_NARROWED = ("colwise", "rowwise")


# --- the model's TP plan (autopp.model.tp) -------------------------------------------------------------------

def planned_modules(mf: ModelFile, model: nn.Module, plan: Plan) -> dict[str, str]:
    """Concrete module name -> style from the model's TP plan (`find_tp_plan`: the model file's TP_PLAN or HF's),
    checked against the plan's record `tp_plan` and the degree; {} when plan.layout.tp is 1. A plan whose head is
    gathered where the model's is loss-parallel now (or the reverse: a plan made from a profile counted before an
    HF config's head took LOSS_PARALLEL) runs its own head, as its profile counted it (logged)."""
    if plan.layout.tp == 1:
        return {}
    found = find_tp_plan(mf, model)
    if found is None:
        raise RunError(f"plan has tp {plan.layout.tp} but {mf.path} has no tensor-parallel plan (no TP_PLAN, no HF "
                       "base_model_tp_plan): plan with --tp 1")
    if plan.tp_plan and plan.tp_plan != found.patterns:
        differ = sorted(set(plan.tp_plan.items()) ^ set(found.patterns.items()))
        head = {"colwise_gather_output", LOSS_PARALLEL}
        if plan.tp_plan.keys() == found.patterns.keys() and all({plan.tp_plan[k], found.patterns[k]} == head
                                                                 for k, _ in differ):
            logger.info("%s as the plan has it (%s: %s), which its profile counted", found.source, differ[0][0],
                        plan.tp_plan[differ[0][0]])
            found = replace(found, patterns=dict(plan.tp_plan))
        else:
            raise RunError(f"plan field 'tp_plan' differs from the model's TP plan ({found.source}) at "
                           f"{differ[0][0]!r}: re-plan from a profile of this model")
    resolved = resolve(found, model)
    check_degree(model, resolved, plan.layout.tp)
    return resolved


def sequence_planned(mf: ModelFile, model: nn.Module, plan: Plan, resolved: Mapping[str, str],
                     example: Sequence[object]) -> list[str]:
    """The modules sequence parallelism shards along the sequence (`sequence_modules`) when the plan has `sp`, else
    []; a RunError when the example's sequence (dimension 1 of its first tensor) does not divide by tp, or when
    the model has none."""
    if not plan.layout.sp:
        return []
    found = find_tp_plan(mf, model)
    names = sequence_modules(found, model, resolved) if found is not None else []
    if not names:
        raise RunError(f"plan has sp but {mf.path} has no sequence-wise module (no norm beside the sharded "
                       "projections, no 'sequence_parallel' in TP_PLAN): plan with --sp off")
    first = next((x for x in example if isinstance(x, torch.Tensor)), None)
    seq = int(first.shape[1]) if first is not None and first.dim() > 1 else 0
    if seq % plan.layout.tp or not seq:
        raise RunError(f"sequence parallelism needs the sequence to divide by tp: {seq} % {plan.layout.tp} = "
                       f"{seq % plan.layout.tp if seq else 'n/a'}; plan with --sp off or another --tp")
    return names


# --- export at local-shard shapes, then the full-size modules back ----------------------------------------------

def local_shapes(model: nn.Module, resolved: Mapping[str, str], tp: int) -> nn.Module:
    """A copy of `model` whose colwise Linears have out_features / tp and rowwise ones in_features / tp (rank 0's
    shard; `autopp.model.tp.narrow_planned`, the home of the narrowing), to export: the pieces' graphs then bake the
    shapes each rank computes with. Unlike `local_shard` (made for measuring), the vocabulary-parallel embedding and
    the gathered head keep their full size, as their outputs do under torch's styles, and no hooks are added (the
    export would trace them into the pieces)."""
    return narrow_planned(copy.deepcopy(model), resolved, tp, styles=_EXPORT_NARROWED, hooks=False)


def _parent_of(root: nn.Module, name: str) -> tuple[str, nn.Module]:
    parent = name.rsplit(".", 1)[0] if "." in name else ""
    return parent, root.get_submodule(parent) if parent else root


def restore_planned(piece: nn.Module, full_model: nn.Module, resolved: Mapping[str, str]) -> list[str]:
    """Put `full_model`'s planned modules in place of the piece's exported ones (torch.export InterpreterModules
    at local shapes); returns the names replaced (the planned modules this piece holds)."""
    held = dict(piece.named_modules())
    present = [n for n in resolved if n in held]
    for name in present:
        _, parent = _parent_of(piece, name)
        setattr(parent, name.rsplit(".", 1)[-1], full_model.get_submodule(name))
    return present


def shared_input_styles(piece: nn.Module, colwise: Iterable[str]) -> dict[str, ParallelStyle]:
    """PrepareModuleInput for every parent whose graph feeds one of its inputs only to colwise children, two or
    more: that input becomes a replicated DTensor, so its gradient is all-reduced once, not once per child."""
    by_parent: dict[str, list[str]] = {}
    for name in colwise:
        by_parent.setdefault(name.rsplit(".", 1)[0] if "." in name else "", []).append(name.rsplit(".", 1)[-1])
    out: dict[str, ParallelStyle] = {}
    for parent, children in by_parent.items():
        graph = getattr(piece.get_submodule(parent) if parent else piece, "graph", None)
        if not isinstance(graph, fx.Graph) or len(children) < 2:
            continue
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        shared = [i for i, p in enumerate(placeholders) if len(p.users) >= 2 and all(
            u.op == "call_module" and u.target in children and u.args[:1] == (p,) for u in p.users)]
        _warn_unshared(parent or "<stage>", graph, children, {placeholders[i] for i in shared})
        if shared:
            layouts = tuple(Replicate() if i in shared else None for i in range(len(placeholders)))
            out[parent] = PrepareModuleInput(input_layouts=layouts, desired_input_layouts=layouts,
                                             use_local_output=False)
    return out


def _warn_unshared(parent: str, graph: fx.Graph, children: Sequence[str], shared: set[fx.Node]) -> None:
    """Log one line when two or more colwise children read one tensor that gets no PrepareModuleInput (another
    user reads it too, or the parent computes it): torch then all-reduces its gradient once per child, where the
    profile's TP rows (autopp.model.tp_collectives.unit_collectives) count one all-reduce per distinct input tensor."""
    for node in graph.nodes:
        readers = [u.target for u in node.users
                   if u.op == "call_module" and u.target in children and u.args[:1] == (node,)]
        if len(readers) >= 2 and node not in shared:
            logger.warning("%s: colwise %s read one tensor (%s) that gets no PrepareModuleInput (it is not a module "
                           "input read by them alone): its gradient is all-reduced %d times, the profile counts 1",
                           parent, sorted(readers), node.name, len(readers))


# --- sequence parallelism --------------------------------------------------------------------------------------

class _SequenceParallel(SequenceParallel):
    """torch's SequenceParallel with local outputs, for a module giving several (an exported norm also returns its
    input, the residual, beside the normalised tensor): each DTensor output back to its local shard."""

    def __init__(self) -> None:
        super().__init__(sequence_dim=1, use_local_output=True)

    @staticmethod
    def _prepare_output_fn(use_local_output: bool, mod: nn.Module, outputs: object,
                           device_mesh: DeviceMesh) -> object:
        return tree_map(lambda o: o.to_local() if isinstance(o, DTensor) else o, outputs)


def _drop_metadata_asserts(module: nn.Module) -> None:
    """Remove torch.export's `aten._assert_tensor_metadata` checks from an exported module's graph: DTensor has no
    sharding rule for them, and a norm run by SequenceParallel computes on DTensors (they only check dtype/device
    metadata the export saw)."""
    graph = getattr(module, "graph", None)
    if not isinstance(graph, fx.Graph):
        return
    asserts = [n for n in graph.nodes if n.target is torch.ops.aten._assert_tensor_metadata.default]
    for node in asserts:
        graph.erase_node(node)
    finalize = getattr(module, "finalize", None)
    if asserts and callable(finalize):
        finalize()


def _graphs(piece: nn.Module) -> list[tuple[str, fx.Graph]]:
    """(prefix, graph) of the piece (a ChainPiece's own piece) and of every submodule with a graph."""
    out = []
    for name, module in piece.named_modules():
        graph = getattr(getattr(module, "piece", module) if not name else module, "graph", None)
        if isinstance(graph, fx.Graph):
            out.append((f"{name}." if name else "", graph))
    return out


def _source(node: object) -> object:
    """The node a value comes from, through `getitem` of a module's tuple output."""
    while isinstance(node, fx.Node) and node.op == "call_function" and "getitem" in str(node.target):
        node = node.args[0]
    return node


def _readers(node: fx.Node) -> list[fx.Node]:
    """The nodes reading `node`'s value, through `getitem`."""
    out: list[fx.Node] = []
    for user in node.users:
        is_item = user.op == "call_function" and "getitem" in str(user.target)
        out.extend(_readers(user) if is_item else [user])
    return out


def _layouts(n: int, at: Iterable[int], placement: Placement) -> tuple[Placement | None, ...]:
    marked = set(at)
    return tuple(placement if i in marked else None for i in range(n))


def sequence_styles(piece: nn.Module, resolved: Mapping[str, str], sequence: Sequence[str],
                    units: Sequence[str]) -> tuple[dict[str, ParallelStyle], dict[str, ParallelStyle],
                                                   dict[str, ParallelStyle]]:
    """The piece's styles for sequence parallelism (module docstring), in three groups applied in this order: the
    stage's inputs split along the sequence; the norms (`sequence`), the modules reading them and the colwise /
    rowwise styles with their sequence layouts; the stage's outputs made whole. `units`: the stage's unit names,
    those holding a norm are the residual stream's steps."""
    held = dict(piece.named_modules())
    norms = [n for n in sequence if n in held]
    steps = {u for u in units if u in held and any(n == u or n.startswith(u + ".") for n in norms)}
    split: dict[str, ParallelStyle] = {}
    inner: dict[str, ParallelStyle] = {n: _SequenceParallel() for n in norms}
    whole: dict[str, ParallelStyle] = {}
    fed: dict[str, list[int]] = {}
    embeddings = _embeddings_into(piece, resolved, steps)
    inner.update({n: RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)) for n in embeddings})
    for prefix, graph in _graphs(piece):
        for node in graph.nodes:
            if node.op != "call_module":
                continue
            name = prefix + str(node.target)
            if name in norms and name not in steps:  # a step's own output: made whole at its boundary
                for reader in _readers(node):
                    if reader.op == "call_module" and prefix + str(reader.target) not in steps:
                        fed.setdefault(prefix + str(reader.target), []).extend(
                            i for i, a in enumerate(reader.args) if _source(a) is node)
            if name in steps:
                _boundary(node, name, prefix, (steps, steps | embeddings), held, norms, split, whole)
    for name, at in fed.items():
        if resolved.get(name) == "colwise":
            inner[name] = ColwiseParallel(input_layouts=Shard(1))
            continue
        n = len(held[name].graph.find_nodes(op="placeholder")) if isinstance(getattr(held[name], "graph", None),
                                                                              fx.Graph) else max(at) + 1
        inner[name] = PrepareModuleInput(input_layouts=_layouts(n, at, Shard(1)),
                                         desired_input_layouts=_layouts(n, at, Replicate()), use_local_output=False)
        for inside, style in resolved.items():
            if style == "rowwise" and inside.startswith(name + ".") and inside in held:
                inner[inside] = RowwiseParallel(output_layouts=Shard(1))
            elif style == "colwise" and inside.startswith(name + ".") and inside in held:
                inner[inside] = ColwiseParallel()
    return split, inner, whole


def _embeddings_into(piece: nn.Module, resolved: Mapping[str, str], steps: set[str]) -> set[str]:
    """The vocabulary-parallel embeddings whose output only steps of the residual stream read: they give it
    sequence-sharded (torchtitan's `RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))`: a
    reduce-scatter in place of the all-reduce)."""
    out = set()
    for prefix, graph in _graphs(piece):
        for node in graph.find_nodes(op="call_module"):
            name, readers = prefix + str(node.target), _readers(node)
            if resolved.get(name) == "embedding_rowwise" and readers and all(
                    r.op == "call_module" and prefix + str(r.target) in steps for r in readers):
                out.add(name)
    return out


def _boundary(node: fx.Node, name: str, prefix: str, stream: tuple[set[str], set[str]],
              held: Mapping[str, nn.Module], norms: Sequence[str], split: dict[str, ParallelStyle],
              whole: dict[str, ParallelStyle]) -> None:
    """The boundary styles of one step of the residual stream (`sequence_styles`): its sequence inputs that come
    from outside the stream are split, and its outputs are made whole when nothing in the stream reads them.
    `stream`: the steps, and the modules whose output is sequence-sharded (the steps and `_embeddings_into`)."""
    steps, sharded = stream
    graph = getattr(held[name], "graph", None)
    if name in norms or not isinstance(graph, fx.Graph):
        seq_in = [0]
    else:
        holders = [n for n in norms if n.startswith(name + ".")]
        placeholders = list(graph.find_nodes(op="placeholder"))
        seq_in = [i for i, p in enumerate(placeholders)
                  if any(u.op == "call_module" and f"{name}.{u.target}" in holders for u in p.users)]
    sources = [_source(a) for a in node.args]
    outside = [i for i in seq_in if i < len(sources) and not (
        isinstance(src := sources[i], fx.Node) and src.op == "call_module" and prefix + str(src.target) in sharded)]
    if outside:
        n = len(node.args)
        split[name] = PrepareModuleInput(input_layouts=_layouts(n, outside, Replicate()),
                                         desired_input_layouts=_layouts(n, outside, Shard(1)), use_local_output=True)
    readers = _readers(node)
    in_stream = [r.op == "call_module" and prefix + str(r.target) in steps for r in readers]
    if any(in_stream) and not all(in_stream):
        raise RunError(f"sequence parallelism: {name}'s output is read both inside the residual stream and outside "
                       "it (by " + ", ".join(str(r.target) for r, s in zip(readers, in_stream) if not s) + "): not "
                       "supported; plan with --sp off")
    if readers and not any(in_stream):
        out = graph.output_node().args[0] if isinstance(graph, fx.Graph) else None
        count = len(out) if isinstance(out, (list, tuple)) else 1
        whole[name] = PrepareModuleOutput(output_layouts=(Shard(1),) * count,
                                          desired_output_layouts=(Replicate(),) * count, use_local_output=True)


# --- one stage ------------------------------------------------------------------------------------------------

def parallelize_stage(piece: nn.Module, mesh: DeviceMesh, resolved: dict[str, str], full_model: nn.Module,
                      device: torch.device, sequence: Sequence[str] = (), units: Sequence[str] = ()) -> None:
    """Put `full_model`'s planned modules back into the piece (`restore_planned`) and tensor-parallelise them over
    `mesh` (the "tp" dimension), with a PrepareModuleInput for the colwise siblings that share an input; with
    `sequence` (the norms, `sequence_planned`), sequence-parallel as well (`sequence_styles`; `units`: the stage's
    unit names)."""
    present = restore_planned(piece, full_model, resolved)
    for name in present:
        piece.get_submodule(name).to(device)
    styles = shared_input_styles(piece, [n for n in present if resolved[n] == "colwise"])
    styles.update(torch_styles(resolved, present))
    split, inner, whole = sequence_styles(piece, resolved, sequence, units) if sequence else ({}, {}, {})
    for name in sequence:
        if name in inner:
            _drop_metadata_asserts(piece.get_submodule(name))
    styles.update(inner)
    for group in (split, styles, whole):
        if group:
            parallelize_module(piece, mesh, group)
    heads = [n for n in present if resolved[n] == LOSS_PARALLEL]
    logger.info("tensor-parallel over %d ranks: %d modules (%d shared inputs)%s%s", mesh.size(), len(present),
                sum(isinstance(s, PrepareModuleInput) for s in styles.values()),
                f"; sequence-parallel: {sum(n in inner for n in sequence)} norms, {len(split)} stage inputs split, "
                f"{len(whole)} outputs gathered" if sequence else "",
                f"; loss parallel: {heads[0]}'s logits stay sharded into the loss" if heads else "")
