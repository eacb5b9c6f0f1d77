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
"""

from __future__ import annotations

import copy
import logging
from typing import Iterable, Mapping, Sequence

import torch
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput, parallelize_module

from ..data.plan import Plan
from ..errors import RunError
from ..model.contract import ModelFile
from ..model.tp import check_degree, find_tp_plan, narrow_planned, resolve, torch_styles

__all__ = ["planned_modules", "local_shapes", "restore_planned", "shared_input_styles", "parallelize_stage"]

logger = logging.getLogger(__name__)


#: Styles whose modules the export at local shapes narrows (the others keep full-size outputs under torch's styles).
_EXPORT_NARROWED = ("colwise", "rowwise")


# --- the model's TP plan (autopp.model.tp) -------------------------------------------------------------------

def planned_modules(mf: ModelFile, model: nn.Module, plan: Plan) -> dict[str, str]:
    """Concrete module name -> style from the model's TP plan (`find_tp_plan`: the model file's TP_PLAN or HF's),
    checked against the plan's record `tp_plan` and the degree; {} when plan.layout.tp is 1."""
    if plan.layout.tp == 1:
        return {}
    found = find_tp_plan(mf, model)
    if found is None:
        raise RunError(f"plan has tp {plan.layout.tp} but {mf.path} has no tensor-parallel plan (no TP_PLAN, no HF "
                       "base_model_tp_plan): plan with --tp 1")
    if plan.tp_plan and plan.tp_plan != found.patterns:
        differ = sorted(set(plan.tp_plan.items()) ^ set(found.patterns.items()))[0]
        raise RunError(f"plan field 'tp_plan' differs from the model's TP plan ({found.source}) at {differ[0]!r}: "
                       "re-plan from a profile of this model")
    resolved = resolve(found, model)
    check_degree(model, resolved, plan.layout.tp)
    return resolved


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
    profile's TP rows (autopp.model.tp.unit_collectives) count one all-reduce per distinct input tensor."""
    for node in graph.nodes:
        readers = [u.target for u in node.users
                   if u.op == "call_module" and u.target in children and u.args[:1] == (node,)]
        if len(readers) >= 2 and node not in shared:
            logger.warning("%s: colwise %s read one tensor (%s) that gets no PrepareModuleInput (it is not a module "
                           "input read by them alone): its gradient is all-reduced %d times, the profile counts 1",
                           parent, sorted(readers), node.name, len(readers))


# --- one stage ------------------------------------------------------------------------------------------------

def parallelize_stage(piece: nn.Module, mesh: DeviceMesh, resolved: dict[str, str], full_model: nn.Module,
                      device: torch.device) -> None:
    """Put `full_model`'s planned modules back into the piece (`restore_planned`) and tensor-parallelise them over
    `mesh` (the "tp" dimension), with a PrepareModuleInput for the colwise siblings that share an input."""
    present = restore_planned(piece, full_model, resolved)
    for name in present:
        piece.get_submodule(name).to(device)
    styles = shared_input_styles(piece, [n for n in present if resolved[n] == "colwise"])
    styles.update(torch_styles(resolved, present))
    if styles:
        parallelize_module(piece, mesh, styles)
    logger.info("tensor-parallel over %d ranks: %d modules (%d shared inputs)", mesh.size(), len(present),
                sum(isinstance(s, PrepareModuleInput) for s in styles.values()))
