"""Tensor-parallel plans: find a model's plan (TP_PLAN in the model file, else Hugging Face's), resolve its patterns
to modules, the degrees it allows, torch's ParallelStyle per module, and one rank's local shard of the model (for
measuring and counting its compute). Each unit's TP collectives: autopp.model.tp_collectives."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from functools import partial
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from ..data.tp_plan import LOSS_PARALLEL
from ..errors import TpPlanError
from .contract import ModelFile
from .hf_plans import divide_heads, extra_plan
from .tp_loss import LocalLoss

__all__ = ["GRAD_ALLREDUCE", "TP_STYLES", "STYLE_ALIASES", "TpPlan", "find_tp_plan", "resolve", "tp_degrees",
           "check_degree", "torch_styles", "narrow_planned", "local_shard", "local_shard_of", "local_model_file",
           "SEQUENCE_STYLE", "sequence_modules"]

log = logging.getLogger(__name__)

#: Hugging Face's style for a norm between colwise and rowwise layers that normalizes along the sharded heads
#: (transformers/distributed/tensor_parallel.py, ReplicatedWithGradAllReduce: Qwen3's q_norm and k_norm).
GRAD_ALLREDUCE = "replicated_with_grad_allreduce"
#: The styles autopp supports, each with its meaning (HF's names; torch's equivalent in `torch_styles`).
TP_STYLES: dict[str, str] = {
    "colwise": "nn.Linear split on its output features: input replicated, output sharded "
               "(backward: all-reduce of the input gradient)",
    "rowwise": "nn.Linear split on its input features: input sharded, partial outputs summed "
               "(forward: all-reduce of the output)",
    "colwise_gather_output": "colwise with the output gathered to full width (forward: all-gather of the output; "
                             "backward: all-reduce of the input gradient)",
    LOSS_PARALLEL: "colwise output layer whose logits stay sharded on the vocabulary into the loss, a cross-entropy "
                   "of them (torch's loss_parallel; forward: all-reduces of each token's maximum, sum of exponentials "
                   "and target logit; backward: all-reduce of the input gradient)",
    "embedding_rowwise": "nn.Embedding split on the vocabulary: partial lookups summed (forward: all-reduce of the "
                         "output)",
    GRAD_ALLREDUCE: "module replicated on every TP rank, fed only this rank's heads, so its parameter gradients are "
                    "partial (backward: all-reduce of its parameter gradients, per microbatch, as transformers' "
                    "ReplicatedWithGradAllReduce hooks them; no forward collective)",
}
#: The style a TP_PLAN gives a module that sequence parallelism shards along the sequence (torch's `SequenceParallel`;
#: HF's plans name none, so `sequence_modules` derives them). `resolve` leaves these entries to `sequence_modules`.
SEQUENCE_STYLE = "sequence_parallel"
#: Other names of the supported styles (Hugging Face's older spelling).
STYLE_ALIASES: dict[str, str] = {"colwise_rep": "colwise_gather_output"}
#: The module type each style shards (GRAD_ALLREDUCE shards nothing: any module).
_MODULE_TYPES: dict[str, type[nn.Module]] = {"colwise": nn.Linear, "rowwise": nn.Linear,
                                             "colwise_gather_output": nn.Linear, LOSS_PARALLEL: nn.Linear,
                                             "embedding_rowwise": nn.Embedding,
                                             GRAD_ALLREDUCE: nn.Module}
#: Per style, the parameter dimension split across the TP ranks, and the module attribute holding its size.
_SHARDED: dict[str, tuple[int, str]] = {"colwise": (0, "out_features"), "rowwise": (1, "in_features"),
                                        "colwise_gather_output": (0, "out_features"),
                                        LOSS_PARALLEL: (0, "out_features"), "embedding_rowwise": (0, "num_embeddings")}
#: Config fields of an HF model that TP divides among the ranks (attention heads).
_HF_DIVIDED = ("num_attention_heads", "num_key_value_heads")


@dataclass(frozen=True)
class TpPlan:
    """A tensor-parallel plan: module-name pattern (from the model root; `*` matches within one dotted token, as
    torch's parallelize_module) -> style, and where it came from."""

    patterns: dict[str, str]
    source: str
    partial: bool = False
    """A Hugging Face plan: a pattern that matches no module is left unused, as transformers applies its plan (by
    module name; Qwen3-MoE's plan names the dense-MLP projections that layers with routed experts lack), not refused
    as in a TP_PLAN the user wrote."""


def _hf_model(model: nn.Module) -> tuple[str, nn.Module] | None:
    """The first Hugging Face PreTrainedModel in `model` (itself, or under the user's wrapper) and its name."""
    for name, module in model.named_modules():
        if any(c.__name__ == "PreTrainedModel" for c in type(module).__mro__):
            return name, module
    return None


def _hf_source(hf: nn.Module, prefix: str) -> str:
    """`LlamaConfig.base_model_tp_plan under 'model.' + LlamaForCausalLM._tp_plan`, as HF merges them."""
    base = getattr(hf, "base_model", hf)
    base_name = next((n for n, m in hf.named_modules() if m is base), "")
    under = prefix + (f"{base_name}." if base_name else "")
    text = f"{type(hf.config).__name__}.base_model_tp_plan under {under!r}"  # type: ignore[union-attr]
    if getattr(type(hf), "_tp_plan", None):
        text += f" + {type(hf).__name__}._tp_plan"
    return text


def find_tp_plan(mf: ModelFile, model: nn.Module, counting: bool = False) -> TpPlan | None:
    """The model's plan: TP_PLAN of the model file (an empty one: no plan), else the merged HF plan of the first
    PreTrainedModel in `model` (config.base_model_tp_plan, the model class's `_tp_plan`, `embed_tokens` vocabulary
    parallel), its names prefixed with its path under a wrapper; with `counting` (profiling, not running), else the
    plan autopp keeps for the model type (autopp.model.hf_plans: BLOOM); None when there is none (GPT-2)."""
    if mf.tp_plan is not None:
        return TpPlan(dict(mf.tp_plan), f"TP_PLAN in {mf.path}") if mf.tp_plan else None
    found = _hf_model(model)
    if found is None:
        return None
    name, hf = found
    prefix = f"{name}." if name else ""
    plan = getattr(hf, "tp_plan", None)
    head = _output_layer(hf, prefix) if mf.cross_entropy else None
    if isinstance(plan, dict) and plan:
        return _loss_parallel(TpPlan({prefix + k: str(v) for k, v in plan.items()}, _hf_source(hf, prefix),
                                     partial=True), head)
    extra = extra_plan(hf) if counting else None
    if extra is None:
        return None
    base = getattr(hf, "base_model", hf)
    under = prefix + next((f"{n}." for n, m in hf.named_modules() if m is base and n), "")
    return _loss_parallel(TpPlan({**{prefix + k: v for k, v in extra.head.items()},
                                  **{under + k: v for k, v in extra.base.items()}}, extra.source), head)


def _output_layer(hf: nn.Module, prefix: str) -> str | None:
    """The name (from the model root) of the HF model's output layer, `get_output_embeddings()`; None without one."""
    get = getattr(hf, "get_output_embeddings", None)
    out = get() if callable(get) else None
    return next((prefix + n for n, m in hf.named_modules() if m is out and n), None) if out is not None else None


def _loss_parallel(plan: TpPlan, head: str | None) -> TpPlan:
    """The plan with its gathered output layer `head` (an HF config's, whose loss is autopp's cross-entropy of the
    logits: `ModelFile.cross_entropy`) as `LOSS_PARALLEL`, as torchtitan and Megatron-LM run it; other gathered
    modules (inside Qwen3-Next's blocks) stay gathered; without `head` (a model file's own loss may read whole
    logits), the plan as is."""
    swapped = {k: LOSS_PARALLEL if head is not None and _matches(k, head)
               and STYLE_ALIASES.get(v, v) == "colwise_gather_output" else v for k, v in plan.patterns.items()}
    if swapped == plan.patterns:
        return plan
    return TpPlan(swapped, f"{plan.source}, its head's logits kept sharded into the loss (loss parallel)", plan.partial)


def _matches(pattern: str, name: str) -> bool:
    """torch parallelize_module's matching: token by token (split on '.'), each with fnmatch."""
    tokens, parts = pattern.split("."), name.split(".")
    return len(tokens) == len(parts) and all(fnmatchcase(p, t) for t, p in zip(tokens, parts))


def _style(style: str, pattern: str, source: str) -> str:
    """The canonical name of `style`, or a TpPlanError naming it and the supported ones."""
    canonical = STYLE_ALIASES.get(style, style)
    if canonical not in TP_STYLES:
        raise TpPlanError(f"{source}: {pattern!r}: style {style!r} is not supported; use one of "
                          f"{[*TP_STYLES, SEQUENCE_STYLE]} (or the alias {', '.join(STYLE_ALIASES)})")
    return canonical


def resolve(plan: TpPlan, model: nn.Module) -> dict[str, str]:
    """Concrete module name -> canonical style, in model order. TpPlanError on a pattern that matches no module (in
    a plan not `partial`; in one: when none matches), a style not supported, a module of the wrong type for its
    style, or two styles for one module."""
    modules = dict(model.named_modules())
    out: dict[str, str] = {}
    for pattern, style in plan.patterns.items():
        if style == SEQUENCE_STYLE:
            continue
        canonical = _style(style, pattern, plan.source)
        hits = [n for n in modules if n and _matches(pattern, n)]
        if not hits and plan.partial:
            log.info("%s: pattern %r matches no module of %s; left unused", plan.source, pattern, type(model).__name__)
            continue
        if not hits:
            example = next((n for n, m in modules.items() if isinstance(m, (nn.Linear, nn.Embedding))), "")
            raise TpPlanError(f"{plan.source}: pattern {pattern!r} matches no module of {type(model).__name__}; "
                              f"names start at the model root (e.g. {example!r}), '*' stands for one name part")
        for name in hits:
            kind = _MODULE_TYPES[canonical]
            if not isinstance(modules[name], kind):
                raise TpPlanError(f"{plan.source}: {name} (pattern {pattern!r}) is a "
                                  f"{type(modules[name]).__qualname__}; style {style!r} shards only "
                                  f"torch.nn.{kind.__name__}")
            if out.setdefault(name, canonical) != canonical:
                raise TpPlanError(f"{plan.source}: {name} is given two styles, {out[name]!r} and {canonical!r}")
    heads = [n for n, s in out.items() if s == LOSS_PARALLEL]
    if len(heads) > 1:
        raise TpPlanError(f"{plan.source}: {LOSS_PARALLEL!r} is the output layer's style (its logits into the loss), "
                          f"given to {len(heads)} modules ({heads[0]}, {heads[1]}): give it to the output layer "
                          "alone, 'colwise_gather_output' to the others")
    if plan.partial and not out and any(s != SEQUENCE_STYLE for s in plan.patterns.values()):
        raise TpPlanError(f"{plan.source}: none of its {len(plan.patterns)} patterns matches a module of "
                          f"{type(model).__name__}")
    return {n: out[n] for n in modules if n in out}


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))


