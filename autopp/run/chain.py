"""Neighbour-only stages for every schedule: values that skip stages are relayed through the stages between, and
values computed from constants and buffers only are held by every reader instead of being received.

torch's multi-stage schedules only support adjacent-stage communication, and its single-stage ones (GPipe, 1F1B)
refuse a value sent to several later stages ("Backward of skip connections not supported yet"), but a split of a
real model is rarely a chain: a causal mask or rotary table made before the blocks is read by every block, BERT's
extended attention mask too, a U-Net's encoder levels are read by its decoder levels, and T5's encoder output is
read by every decoder block. Each stage here wraps its piece of the split graph in a `ChainPiece` whose inputs are
everything stage s - 1 passes on and whose outputs are everything a later stage reads (its piece's own values and
the relayed ones), so torch's `PipelineStage` sees a chain.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx, nn
from torch.distributed.pipelining import Pipe
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..errors import RunError
from ..model.split import live_values, walk_split_graph
from ..data.profile_values import ValueAction
from ..schedule import Activation, policy

__all__ = ["Source", "StageIO", "chain_io", "value_path", "pick", "constant_values", "ChainPiece", "example_io",
           "buffers_kept", "weight_only_outputs", "selective_context", "unit_segments", "checkpoint_units"]


def _saves(ops: frozenset[str], _ctx: Any, func: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
    """Keep the output of an op in `ops` (`SAVED_OPS`, spelled "aten.mm"); recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if str(func.overloadpacket) in ops else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context(ops: frozenset[str]) -> Callable[[], Any]:
    """`checkpoint`'s `context_fn` for op-level selective recomputation keeping the outputs of `ops`: torch's
    `create_selective_checkpoint_contexts` with a policy function, as torchtitan applies it
    (torchtitan/distributed/activation_checkpoint.py)."""
    return functools.partial(create_selective_checkpoint_contexts, functools.partial(_saves, ops))


def _in_unit(node: fx.Node, unit: str) -> bool:
    """Whether `node` runs (part of) module `unit`: a call of it or of a module inside it, or an op that torch.export
    recorded inside it (`nn_module_stack`)."""
    paths = [node.target] if node.op == "call_module" else []
    paths += [v[0] for v in (node.meta.get("nn_module_stack") or {}).values()]
    return any(isinstance(p, str) and (p == unit or p.startswith(unit + ".")) for p in paths)


def unit_segments(gm: fx.GraphModule, units: Sequence[str]) -> list[list[fx.Node]]:
    """The piece's nodes (placeholders and output left out) in graph order, cut before the first node of each of
    `units` after the first (the stage's unit names: the modules a stage may begin at): each unit's part of the
    stage's forward. A unit whose module the piece never calls joins the unit before it."""
    starts, segments = list(units[1:]), [list[fx.Node]()]
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        found = next((k for k, u in enumerate(starts) if _in_unit(node, u)), None)
        if found is not None:
            del starts[:found + 1]
            if segments[-1]:
                segments.append([])
        segments[-1].append(node)
    return segments


def checkpoint_units(gm: fx.GraphModule, segments: Sequence[Sequence[fx.Node]], *args: Any,
                     ops: frozenset[str] = frozenset()) -> Any:
    """`gm`'s forward with each segment (`unit_segments`) under its own `torch.utils.checkpoint` (non-reentrant), as
    torchtitan's full activation checkpointing wraps each transformer block: the backward keeps each segment's
    inputs and reruns one segment's forward at a time. With `ops`, each checkpoint keeps their outputs too
    (`selective_context`), as torchtitan's op-level selective checkpointing wraps each block."""
    context: dict[str, Any] = {"context_fn": selective_context(ops)} if ops else {}
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    nodes = list(gm.graph.nodes)
    env: dict[fx.Node, Any] = dict(zip((n for n in nodes if n.op == "placeholder"), args))
    for seg in segments:
        members = set(seg)
        needed = list(dict.fromkeys(a for n in seg for a in n.all_input_nodes if a not in members))
        produced = [n for n in seg if any(u not in members for u in n.users)]

        def run(*values: Any, seg: Sequence[fx.Node] = seg, needed: list[fx.Node] = needed,
                produced: list[fx.Node] = produced) -> tuple[Any, ...]:
            interp.env = dict(zip(needed, values))
            for n in seg:
                interp.env[n] = interp.run_node(n)
            return tuple(interp.env[n] for n in produced)
        env.update(zip(produced, checkpoint(run, *(env[n] for n in needed), use_reentrant=False, **context)))
    return fx.node.map_arg(nodes[-1].args[0], lambda n: env[n])


@dataclass(frozen=True)
class Source:
    """Where a value of the split graph comes from: piece `piece` (-1: the model inputs), item `path` of its output
    (getitem indices, outermost first; for a model input, `path` is its position among the inputs)."""

    piece: int
    path: tuple[int, ...]


