"""Cut a model into consecutive pieces at module boundaries with torch.distributed.pipelining.pipeline (torch.export),
and read the split graph: which values are live across each cut, which of them could be recomputed, tied weights."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import operator
import re
import warnings
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import fx, nn
from torch.distributed.pipelining import Pipe, SplitPoint, pipeline
from torch.export.unflatten import InterpreterModule, _disable_interpreter
from torch.utils import _pytree as pytree

from ..errors import ModelFileError
from ..data.profile_values import LiveValue, TiedGroup, ValueAction
from .fake import grouped_mm_on_fake

log = logging.getLogger(__name__)

__all__ = ["split_model", "piece_names", "walk_split_graph", "LiveValue", "live_values", "source_piece", "TiedGroup",
           "tied_groups", "output_spec", "rebuild_output", "model_output"]


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Keep what torch.export prints on failure (the partial graph on stderr, symbolic-shape warnings) off the
    user's terminal: the error raised says what went wrong in one line."""
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes.level
    shapes.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        shapes.setLevel(level)


def _export_error(exc: BaseException, split_points: Sequence[str]) -> ModelFileError:
    """One line: the innermost cause's first line, where in the user's code it arose, and what to do."""
    inner = exc
    while inner.__cause__ is not None:
        inner = inner.__cause__
    text = str(inner).strip()
    first = text.splitlines()[0] if text else type(inner).__name__
    calls = [m for m in re.finditer(r'File "([^"]+)", line (\d+)[^\n]*\n\s*(\S[^\n]*)', text)
             if "site-packages" not in m.group(1)]
    where = f" at {calls[-1].group(1)}:{calls[-1].group(2)} (`{calls[-1].group(3).strip()}`)" if calls else ""
    return ModelFileError(f"torch.export could not trace forward() to split it at {list(split_points)}{where}: "
                          f"{type(inner).__name__}: {first}; make forward() exportable (no Python branch on a "
                          "tensor's value: use torch.where or torch.cond; see https://pytorch.org/docs/stable/"
                          "export.html)")