def sequence_modules(plan: TpPlan, model: nn.Module, resolved: Mapping[str, str]) -> list[str]:
    """The modules sequence parallelism runs on 1/t of the sequence (torch's `SequenceParallel`), in model order:
    those a TP_PLAN names with `SEQUENCE_STYLE`, else the norms between the sharded projections: every LayerNorm /
    RMSNorm with no colwise or rowwise sibling (Llama's input_layernorm, post_attention_layernorm and final norm; not
    a per-head q_norm inside the attention), as torchtitan's Llama plan lists them (torchtitan/models/llama3/infra/
    parallelize.py, apply_tp; Korthikanti et al. 2022, arXiv:2205.05198, s.4.2.2). TpPlanError on a named pattern
    that matches no module."""
    modules = dict(model.named_modules())
    named = [p for p, s in plan.patterns.items() if s == SEQUENCE_STYLE]
    if named:
        hits = {n for p in named for n in modules if n and _matches(p, n)}
        missing = [p for p in named if not any(_matches(p, n) for n in hits)]
        if missing:
            raise TpPlanError(f"{plan.source}: {SEQUENCE_STYLE} pattern {missing[0]!r} matches no module of "
                              f"{type(model).__name__}")
        return [n for n in modules if n in hits]
    sharding_parents = {n.rsplit(".", 1)[0] if "." in n else "" for n, s in resolved.items()
                        if s in ("colwise", "rowwise")}
    return [n for n, m in modules.items()
            if n and _is_norm(m) and (n.rsplit(".", 1)[0] if "." in n else "") not in sharding_parents]


