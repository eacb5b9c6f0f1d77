"""Expert parallelism on a rank's pipeline stages: each rank of an ep group holds E / ep of every mixture-of-experts
layer's experts (the stacked expert weights sharded along the expert dimension, a DTensor `Shard(0)` over the ep
mesh), and the token-expert pairs travel to the experts' owners and back by two all-to-alls with variable split
sizes, the split sizes exchanged first; the router, top-k and the dense and shared parts stay as they are,
replicated.

The pattern is torchtitan's `ExpertParallel` (torchtitan/distributed/expert_parallel.py: a `ParallelStyle` whose
`distribute_module` shards the experts' weights along dimension 0 and whose input/output functions dispatch and
combine with `all_to_all_single` after exchanging the tokens per expert), Megatron-Core's all-to-all token
dispatcher (megatron/core/transformer/moe/token_dispatcher.py, `MoEAlltoAllTokenDispatcher`) and DeepSeek-V3's
expert parallelism (DeepSeek-AI, arXiv:2412.19437, section 3.2). The experts module is Hugging Face transformers 5's
(`MixtralExperts`, `Qwen3MoeExperts`, ...: `forward(hidden_states, top_k_index, top_k_weights)` over stacked
`gate_up_proj` / `down_proj`, run by `grouped_mm_experts_forward` or its loop): the style wraps its forward and
runs the model's own expert computation on the received rows, one expert per row and weight 1, with the module's
expert count set to the local one; the routing weights are applied after the combine. The ep groups are carved
from the mesh's "dp" dimension (torchtitan's ep over dp_shard; ep fastest, Megatron's "tp-cp-ep-dp-pp" order):
with ep = dp it is the whole dimension, with ep < dp it is split (dp / ep, ep) by `DeviceMesh._unflatten`
(`ep_meshes`). The expert weights' gradients are summed over the dp / ep ranks holding the same experts and scaled
by 1 / dp, the dense gradients' average (`average_expert_grads`; nothing to sum with ep = dp). With ZeRO 3 at pp 1
(FSDP2 without a pipeline) the experts are `fully_shard`-ed over those dp / ep ranks instead, their gradients
reduce-scattered over them and divided by dp, as torchtitan's `apply_fsdp` shards its MoE models' experts over
dp_shard_mod_ep (`shard_experts`; not sharded further with ep = dp), the dense units over dp as before.

Expert tensor parallelism (`Layout.etp`, autopp.data.axes; Megatron-Core's `--expert-tensor-parallel-size` and its
all-to-all dispatcher's all-gather / reduce-scatter over the expert-TP group, MoE Parallel Folding, arXiv:2504.14960):
the "dp" dimension is split (dp / (ep x etp), ep, etp), etp fastest, and each experts module is sharded over the
(ep, etp) mesh: along the experts by ep, and by etp gate/up column-wise (each of the two halves of `gate_up_proj`
split, `_StridedShard(1, split_factor=2)`, so that a rank's local rows are its gate and up columns, which the model's
`chunk(2)` separates) and down row-wise (`Shard(2)`). After the ep dispatch, the rows of the etp group are
all-gathered over it (an all-to-all of the rows repeated etp times, the split sizes exchanged first, since the
groups' ranks receive different counts), the model's own expert computation runs on them with the rank's shards,
and the partial outputs go back to their ranks and are summed (a reduce-scatter, as an all-to-all and a sum), both
through torch's autograd-aware `all_to_all_single_autograd`. The gradients of an expert shard are then summed over
the dp / (ep x etp) ranks holding the same shard (ZeRO 3 beside etp is not run: autopp does not plan it).
"""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ..data.layout import Layout
from ..errors import RunError
from ..data.runner_rules import expert_refusal
from ..model.experts import is_experts

__all__ = ["ExpertParallel", "check_expert_parallel", "ep_meshes", "parallelize_experts", "shard_experts",
           "expert_params", "average_expert_grads"]

logger = logging.getLogger(__name__)


