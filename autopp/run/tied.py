"""Parameters held by several stages (tied weights such as GPT-2's token embedding and LM head, or a module called
from two stages): their gradients are summed across the ranks that hold a copy, as Megatron does for the embedding
and the head.

`pipeline()` gives every piece that uses a parameter a copy of it, and may leave a piece a second, unused copy under
the tied name (HF GPT-2 split in two: stage 0 holds `transformer.wte.weight`, used, and `lm_head.weight`, unused);
each copy's gradient is one share of the whole (or none). Summing them, on the rank and then across the ranks
holding copies (an all-reduce per replica), gives every copy the full gradient, so the copies stay equal after
identical optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..data.layout import Coords, Layout

__all__ = ["aliases", "canonical_names", "shared_params", "TieGroup", "tie_groups", "sum_tied_grads"]


def aliases(model: nn.Module) -> dict[str, str]:
    """Every parameter name of the model (tied ones under each of their names) -> the name `named_parameters()`
    lists it under (the first)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def canonical_names(names: Sequence[str], alias: Mapping[str, str]) -> list[str]:
    """`names` under their canonical names (unknown names are kept, for the coverage check to report)."""
    return [alias.get(n, n) for n in names]


def shared_params(stage_params: Mapping[int, Sequence[str]], owner: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """Canonical parameter name -> the pipeline ranks holding a copy, for parameters held on more than one rank.

    `stage_params` maps every stage to its parameters' canonical names; `owner[s]` is stage s's pipeline rank."""
    ranks: dict[str, set[int]] = {}
    for stage, names in stage_params.items():
        for name in names:
            ranks.setdefault(name, set()).add(owner[stage])
    return {name: tuple(sorted(r)) for name, r in sorted(ranks.items()) if len(r) > 1}


@dataclass
class TieGroup:
    """Parameters whose copies sit on the same pipeline ranks, and this rank's process group over them."""

    names: tuple[str, ...]
    pp_ranks: tuple[int, ...]
    group: dist.ProcessGroup | None
    """This replica's group of those ranks (None on a rank that holds no copy)."""


def tie_groups(shared: Mapping[str, tuple[int, ...]], layout: Layout, replica: int, pp_rank: int
               ) -> list[TieGroup]:
    """One group per set of pipeline ranks holding copies, per replica. Every rank must call this with the same
    `shared` (it creates process groups, collectively, in the same order everywhere)."""
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name, ranks in sorted(shared.items()):
        by_ranks.setdefault(ranks, []).append(name)
    groups = []
    for ranks, names in sorted(by_ranks.items()):
        mine = None
        for r in range(layout.dp):
            g = dist.new_group([layout.rank(Coords(pp=i, dp=r)) for i in ranks])
            mine = g if r == replica and pp_rank in ranks else mine
        groups.append(TieGroup(tuple(names), ranks, mine))
    return groups


def sum_tied_grads(groups: Sequence[TieGroup], params: Mapping[str, Sequence[nn.Parameter]]) -> None:
    """Give every copy of a shared parameter the sum of all copies' gradients: first over this rank's copies, then
    over the ranks holding copies (one flat all-reduce per group). `params` maps canonical names to this rank's
    distinct tensors under that name; a copy that received no gradient contributes zeros."""
    in_groups = {n for tie in groups if tie.group is not None for n in tie.names}
    totals = {name: _local_sum(ps) for name, ps in params.items() if len(ps) > 1 or name in in_groups}
    for tie in groups:
        if tie.group is None:
            continue
        flat = torch.cat([totals[n].reshape(-1) for n in tie.names])
        dist.all_reduce(flat, group=tie.group)
        offset = 0
        for n in tie.names:
            totals[n] = flat[offset:offset + totals[n].numel()].view_as(totals[n])
            offset += totals[n].numel()
    for name, total in totals.items():
        for i, p in enumerate(params[name]):
            p.grad = total if i == 0 else total.clone()


def _local_sum(copies: Sequence[nn.Parameter]) -> torch.Tensor:
    grads = [p.grad for p in copies if p.grad is not None]
    if not grads:
        return torch.zeros_like(copies[0])
    total = grads[0].clone()
    for g in grads[1:]:
        total += g
    return total