def _divided(model: nn.Module, resolved: dict[str, str]) -> list[tuple[str, int]]:
    """What TP at degree t divides by t: each sharded dimension (`name.attr`, size), and the HF config's heads."""
    dims = [(f"{n}.{_SHARDED[s][1]}", int(getattr(model.get_submodule(n), _SHARDED[s][1])))
            for n, s in resolved.items() if s in _SHARDED]
    found = _hf_model(model) if resolved else None
    config = getattr(found[1], "config", None) if found else None
    dims += [(f"config.{k}", int(getattr(config, k))) for k in _HF_DIVIDED
             if isinstance(getattr(config, k, None), int)]
    return dims


def tp_degrees(model: nn.Module, resolved: dict[str, str], limit: int) -> list[int]:
    """The degrees t <= `limit` (1 included) that divide every dimension the plan shards (and an HF config's
    num_attention_heads / num_key_value_heads)."""
    dims = _divided(model, resolved)
    return [t for t in range(1, max(1, limit) + 1) if all(size % t == 0 for _, size in dims)]


def check_degree(model: nn.Module, resolved: dict[str, str], t: int) -> None:
    """TpPlanError unless degree `t` (>= 1) divides every dimension the plan shards (naming the first that it does
    not divide)."""
    if t < 1:
        raise TpPlanError(f"tensor-parallel degree must be >= 1, got {t}")
    for what, size in _divided(model, resolved):
        if size % t:
            raise TpPlanError(f"tensor-parallel degree {t} does not divide {what} ({size}); use one of "
                              f"{[d for d in tp_degrees(model, resolved, t) if d > 1] or 'none'}")