@dataclass(frozen=True)
class StageIO:
    """What one stage of the chain receives, computes with and passes on (value names of the split graph)."""

    inputs: tuple[str, ...]
    """Received from stage s - 1 (stage 0: the model inputs), in order."""
    args: tuple[tuple[str, Any], ...]
    """The piece's call arguments: ("value", name) or ("const", the literal)."""
    outputs: tuple[str, ...]
    """Passed on to stage s + 1 (empty for the last stage, which returns its piece's output)."""
    constants: tuple[str, ...]
    """Values it reads that depend on constants and buffers only: held locally, never received."""


def value_path(node: fx.Node, piece_index: dict[str, int], placeholders: Sequence[fx.Node]) -> Source:
    """The piece and getitem path of `node`; a RunError for a value made by anything but a piece or getitem."""
    path: list[int] = []
    while node.op == "call_function":
        if node.target is not operator.getitem or not isinstance(node.args[1], int):
            raise RunError(f"value {node.name!r} of the split graph is computed between stages ({node.target}), "
                           "which the runner cannot relay")
        path.insert(0, node.args[1])
        node = node.args[0]  # type: ignore[assignment]
    if node.op == "placeholder":
        return Source(-1, (list(placeholders).index(node),))
    if node.op == "call_module" and str(node.target) in piece_index:
        return Source(piece_index[str(node.target)], tuple(path))
    raise RunError(f"value {node.name!r} of the split graph does not come from a stage")


def pick(value: Any, path: Sequence[int]) -> Any:
    """Item `path` of a piece's output (a tensor for an empty path)."""
    for index in path:
        value = value[index]
    return value


def chain_io(pipe: Pipe) -> tuple[list[StageIO], dict[str, Source]]:
    """Per stage what it receives, passes on and holds locally, and where every named value comes from.

    A value made by stage i (or a model input, i = -1) and read by stages up to j is received by every stage
    i + 1 .. j and passed on by i .. j - 1, unless it depends on constants and buffers only (`recomputable`): then
    each reader holds it (`constant_values`). Stage 0 receives exactly the model inputs.
    """
    gm = pipe.split_gm
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    piece_index = {str(n.target): i for i, n in enumerate(calls)}
    live = {v.name: v for v in live_values(pipe)}
    by_name = {n.name: n for n in gm.graph.nodes}
    sources = {name: value_path(by_name[name], piece_index, placeholders) for name in live}
    carried = [name for name in live if live[name].action is not ValueAction.RECOMPUTE]
    io: list[StageIO] = []
    for s, call in enumerate(calls):
        inputs = tuple(p.name for p in placeholders) if s == 0 else io[-1].outputs
        outputs = () if s == len(calls) - 1 else tuple(
            n for n in carried if live[n].src <= s < max(live[n].dsts))
        args = tuple(("value", a.name) if isinstance(a, fx.Node) else ("const", a) for a in call.args)
        constants = tuple(n for kind, n in args if kind == "value" and n in live
                          and live[n].action is ValueAction.RECOMPUTE)
        io.append(StageIO(inputs, args, outputs, constants))
    return io, sources


def constant_values(pipe: Pipe, names: Sequence[str], example: Sequence[Any]) -> dict[str, torch.Tensor]:
    """The values `names` (recomputable: constants and buffers only), computed once by running the split graph's
    pieces on an example microbatch up to the last producer. torch.export fixed every shape to the microbatch's,
    so such a value is the same for every microbatch."""
    if not names:
        return {}
    gm = pipe.split_gm
    wanted, out = set(names), {}
    env: dict[fx.Node, Any] = {}
    with torch.no_grad(), buffers_kept(gm):
        for node in walk_split_graph(gm, example, env):
            if node.name in wanted:
                out[node.name] = env[node]
                if len(out) == len(wanted):
                    break
    return out


@contextlib.contextmanager
def buffers_kept(module: nn.Module) -> Iterator[None]:
    """Restore the module's buffers afterwards: an example forward must not move BatchNorm's running statistics."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def _on_cuda(args: list[Any]) -> bool:
    """Whether a stage's call runs on a CUDA device (a tensor argument there)."""
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)