@contextmanager
def _local_weights(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters replaced by their local shards (differentiably: `to_local`'s backward gives
    the DTensor its gradient) while the model's own forward runs, which mixes them with plain tensors."""
    held = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    try:
        for n, p in held.items():
            module._parameters[n] = p.to_local()  # type: ignore[union-attr, assignment]
        yield
    finally:
        module._parameters.update(held)  # type: ignore[arg-type]


#: With etp, how each stacked weight of an experts module is split beyond its experts (module docstring).
_ETP_PLACEMENTS: dict[str, Placement] = {"gate_up_proj": _StridedShard(1, split_factor=2), "down_proj": Shard(2)}


def _check_etp(module: nn.Module, experts: int, etp: int) -> None:
    """Refuse an experts module whose weights the etp split does not fit: a RunError of one line."""
    stacked = {n: p.shape for n, p in module.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == experts}
    if set(stacked) != set(_ETP_PLACEMENTS) or getattr(module, "is_transposed", False) \
            or getattr(module, "has_bias", False) or stacked["down_proj"][2] % etp:
        held = ", ".join(f"{n} {tuple(s)}" for n, s in stacked.items())
        raise RunError(f"etp({etp}) shards gate_up_proj (E, 2 x I, H) and down_proj (E, H, I) with I divisible by "
                       f"etp, and {type(module).__name__} holds {held}; re-plan with `--etp 1`")


class ExpertParallel(ParallelStyle):
    """Shard a stacked-experts module over a one-dimensional ep mesh, or a two-dimensional (ep, etp) one, and route
    its token-expert pairs to the owners by all-to-all (torchtitan's `ExpertParallel`; Megatron-Core's
    `MoEAlltoAllTokenDispatcher`), with etp gathering the rows over the etp ranks (module docstring)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        etp = device_mesh["etp"].size() if device_mesh.ndim == 2 else 1
        experts, ep = int(getattr(module, "num_experts")), device_mesh.size() // etp
        if experts % ep:
            raise RunError(f"ep({ep}) does not divide the {experts} experts of {type(module).__name__}: plan an ep "
                           "that divides the experts")
        if etp > 1:
            _check_etp(module, experts, etp)

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):  # stacked: dim 0 the expert
                if param.dim() >= 1 and param.shape[0] == experts:
                    placements = [Shard(0), _ETP_PLACEMENTS[pname]] if etp > 1 else [Shard(0)]
                    mod.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, placements)))

        distribute_module(module, device_mesh, partition)
        original = module.forward
        module.num_experts = experts // ep  # type: ignore[assignment]  # what the model's forward sees
        module.forward = _EpForward(module, original, device_mesh, experts)  # type: ignore[method-assign]
        return module


class _EpForward:
    """The experts module's forward under expert parallelism: dispatch, the local experts, combine."""

    def __init__(self, module: nn.Module, original: Callable[..., torch.Tensor], mesh: DeviceMesh,
                 experts: int) -> None:
        ep_mesh = mesh["ep"] if mesh.ndim == 2 else mesh
        self.module, self.original, self.group, self.experts = module, original, ep_mesh.get_group(), experts
        self.ep = ep_mesh.size()
        self.etp = mesh["etp"].size() if mesh.ndim == 2 else 1
        self.etp_group = (mesh["etp"] if mesh.ndim == 2 else ep_mesh).get_group()  # used only with etp > 1

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        local = self.experts // self.ep
        # 1. sort the token-expert pairs by expert: rank r's experts r * local ... are then one contiguous block
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = hidden[order // top_k]
        sent = torch.bincount(flat, minlength=self.experts)
        # 2. exchange the counts (each rank learns how many rows of each of its experts every rank sends), then the
        # rows, with those split sizes (torchtitan: `all_to_all_single` of num_tokens_per_expert first)
        received = wait_tensor(all_to_all_single(sent, None, None, group=self.group))
        splits_in = sent.view(self.ep, local).sum(1).tolist()
        splits_out = received.view(self.ep, local).sum(1).tolist()
        rows = all_to_all_single_autograd(rows, splits_out, splits_in, group=self.group)
        # 3. the model's own expert computation on the received rows: one local expert per row, weight 1
        ids = torch.arange(local, device=flat.device).repeat(self.ep).repeat_interleave(received)
        mine = rows.shape[0]
        if self.etp > 1:  # the etp group's rows, for the rank's columns of gate/up and rows of down
            counts = self._counts(mine)
            rows = all_to_all_single_autograd(rows.repeat(self.etp, 1), counts, [mine] * self.etp,
                                              group=self.etp_group)
            ids = wait_tensor(all_to_all_single(ids.repeat(self.etp), counts, [mine] * self.etp, group=self.etp_group))
        with _local_weights(self.module):
            out = self.original(rows, ids.unsqueeze(1), torch.ones(ids.shape + (1,), dtype=hidden.dtype,
                                                                   device=hidden.device), *args, **kwargs)
        if self.etp > 1:  # each rank's rows' partial outputs back to it, summed: a reduce-scatter
            out = all_to_all_single_autograd(out, [mine] * self.etp, counts, group=self.etp_group)
            out = out.view(self.etp, mine, -1).sum(0)
        # 4. combine: back to the senders, unsorted, weighted by the router and summed over the top-k
        out = all_to_all_single_autograd(out, splits_in, splits_out, group=self.group)
        unsorted = torch.empty_like(order)
        unsorted[order] = torch.arange(order.numel(), device=order.device)
        out = out[unsorted].view(tokens, top_k, -1) * top_k_weights.unsqueeze(-1).to(out.dtype)
        return out.sum(1).to(hidden.dtype)

    def _counts(self, rows: int) -> list[int]:
        """The rows each rank of the etp group holds after the dispatch (this rank's `rows` sent to every one)."""
        mine = torch.full((self.etp,), rows, dtype=torch.int64)
        counts: list[int] = wait_tensor(all_to_all_single(mine, None, None, group=self.etp_group)).tolist()
        return counts


def check_expert_parallel(layout: Layout) -> None:
    """Refuse the layouts the runner cannot run expert-parallel (`expert_refusal`, torch-free), in one line."""
    if why := expert_refusal(layout):
        raise RunError(why)


@functools.lru_cache(maxsize=8)
def ep_meshes(mesh: DeviceMesh, layout: Layout) -> tuple[DeviceMesh, DeviceMesh | None]:
    """This rank's expert mesh, its ep ranks (one dimension) or with etp its (ep, etp) ranks, and the dp / (ep x etp)
    ranks holding the same expert shards (None when ep x etp is the whole "dp" dimension), from the world mesh: its
    "dp" dimension split (dp / ep, ep), ep fastest, or (dp / (ep x etp), ep, etp), etp fastest (Megatron-Core's
    expert order, etp where tp is). Cached: the split creates process groups, once per mesh (every rank asks in the
    same order)."""
    dp, ep, etp = mesh["dp"].size(), layout.ep, layout.etp
    if ep == dp:
        return mesh["dp"], None
    split = mesh._unflatten("dp", (dp // (ep * etp), ep, etp), ("ep_replica", "ep", "etp"))
    return split["ep", "etp"] if etp > 1 else split["ep"], split["ep_replica"] if dp > ep * etp else None


def parallelize_experts(piece: nn.Module, mesh: DeviceMesh, full_model: nn.Module, device: torch.device) -> int:
    """Put `full_model`'s stacked-experts modules (`is_experts`) in place of the piece's exported ones (torch.export
    InterpreterModules, whose graphs have the token count baked in; the parent calls them with the model's own
    arguments, as autopp.run.tensor_parallel's `restore_planned` relies on), then apply `ExpertParallel` over `mesh`
    (the ep ranks) to each; how many."""
    held = dict(piece.named_modules())
    names = [n for n, m in full_model.named_modules() if n in held and is_experts(m)]
    for name in names:
        parent, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        module = full_model.get_submodule(name).to(device)
        setattr(piece.get_submodule(parent) if parent else piece, leaf, module)
        parallelize_module(module, mesh, ExpertParallel())
    if names:
        etp = mesh["etp"].size() if mesh.ndim == 2 else 1
        logger.info("expert parallelism over %d ranks%s on %d experts modules", mesh.size() // etp,
                    f" x expert tensor parallelism over {etp}" if etp > 1 else "", len(names))
    return len(names)


def shard_experts(piece: nn.Module, layout: Layout, replicas: DeviceMesh | None) -> set[nn.Parameter]:
    """ZeRO 3 at pp 1 beside ep (`Layout.fsdp`), as torchtitan's `apply_fsdp` runs its MoE models: each of the
    piece's expert-parallel modules `fully_shard`-ed over the `replicas` holding the same experts (its
    dp_shard_mod_ep; `ep_meshes`), its gradients divided by dp as the dense ones are averaged
    (`set_gradient_divide_factor`); with ep = dp (`replicas` None) they are not sharded further (torchtitan wraps
    them over its one-rank dp_shard_mod_ep for mixed precision, as autopp.costmodel.fsdp counts; this runner has no
    MixedPrecisionPolicy, its weights are their own master, so that would only add a copy). The expert weights
    the dense units' FSDP2 must leave alone (`fully_shard`'s `ignored_params`); none without ZeRO 3 at pp 1."""
    if not layout.fsdp:
        return set()
    modules = [m for m in piece.modules() if isinstance(m.forward, _EpForward)]
    if replicas is None:
        return {p for m in modules for p in m.parameters(recurse=False)}
    for module in modules:
        sharded = fully_shard(module, mesh=replicas, reshard_after_forward=True)
        sharded.set_gradient_divide_factor(float(layout.dp))
        if replicas.device_type == "cpu":  # gloo has no PREMUL_SUM: a sum, then the division
            sharded.set_force_sum_reduction_for_comms(True)
    if modules:
        logger.info("ZeRO 3 of %d experts modules over the %d ranks holding the same experts", len(modules),
                    replicas.size())
    return set()


def expert_params(pieces: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The expert weights `ExpertParallel` sharded in `pieces`, each once."""
    found = {id(p): p for piece in pieces for m in piece.modules() if isinstance(m.forward, _EpForward)
             for p in m.parameters(recurse=False)}
    return list(found.values())


def average_expert_grads(params: Sequence[torch.Tensor], layout: Layout, replicas: DeviceMesh | None) -> None:
    """Make the expert weights' gradients the full batch's: each rank's shard already sums its ep group's tokens
    routed to it (the combine's backward brings them back); summed over the `replicas` holding the same experts
    (`ep_meshes`; None: ep = dp, nothing to sum), it is divided by dp, as the dense gradients are averaged over dp."""
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in params) if g is not None]
    if not grads or layout.dp == 1 or layout.fsdp and replicas is not None:  # FSDP2 reduced them (`shard_experts`)
        return
    if replicas is not None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=replicas.get_group())
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    for g in grads:
        g.div_(layout.dp)