def torch_styles(resolved: dict[str, str], present: Iterable[str]) -> dict[str, Any]:
    """torch ParallelStyles for the planned modules among `present` (module names, e.g. a stage's), for
    `parallelize_module`: colwise ColwiseParallel(), rowwise RowwiseParallel(), colwise_gather_output
    ColwiseParallel(output_layouts=Replicate()), LOSS_PARALLEL ColwiseParallel(output_layouts=Shard(-1),
    use_local_output=False) (its loss runs under torch's `loss_parallel()`), embedding_rowwise
    RowwiseParallel(input_layouts=Replicate()).
    TpPlanError on a GRAD_ALLREDUCE module: torch has no ParallelStyle for it and the runner does not hook its
    gradients (the planner counts it)."""
    names = set(present)
    refused = next((n for n, s in resolved.items() if n in names and s == GRAD_ALLREDUCE), None)
    if refused is not None:
        raise TpPlanError(f"{refused}: style {GRAD_ALLREDUCE!r} is planned but not run: autopp's runner does not "
                          "all-reduce its gradients over the TP ranks; run a plan with tp 1")
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    make: dict[str, Callable[[], Any]] = {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        LOSS_PARALLEL: lambda: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    return {n: make[STYLE_ALIASES.get(s, s)]() for n, s in resolved.items() if n in names}


def _narrow(module: nn.Module, leaf: str, dim: int, t: int, done: dict[tuple[int, int], nn.Parameter]) -> None:
    """Replace parameter `leaf` of `module` by its first 1/t along `dim` (rank 0's shard); a weight tied between
    modules stays one parameter (`done`, by id and dim)."""
    p = getattr(module, leaf, None)
    if not isinstance(p, nn.Parameter):
        return
    key = (id(p), dim)
    if key not in done:
        done[key] = nn.Parameter(p.detach().narrow(dim, 0, p.shape[dim] // t).clone(), requires_grad=p.requires_grad)
    setattr(module, leaf, done[key])


def _gather_output(t: int, _module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
    """colwise_gather_output's local output made full width (the all-gather's result, from rank 0's shard)."""
    return out.repeat(*([1] * (out.dim() - 1)), t)


def _local_ids(rows: int, _module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Token ids mapped into the local vocabulary shard (the lookup of torch's masked vocabulary-parallel one)."""
    return (args[0].remainder(rows), *args[1:])


def narrow_planned(model: nn.Module, resolved: Mapping[str, str], t: int, styles: Iterable[str] | None = None,
                   hooks: bool = True) -> nn.Module:
    """Narrow (in place; returned) the weights of the planned modules whose style is in `styles` (default: all) to
    TP rank 0's shard at degree `t`: colwise weights (and biases) keep their first out_features/t rows, rowwise
    weights their first in_features/t columns (the bias stays whole, added once), embeddings their first
    num_embeddings/t rows. With `hooks`, colwise_gather_output gives its output back at full width and an embedding
    looks up ids modulo its rows (`local_shard`); without, only shapes change (the runner's export at local shapes,
    autopp.run.parallel.local_shapes). TpPlanError when `t` does not divide a narrowed dimension."""
    if t == 1:
        return model
    wanted = set(_SHARDED if styles is None else styles)
    done: dict[tuple[int, int], nn.Parameter] = {}
    for name, style in resolved.items():
        if style not in wanted:
            continue
        module = model.get_submodule(name)
        dim, attr = _SHARDED[style]
        size = int(getattr(module, attr))
        if size % t:
            raise TpPlanError(f"tp {t} does not divide {name}.{attr} ({size})")
        _narrow(module, "weight", dim, t, done)
        if style != "rowwise":
            _narrow(module, "bias", 0, t, done)
        setattr(module, attr, size // t)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None \
                and module.padding_idx >= module.num_embeddings:
            module.padding_idx = None
        if hooks and style == "colwise_gather_output":
            module.register_forward_hook(partial(_gather_output, t))
        elif hooks and style == "embedding_rowwise":
            module.register_forward_pre_hook(partial(_local_ids, getattr(module, attr)))
    return model


def local_shard(model: nn.Module, resolved: dict[str, str], t: int) -> nn.Module:
    """Make `model` (in place; returned) compute what TP rank 0 computes at degree `t`, without the collectives
    (`narrow_planned` with every style and its hooks): colwise_gather_output gives its output back at full width
    (its shard repeated), an embedding looks up ids modulo its kept rows, an HF model's head counts kept as module
    attributes are divided (autopp.model.hf_plans.divide_heads). Parameters on meta stay on meta (nothing is
    materialized). TpPlanError when `t` does not divide a sharded dimension."""
    check_degree(model, resolved, t)
    found = _hf_model(model)
    if found is not None:
        divide_heads(found[1], t)
    return narrow_planned(model, resolved, t)


def local_shard_of(mf: ModelFile, resolved: Mapping[str, str], t: int, loss: LocalLoss) -> nn.Module:
    """`local_shard` of a model `mf` builds, telling `loss` the vocabulary rows of its `LOSS_PARALLEL` head."""
    model = local_shard(mf.build_model(), dict(resolved), t)
    heads = [n for n, s in resolved.items() if s == LOSS_PARALLEL]
    loss.rows = int(getattr(model.get_submodule(heads[0]), "out_features")) if heads else 0
    return model


def local_model_file(mf: ModelFile, resolved: dict[str, str], t: int) -> ModelFile:
    """`mf` whose build_model() gives TP rank 0's shard at degree `t` (`local_shard`): the units at sharded shapes."""
    loss = LocalLoss(mf.loss_fn)
    return replace(mf, build_model=partial(local_shard_of, mf, resolved, t, loss), loss_fn=loss,
                   shard=f"TP rank 0's shard at tp {t}, whose colwise outputs hold 1/{t} of their features: take "
                   "head counts from the tensor, e.g. reshape(b, s, -1, head_dim)")