def split_model(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], split_points: Sequence[str]) -> Pipe:
    """A Pipe with one piece per gap between `split_points`; the model is deep-copied (pipeline() patches it).

    The pieces' submodules (torch.export's `InterpreterModule`, which restore the model's module hierarchy) run
    their generated code instead of `torch.fx.Interpreter`: the interpreter costs Python time per node on every
    call (examples/gpt.py, half the model at microbatch 2: 8.0 ms forward with it, 3.5 ms without). Where the
    generated code fails on the example inputs (torch 2.13 on transformers' BERT: "'Tensor' object has no attribute
    'output'", a submodule named `output`), the pieces run through the interpreter, and the log says so."""
    spec = {name: SplitPoint.BEGINNING for name in split_points}
    try:
        with warnings.catch_warnings(), _disable_interpreter(), _quiet_export(), grouped_mm_on_fake():
            warnings.simplefilter("ignore")
            pipe = pipeline(copy.deepcopy(model), mb_args=example_inputs, split_spec=spec)
    except Exception as exc:
        raise _export_error(exc, split_points) from exc
    if pipe.num_stages != len(split_points) + 1:
        raise ModelFileError(f"splitting at {len(split_points)} points gave {pipe.num_stages} pieces, "
                             f"expected {len(split_points) + 1}; a split point may be called inside a loop or not at "
                             "all")
    _unview_outputs(pipe.split_gm)
    buffers = [(b, b.detach().clone()) for b in pipe.split_gm.buffers()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            for _ in walk_split_graph(pipe.split_gm, example_inputs, {}):
                pass
    except Exception as exc:  # noqa: BLE001 - any failure of the generated code: the interpreter is the reference
        log.info("the split pieces run through torch.fx.Interpreter (their generated code failed: %s: %s)",
                 type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        for m in pipe.split_gm.modules():
            if isinstance(m, InterpreterModule):
                m._run_with_interpreter = True
    with torch.no_grad():  # the walk must not move BatchNorm statistics (nor, above, the random state)
        for b, saved in buffers:
            b.copy_(saved)
    return pipe


def _own_storage(value: Any) -> Any:
    """`value`, copied to a contiguous tensor of its own when it is a view of another tensor (T5's position bias is
    an `unsqueeze`) or not contiguous: torch's `stage_backward_input` detaches every stage output in place, which a
    view refuses ("Can't detach views in-place"), and gloo sends only contiguous tensors ("input tensor has to be
    contiguous")."""
    if isinstance(value, torch.Tensor) and (value._is_view() or not value.is_contiguous()):
        return value.clone(memory_format=torch.contiguous_format)
    return value


def _unview_outputs(gm: fx.GraphModule) -> None:
    """Make every piece return tensors that own their storage (see `_own_storage`); other outputs are untouched."""
    for node in gm.graph.nodes:
        piece = gm.get_submodule(str(node.target)) if node.op == "call_module" else None
        if not isinstance(piece, fx.GraphModule):
            continue
        out = next(n for n in piece.graph.nodes if n.op == "output")
        with piece.graph.inserting_before(out):
            out.args = fx.node.map_arg(out.args, partial(_wrap, piece.graph))
        piece.recompile()


def _wrap(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """`_own_storage(node)`, keeping the node's metadata (torch's PipelineStage reads the outputs' `meta["val"]`)."""
    new = graph.call_function(_own_storage, (node,))
    new.meta = dict(node.meta)
    return new


def piece_names(pipe: Pipe) -> list[str]:
    """Names of the pieces' call_module nodes in the split graph, in execution order."""
    return [node.target for node in pipe.split_gm.graph.nodes if node.op == "call_module"]  # type: ignore[misc]


def walk_split_graph(gm: fx.GraphModule, inputs: Sequence[Any], env: dict[fx.Node, Any],
                     call: Callable[[fx.Node, tuple[Any, ...]], Any] | None = None) -> Iterator[fx.Node]:
    """Evaluate the split graph on `inputs` node by node into `env`, yielding each evaluated node (placeholders,
    getitems, pieces). `call(node, args)` evaluates a piece (default: calling the piece)."""
    values = iter(inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(values)
        elif node.op == "call_function":
            env[node] = node.target(*fx.node.map_arg(node.args, lambda a: env[a]))  # type: ignore[operator]
        elif node.op == "call_module":
            args = fx.node.map_arg(node.args, lambda a: env[a])
            env[node] = call(node, args) if call else gm.get_submodule(str(node.target))(*args)
        else:
            continue
        yield node


def source_piece(node: fx.Node, piece_index: dict[str, int]) -> int | None:
    """The piece (or -1 for a model input) that produced `node` in the split graph, following getitem."""
    while node.op == "call_function":
        node = node.args[0]  # type: ignore[assignment]
    if node.op == "placeholder":
        return -1
    return piece_index.get(str(node.target))


def live_values(pipe: Pipe) -> list[LiveValue]:
    """Every value a piece reads from another piece or from the model inputs, once each, in graph order (pieces as
    units; `bytes` left empty). RECOMPUTE: the producer computes it from constants and buffers only (no parameter,
    no input, no activation: causal masks and rotary tables of a fixed shape), so any stage can compute it locally;
    else RELAY when pieces between the producer and the last reader must pass it on, else SEND. `needs_grad`: it is
    computed from a parameter (the model inputs need no gradient); `reads`: the values that its producer computes it
    from, within the producing piece."""
    gm = pipe.split_gm
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    piece_index = {str(n.target): i for i, n in enumerate(calls)}
    readers: dict[fx.Node, list[int]] = {}
    for i, node in enumerate(calls):
        for arg in node.all_input_nodes:
            readers.setdefault(arg, []).append(i)
    out = []
    memo: _Memo = {}
    local_memo: _Memo = {}
    for value, dsts in readers.items():
        src = source_piece(value, piece_index)
        if src is None:
            continue
        everything = _origins(_Scope(gm), value, (), memo, local=False)
        local = _origins(_Scope(gm), value, (), local_memo, local=True) if src >= 0 else frozenset()
        readers_of = tuple(sorted(set(dsts)))
        relayed = tuple(range(src + 1, max(readers_of)))
        action = (ValueAction.RECOMPUTE if src >= 0 and not everything
                  else ValueAction.RELAY if relayed else ValueAction.SEND)
        out.append(LiveValue(name=value.name, src=src, dsts=readers_of, action=action, relayed_over=relayed,
                             needs_grad=_PARAMETER in everything,
                             reads=tuple(sorted(o[len(_VALUE):] for o in local if o.startswith(_VALUE)))))
    return out


@dataclass(frozen=True)
class _Scope:
    """A graph being read, and where it was called from (to map its placeholders back to the caller's arguments)."""

    module: nn.Module
    call: fx.Node | None = None
    parent: _Scope | None = None


_PARAMETER, _INPUT, _VALUE = "parameter", "model input", "value:"
"""What a value of the split graph is computed from, besides constants and buffers (`_VALUE` + a name: a value
another piece or the model input passes to the producing piece)."""

_Memo = dict[tuple[_Scope, fx.Node, tuple[int, ...]], frozenset[str]]


def _origins(scope: _Scope, node: fx.Node, path: tuple[int, ...], memo: _Memo, local: bool) -> frozenset[str]:
    """What `node` (item `path` of it) is computed from, descending into submodules: parameters, model inputs
    (empty: constants and buffers only); with `local`, a piece's arguments are not followed into the pieces that
    made them but named (`_VALUE` + name). Memoised: a block reads its input many times."""
    key = (scope, node, path)
    if key not in memo:
        memo[key] = _walk_origins(scope, node, path, memo, local)
    return memo[key]


def _walk_origins(scope: _Scope, node: fx.Node, path: tuple[int, ...], memo: _Memo, local: bool) -> frozenset[str]:
    if node.op == "placeholder":
        if scope.call is None or scope.parent is None:
            return frozenset({_INPUT})
        graph: fx.Graph = scope.module.graph  # type: ignore[assignment]
        position = [n for n in graph.nodes if n.op == "placeholder"].index(node)
        outer = scope.call.args[position] if position < len(scope.call.args) else None
        if not isinstance(outer, fx.Node):
            return frozenset()
        if local and scope.parent.parent is None:  # an argument of a piece of the split graph
            return frozenset({_VALUE + outer.name})
        return _origins(scope.parent, outer, path, memo, local)
    if node.op == "get_attr":
        return frozenset({_PARAMETER}) if str(node.target) in dict(scope.module.named_parameters()) else frozenset()
    if node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[1], int):
        return _origins(scope, node.args[0], (node.args[1],) + path, memo, local)  # type: ignore[arg-type]
    found: frozenset[str] = frozenset()
    if node.op == "call_module":
        sub = scope.module.get_submodule(str(node.target))
        sub_graph = getattr(sub, "graph", None)
        if isinstance(sub_graph, fx.Graph):
            result: Any = next(n for n in sub_graph.nodes if n.op == "output").args[0]
            for index in path:
                if not isinstance(result, (tuple, list)):
                    break
                result = result[index]
            inner = [n for n in pytree.tree_leaves(result) if isinstance(n, fx.Node)]
            return frozenset().union(*(_origins(_Scope(sub, node, scope), n, (), memo, local) for n in inner))
        if any(True for _ in sub.parameters()):
            found = frozenset({_PARAMETER})
    return found.union(*(_origins(scope, a, (), memo, local) for a in node.all_input_nodes))


def tied_groups(model: nn.Module, unit_modules: Sequence[Sequence[str]]) -> list[TiedGroup]:
    """Groups of parameter names sharing one tensor, with the units that use each group."""
    by_tensor: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    groups = []
    for key, names in by_tensor.items():
        if len(names) < 2:
            continue
        units = sorted({u for n in names for u, mods in enumerate(unit_modules)
                        if any(n == m or n.startswith(m + ".") for m in mods)})
        t = tensors[key]
        groups.append(TiedGroup(names=tuple(names), units=tuple(units), bytes=t.numel() * t.element_size()))
    return groups


def output_spec(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> pytree.TreeSpec:
    """The pytree structure of the model's output (e.g. a transformers ModelOutput), to rebuild it from the last
    piece, which returns only the tensors."""
    with torch.no_grad():
        return pytree.tree_flatten(model(*inputs))[1]


def rebuild_output(spec: pytree.TreeSpec, piece_output: Any) -> Any:
    """The last piece's output in the model's own structure, so that the user's loss_fn sees what forward returns."""
    leaves = pytree.tree_leaves(piece_output)
    if spec.num_leaves != len(leaves) or spec.num_leaves == 1 and spec.is_leaf():
        return leaves[0] if spec.is_leaf() and len(leaves) == 1 else piece_output
    return pytree.tree_unflatten(leaves, spec)


def model_output(gm: fx.GraphModule, env: dict[fx.Node, Any], last: fx.Node, out: Any) -> Any:
    """The split graph's output with `out` as the last piece's value: an encoder-decoder model also returns the
    encoder's output (T5's `encoder_last_hidden_state`), which an earlier piece made, so the last piece alone does
    not hold every tensor of the model's output."""
    def value(node: fx.Node) -> Any:
        if node is last:
            return out
        if node.op == "call_function":
            return node.target(*fx.node.map_arg(node.args, value))  # type: ignore[operator]
        return env[node]
    result = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return fx.node.map_arg(result, value)
