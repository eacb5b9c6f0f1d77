"""Mixture-of-experts layers as autopp sees them: the stacked-experts modules of a model (transformers 5's
`use_experts_implementation` classes: `MixtralExperts`, `Qwen2MoeExperts`, `Qwen3MoeExperts`, `DeepseekV3NaiveMoe`,
... with every expert's weights in one 3-d parameter, dimension 0 the expert, as torchtitan's `GroupedExperts` and
Megatron-Core's `TEGroupedMLP` hold them), the bytes of their weights per unit (what expert parallelism shards) and
the routing facts the exporters write (experts per layer, experts per token)."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["is_experts", "experts_modules", "expert_bytes", "moe_facts"]

#: Names of the stacked weights (one of the first two and the third in every stacked-experts module).
_UP, _DOWN = ("gate_up_proj", "up_proj"), "down_proj"


def is_experts(module: nn.Module) -> bool:
    """Whether `module` holds stacked experts: a 3-d `down_proj` and a 3-d `gate_up_proj` or `up_proj` parameter of
    as many experts (its own parameters; an exported InterpreterModule of one qualifies as the module does)."""
    own = module._parameters
    down = own.get(_DOWN)
    up = next((own[n] for n in _UP if own.get(n) is not None), None)
    return down is not None and up is not None and down.dim() == 3 and up.dim() == 3 and \
        down.shape[0] == up.shape[0]


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> stacked-experts module (`is_experts`) of `model`, in module order."""
    return {name: m for name, m in model.named_modules() if is_experts(m)}


def expert_bytes(module: nn.Module) -> dict[str, int]:
    """The profile's columns for `module` (a unit): `expert_param_bytes`, the bytes of its stacked-experts modules'
    parameters (part of its parameter bytes: what expert parallelism divides by ep), and `moe_layers`, how many such
    modules it has (each sends its tokens to the experts and back: two all-to-alls forward, two backward)."""
    found = experts_modules(module)
    return {"expert_param_bytes": sum(p.numel() * p.element_size() for m in found.values()
                                      for p in m.parameters(recurse=False)),
            "moe_layers": len(found)}


def moe_facts(model: nn.Module) -> dict[str, Any]:
    """The routing of a mixture of experts, as a profile's `meta.extra["moe"]` records it: `num_experts` (routed
    experts per layer: the HF config's `num_local_experts`, `num_experts` or `n_routed_experts`, else the stacked
    weights' first dimension), `top_k` (the config's `num_experts_per_tok`, else a router's `top_k`), and the
    group-limited routing (DeepSeek-V3, arXiv:2412.19437 s.2.1.2: the experts in `num_groups` equal groups, each
    token's top-k taken from its best `group_top_k` groups; the config's `n_group` and `topk_group`, as Megatron's
    `--moe-router-num-groups` / `--moe-router-group-topk`), both None where the routing is not group-limited (no such
    fields, or `topk_group` >= `n_group`); {} for a model without stacked experts."""
    found = experts_modules(model)
    if not found:
        return {}
    config = getattr(model, "config", None)
    experts = next((getattr(config, k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                    if isinstance(getattr(config, k, None), int)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if top_k is None:
        top_k = next((m.top_k for m in model.modules() if isinstance(getattr(m, "top_k", None), int)), None)
    stacked = next(iter(found.values())).get_parameter(_DOWN)
    groups, chosen = getattr(config, "n_group", None), getattr(config, "topk_group", None)
    limited = isinstance(groups, int) and isinstance(chosen, int) and 0 < chosen < groups
    return {"num_experts": int(experts if experts is not None else stacked.shape[0]),
            "top_k": None if not isinstance(top_k, int) else top_k,
            "num_groups": groups if limited else None, "group_top_k": chosen if limited else None}
