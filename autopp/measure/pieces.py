"""Measure every unit of a model at one microbatch size: split it, run the pieces once to size their parameters,
activations, outputs and boundary edges, then time them (autopp.measure.timing)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import fx, nn

from ..model.contract import ModelFile
from ..model.split import (LiveValue, live_values, output_spec, rebuild_output, source_piece, split_model,
                           tied_groups, walk_split_graph)
from ..model.units import Unit
from .memory import peak_bytes, saved_bytes, static_bytes, storage_bytes, tensors_in
from .settings import Settings, progress_bar
from .timing import Budget, Piece, summarize, time_pieces

__all__ = ["measure_pieces"]


def measure_pieces(mf: ModelFile, model: nn.Module, units: list[Unit], b: int, settings: Settings
                   ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[LiveValue], dict[str, int]]:
    """Unit rows, edge rows, live values and their bytes (by split-graph name) at microbatch size `b`."""
    inputs, target = settings.batch(mf, b)
    pipe = split_model(model, inputs, [u.split_point for u in units[1:] if u.split_point is not None])
    spec = output_spec(model, inputs)
    gm = pipe.split_gm
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    piece_index = {str(n.target): i for i, n in enumerate(calls)}
    tied = {u: g.bytes for g in tied_groups(model, [u.modules for u in units]) for u in g.units if len(g.units) > 1}
    env: dict[fx.Node, Any] = {}
    rows: list[dict[str, Any]] = []
    pieces: list[Piece] = []
    edges: dict[tuple[int, int], int] = defaultdict(int)

    def measure(node: fx.Node, args: tuple[Any, ...]) -> Any:
        i = piece_index[str(node.target)]
        settings.progress(progress_bar(i, len(calls), f"microbatch {b}: sizes of unit {i + 1}/{len(calls)}"))
        for arg in node.all_input_nodes:
            src = source_piece(arg, piece_index)
            if src is not None:
                edges[(src, i)] += storage_bytes(tensors_in(env[arg]))
        module = gm.get_submodule(str(node.target))
        last = i == len(calls) - 1
        finish = (lambda out: mf.loss_fn(rebuild_output(spec, _model_output(gm, env, node, out)), target)) \
            if last else (lambda out: out)
        grad = tuple(not (isinstance(a, fx.Node) and source_piece(a, piece_index) == -1) for a in node.args)
        piece = Piece(module, args, finish, i == 0, grad)
        pieces.append(piece)
        row: dict[str, Any] = {"unit": i, "microbatch_size": b}
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        with torch.no_grad():
            out = module(*piece.args)
        row.update(static_bytes(module, settings.optimizer, settings.dtype))
        row.update(tied_param_bytes=tied.get(i, 0),
                   activation_bytes=saved_bytes(lambda: piece.forward()[1], params),
                   output_bytes=0 if last else storage_bytes(tensors_in(out)),
                   recompute_keep_bytes=storage_bytes(tensors_in(piece.args)))
        peak = peak_bytes(settings.clock.device, piece.forward_backward)
        if peak is not None:
            settings.peaks.setdefault(str(i), {})[str(b)] = peak
        rows.append(row)
        return out

    for _ in walk_split_graph(gm, inputs, env, measure):
        pass
    budget = settings.budget
    runs = budget.warmup + budget.repeats
    # The time budget is per unit; a run times every unit.
    per_run = Budget(budget.warmup, budget.repeats, None if budget.seconds is None else budget.seconds * len(pieces),
                      budget.now)
    samples = time_pieces(pieces, per_run, settings.clock, lambda r: settings.progress(
        progress_bar(r, runs, f"microbatch {b}: timing run {r + 1}/{runs} ({budget.warmup} warm-up)")))
    for row, piece_samples in zip(rows, samples):
        row.update(summarize(piece_samples))
    live = live_values(pipe)
    by_name = {n.name: n for n in gm.graph.nodes}
    value_bytes = {v.name: storage_bytes(tensors_in(env[by_name[v.name]])) for v in live}
    edge_rows = [{"src": s, "dst": d, "microbatch_size": b, "bytes": n} for (s, d), n in sorted(edges.items())]
    return rows, edge_rows, live, value_bytes


def _model_output(gm: fx.GraphModule, env: dict[fx.Node, Any], last: fx.Node, out: Any) -> Any:
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