class ChainPiece(nn.Module):
    """One stage of a neighbour-only chain: receives `io.inputs`, calls its piece, returns `io.outputs` (the last
    stage: its piece's output). Holds the piece's parameters, buffers and submodules under the piece's own names
    (the same dicts), so `named_parameters()` and gradients read as for the piece itself."""

    piece: nn.Module  # in __dict__, not a child (__init__)

    def __init__(self, piece: nn.Module, index: int, io: StageIO, sources: dict[str, Source],
                 constants: dict[str, torch.Tensor], last: bool, activation: Activation = Activation.KEEP,
                 units: Sequence[str] = ()) -> None:
        super().__init__()
        self._modules = piece._modules
        self._parameters = piece._parameters
        self._buffers = piece._buffers
        self.__dict__["piece"] = piece  # not a child: its contents are ours already
        self.index, self.io, self.sources, self.last = index, io, sources, last
        p = policy(activation)
        self.checkpointed = p.checkpoint
        """The stage's forward runs under `torch.utils.checkpoint` (its activation policy recomputes)."""
        self.saved_ops = p.saves_ops
        """Under that checkpoint, the ops whose outputs are kept (selective recomputation; empty: none)."""
        self.segments: list[list[fx.Node]] = []
        """Per-unit recomputation (selective too): the piece's nodes of each of its `units` (`unit_names`), each
        checkpointed on its own by the piece's forward (`checkpoint_units`, called through the piece so that its
        hooks still run)."""
        if p.per_unit and isinstance(piece, fx.GraphModule):
            self.segments = unit_segments(piece, units)
            piece.forward = functools.partial(  # type: ignore[method-assign]
                checkpoint_units, piece, self.segments, ops=p.saves_ops)
        self.to_host = p.to_host
        """The stage's forward runs under `torch.autograd.graph.save_on_cpu` (its activation policy offloads)."""
        self.constants = dict(constants)
        self.weight_only: tuple[int, ...] = ()
        """Outputs that depend on parameters only (set by `example_io`)."""

    def to_device(self, device: torch.device) -> ChainPiece:
        self.piece.to(device)
        self.constants = {k: v.to(device) for k, v in self.constants.items()}
        return self

    def forward(self, *received: Any) -> Any:
        if len(received) != len(self.io.inputs):
            raise RunError(f"stage {self.index} received {len(received)} values, expected {len(self.io.inputs)}")
        env = dict(zip(self.io.inputs, received))
        env.update(self.constants)
        args = [env[v] if kind == "value" else v for kind, v in self.io.args]
        if self.to_host:  # pinned host buffers only where there is a device to copy from (CUDA)
            with torch.autograd.graph.save_on_cpu(pin_memory=_on_cuda(args)):
                out = self.piece(*args)
        elif not self.checkpointed or self.segments:
            out = self.piece(*args)
        elif self.saved_ops:
            out = checkpoint(self.piece, *args, use_reentrant=False, context_fn=selective_context(self.saved_ops))
        else:
            out = checkpoint(self.piece, *args, use_reentrant=False)
        if self.last:
            return out
        return tuple(self._passed_on(name, env, out) for name in self.io.outputs)

    def _passed_on(self, name: str, env: dict[str, Any], out: Any) -> Any:
        src = self.sources[name]
        if src.piece == self.index:
            return pick(out, src.path)
        value = env[name]
        # A relayed tensor leaves as a copy of its own: torch detaches stage outputs in place after the backward,
        # which must not touch the received input (and an input tensor returned as an output has no grad_fn).
        return value.clone() if isinstance(value, torch.Tensor) else value


def example_io(pieces: Sequence[ChainPiece], example: Sequence[Any]
               ) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Every stage's inputs and outputs on an example microbatch (all pieces, in order), each received value a leaf
    that requires grad when its sender's output does, as when the schedule runs.

    Given to torch's PipelineStage as `input_args` / `output_args`, they spare it the runtime metadata inference,
    which runs a stage on uninitialised tensors made from the metadata: a model input relayed to a later stage (T5's
    decoder token ids, read after the encoder) then indexes an embedding with garbage ("index out of range")."""
    received = tuple(example)
    out = []
    for piece in pieces:
        with torch.enable_grad(), buffers_kept(piece):
            result = piece(*received)
        result = result if isinstance(result, tuple) else (result,)
        piece.weight_only = tuple(weight_only_outputs(received, result)) if piece.index > 0 else ()
        outputs = tuple(_leaf(t) for t in result)
        out.append((received, outputs))
        received = outputs
    return out


def weight_only_outputs(inputs: Sequence[Any], outputs: Sequence[Any]) -> list[int]:
    """Positions of the outputs that need a gradient but depend on no input that does, only on parameters (T5's
    relative-position bias, made by the first decoder block and read by the next stage)."""
    leaves = {id(t) for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad}
    return [i for i, t in enumerate(outputs) if isinstance(t, torch.Tensor) and t.grad_fn is not None
            and not _reaches(t.grad_fn, leaves)]


def _reaches(fn: Any, leaves: set[int]) -> bool:
    """Whether the autograd graph below `fn` accumulates into one of the tensors `leaves` (by id)."""
    seen, todo = set(), [fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if id(getattr(node, "variable", None)) in leaves:
            return True
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return False


def _leaf(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(value.requires_grad)
