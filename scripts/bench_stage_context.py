"""Each pipeline stage of a split timed in context, as its rank runs it, against the profile's per-unit sums.

Issue 29, item 1. For a model's 2-rank 1F1B plans of scripts/bench_split_runtime.py (autopp's split, the even and
the parameter-balanced one; --model gpt by default, hf_llama or resnet), this cuts the model where each plan cuts it,
into the runner's own neighbour-only stage pieces (autopp.run.chain: `ChainPiece`, inputs from `example_io`), feeds
each stage its real input, and runs the stage's own actions in its rank's 1F1B order (the last stage with its loss
after each forward, as torch's schedules do), --rounds times after one warm-up round, timing each F and B on the
thread's CPU clock (time.thread_time: the time the code computed, without the time other processes held the core;
--wall: time.perf_counter, for a quiet machine). Each stage is timed in one or more --ways:

- `bare`: the piece called directly, as the profiler calls a unit (the default, and the only way before);
- `runtime`: the same piece driven by torch's pipelining runtime, a one-stage `PipelineStage` under
  `Schedule1F1B` in a one-rank gloo group, each `forward_one_chunk` (with the last stage's loss) and
  `backward_one_chunk` timed as autopp.run.instrument times them in a run, and inside them the piece's own forward,
  the loss and `torch.autograd.backward`: the rest is the runtime's bookkeeping per action (flattening, caches,
  the loss call, input-gradient collection), printed as its own column. A non-last stage has a sum of its outputs
  as its loss (outside its timed F), so its B computes with gradients of ones, as `bare` does;
- `cold`: `bare` with the caches evicted before each action (a buffer of twice the last-level cache rewritten, at
  most 256 MiB), as if another process had run in between;
- `idle`: `bare` with a sleep of --idle-ms before each action, as a rank waits for its neighbour.

It prints per split, stage and way the median F and B in context against the plan's (the profile's per-unit sums,
plus the profile's runtime cost per action when it has one; its resume cost after a wait is in the predicted step;
`--no-runtime-cost` plans without both, as before the profile carried them), and the step re-simulated with the
in-context times (the plan's links and schedule, no resume cost) next to the predicted step; then the gains over
autopp's split both ways. What is absent: the other rank's process (one
co-runner slowed gpt's head 5-7 % and a block not measurably on the CPU clock, docs/splits.md) and the messages.

    .venv/bin/python scripts/bench_stage_context.py                  # gpt, 3 splits, 10 rounds: ~1 min
    .venv/bin/python scripts/bench_stage_context.py --model resnet --ways bare runtime cold idle --profile P
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from autopp.data.plan import Plan
from autopp.data.profile import Profile, load_profile
from autopp.model.contract import ModelFile, load_model_file
from autopp.model.split import split_model
from autopp.run.chain import ChainPiece, chain_io, constant_values, example_io
from autopp.run.outputs import model_loss
from autopp.schedule import Kind, StageCost, build_schedule, simulate_named

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_split_runtime import MODELS, _profile, plans_for  # noqa: E402  (a sibling script: the plans it runs)

ROOT = Path(__file__).resolve().parents[1]
WAYS = ("bare", "runtime", "cold", "idle")
Clock = Callable[[], float]


@dataclass
class Timed:
    """One stage's timed actions in one way: per kind (F, B) the action times; for `runtime`, also the time of
    the piece's own compute inside each action."""

    action: dict[Kind, list[float]] = field(default_factory=lambda: {Kind.F: [], Kind.B: []})
    inner: dict[Kind, list[float]] = field(default_factory=lambda: {Kind.F: [], Kind.B: []})

    def median(self, kind: Kind, skip: int) -> float:
        return statistics.median(self.action[kind][skip:])

    def bookkeeping(self, kind: Kind, skip: int) -> float:
        """Median over actions of action time - its compute (0 when the compute was not timed)."""
        if not self.inner[kind]:
            return 0.0
        return statistics.median(a - i for a, i in zip(self.action[kind][skip:], self.inner[kind][skip:]))


@dataclass
class Stages:
    """A plan's stages as the runner builds them: the chain pieces, each one's real input, the loss, the target."""

    pieces: list[ChainPiece]
    feeds: list[tuple[Any, ...]]
    loss: Callable[[Any, Any], torch.Tensor]
    target: Any


def build(mf: ModelFile, plan: Plan, names: list[str]) -> Stages:
    """The plan's stage pieces (autopp.run.pipeline's `_chain_stages`, without torch's stage around them), each
    fed the real output of the stages before it on the plan's microbatch."""
    inputs, target = mf.sample_batch(plan.microbatch_size, seed=0)
    model = mf.build(0)
    pipe = split_model(model, tuple(inputs), [names[a] for a, _ in (s.units for s in plan.stages[1:])])
    io, sources = chain_io(pipe)
    consts = constant_values(pipe, sorted({c for s in io for c in s.constants}), tuple(inputs))
    n = len(plan.stages)
    pieces = [ChainPiece(pipe.get_stage_module(i), i, io[i], sources, {c: consts[c] for c in io[i].constants},
                         last=i == n - 1, activation=plan.stages[i].activation, units=plan.stages[i].unit_names)
              for i in range(n)]
    shapes = example_io(pieces, tuple(inputs))
    return Stages(pieces, [received for received, _ in shapes], model_loss(mf.loss_fn, model, tuple(inputs), pipe),
                  target)


def _leaves(values: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in values)


def _outputs_and_ones(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outs = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor) and t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


def _evictor() -> Callable[[], None]:
    """Rewrites a buffer of twice the largest cache (sysfs; 32 MiB if unknown), at most 256 MiB (a VM may report its
    host's whole last-level cache: 480 MiB on the development machine)."""
    sizes = [32 << 20]
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            sizes.append(int(text[:-1]) << {"K": 10, "M": 20}[text[-1]])
        except (OSError, ValueError, KeyError):
            continue
    buffer = torch.zeros(min(2 * max(sizes[1:] or sizes), 256 << 20) // 4)

    def evict() -> None:
        buffer.add_(1.0)
    return evict


def bare_times(st: Stages, s: int, order: list[Any], rounds: int, clock: Clock, before: Callable[[], None]) -> Timed:
    """Stage `s`'s actions in `order`, the piece called directly, `before()` untimed ahead of each action."""
    piece, last, timed = st.pieces[s], s == len(st.pieces) - 1, Timed()
    for _ in range(rounds + 1):
        pending: dict[int, Any] = {}
        for action in order:
            before()
            t0 = clock()
            if action.kind is Kind.F:
                y = piece(*_leaves(st.feeds[s]))
                pending[action.microbatch] = st.loss(y, st.target) if last else y
            else:
                y = pending.pop(action.microbatch)
                if last:
                    y.backward()
                else:
                    torch.autograd.backward(*_outputs_and_ones(y))
            timed.action[action.kind].append(clock() - t0)
        piece.zero_grad(set_to_none=True)
    return timed


def runtime_times(st: Stages, s: int, m: int, rounds: int, clock: Clock) -> Timed:
    """Stage `s` under torch's runtime (the module docstring's `runtime`), `rounds` + 1 steps of `m` microbatches;
    needs a process group of one rank."""
    piece, last, timed = st.pieces[s], s == len(st.pieces) - 1, Timed()
    out = piece(*_leaves(st.feeds[s]))
    stage = PipelineStage(piece, 0, 1, torch.device("cpu"), input_args=_leaves(st.feeds[s]),
                          output_args=tuple(t.detach() for t in (out if isinstance(out, tuple) else (out,))))
    inner = {Kind.F: 0.0, Kind.B: 0.0}

    def count(kind: Kind, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                inner[kind] += clock() - t0
        return counted

    def action(kind: Kind, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            inner[kind], t0 = 0.0, clock()
            try:
                return fn(*args, **kwargs)
            finally:
                timed.action[kind].append(clock() - t0)
                timed.inner[kind].append(inner[kind])
        return run

    def loss(output: Any, target: Any) -> torch.Tensor:
        if not last:  # outside the timed F: a non-last stage has no loss in a run
            return sum((t.sum() for t in _outputs_and_ones(output)[0]), torch.zeros(()))
        t0 = clock()
        try:
            return st.loss(output, target)
        finally:  # the runner counts the loss in the F it follows (StepRecorder.timed_loss)
            timed.action[Kind.F][-1] += clock() - t0
            timed.inner[Kind.F][-1] += clock() - t0

    grads = tuple(isinstance(x, torch.Tensor) and x.requires_grad for x in st.feeds[s])
    forward_one_chunk = stage.forward_one_chunk

    def received(chunk: int, args: tuple[Any, ...], *rest: Any, **kwargs: Any) -> Any:
        """The microbatch as leaves that need a gradient where the stage's input does, as torch's receiving stage
        makes them (`_retrieve_recv_activations`), so that its backward computes and collects input gradients."""
        leaves = tuple(x.detach().requires_grad_(g) if isinstance(x, torch.Tensor) else x for x, g in zip(args, grads))
        return forward_one_chunk(chunk, leaves, *rest, **kwargs)

    piece.forward = count(Kind.F, piece.forward)  # type: ignore[method-assign]
    stage.forward_one_chunk = action(Kind.F, received)  # type: ignore[method-assign]
    stage.backward_one_chunk = action(Kind.B, stage.backward_one_chunk)  # type: ignore[method-assign]
    schedule = Schedule1F1B(stage, m, loss_fn=loss)
    args = tuple(torch.cat([x] * m).detach() for x in st.feeds[s])
    target = torch.cat([st.target] * m) if last else torch.zeros(m)
    original = torch.autograd.backward
    torch.autograd.backward = count(Kind.B, original)  # type: ignore[assignment]
    try:
        for _ in range(rounds + 1):
            schedule.step(*args, target=target, losses=[], return_outputs=False)
            piece.zero_grad(set_to_none=True)
    finally:
        torch.autograd.backward = original
        del piece.forward
    return timed


def stage_times(st: Stages, plan: Plan, way: str, rounds: int, clock: Clock, idle_s: float) -> list[Timed]:
    """Every stage of `plan` timed in context in `way` (WAYS)."""
    order = build_schedule(plan.schedule, len(st.pieces), plan.num_microbatches)
    if way == "runtime":
        return [runtime_times(st, s, plan.num_microbatches, rounds, clock) for s in range(len(st.pieces))]
    before: Callable[[], None] = {"bare": lambda: None, "cold": _evictor(),
                                  "idle": lambda: time.sleep(idle_s)}[way]
    return [bare_times(st, s, order[s], rounds, clock, before) for s in range(len(st.pieces))]


def resimulated(plan: Plan, times: list[tuple[float, float]]) -> float:
    """The plan's step simulated with `times` as its stages' F and B (I = W = B / 2), with its links and optimizer."""
    costs = [StageCost(forward_s=f, backward_input_s=b / 2, backward_weight_s=b / 2, overhead_s=s.overhead_s)
             for (f, b), s in zip(times, plan.stages)]
    sim = simulate_named(plan.schedule, plan.layout.pp, plan.num_microbatches, costs,
                         [s.send_s for s in plan.stages[:-1]], plan.layout.v,
                         progress_s=[s.progress_s for s in plan.stages[:-1]])
    return sim.step_time_s + plan.predicted.optimizer_s


def without_runtime_cost(profile: Profile) -> Profile:
    """`profile` without the runtime's time per action and the resume cost (as profiles were before they carried
    them)."""
    meta = dataclasses.replace(profile.meta, runtime_forward_s=0.0, runtime_backward_s=0.0, resume_s=0.0)
    return dataclasses.replace(profile, meta=meta)


def _load(model: str, directory: str | None) -> Profile:
    """The profile in `directory` (profiled now and saved there when it has none), else bench_split_runtime's."""
    if directory is None:
        return _profile(model, False)
    if not (Path(directory) / "meta.json").is_file():
        _profile(model, True).save(directory)
    return load_profile(directory)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt")
    ap.add_argument("--profile", help="profile directory (profiled now and saved there when missing); default: "
                                      "profiles/<model> when shipped, else profiled now")
    ap.add_argument("--ways", nargs="+", choices=WAYS, default=["bare"])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--idle-ms", type=float, default=5.0, help="sleep before each action of the `idle` way")
    ap.add_argument("--no-runtime-cost", action="store_true", help="plan without the profile's runtime cost")
    ap.add_argument("--wall", action="store_true", help="time on the wall clock (time.perf_counter)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    clock = time.perf_counter if args.wall else time.thread_time
    profile = _load(args.model, args.profile)
    if args.no_runtime_cost:
        profile = without_runtime_cost(profile)
    mf = load_model_file(ROOT / MODELS[args.model])
    names = [str(n) for n in profile.units.drop_duplicates("unit").sort_values("unit").name]
    plans = plans_for(profile, 2, 8, 1 << 30)
    own_group = "runtime" in args.ways and not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _report(args, profile, mf, names, plans, clock)
    finally:
        if own_group:
            dist.destroy_process_group()
    return 0


def _report(args: argparse.Namespace, profile: Profile, mf: ModelFile, names: list[str], plans: dict[str, Plan],
            clock: Clock) -> None:
    """Time every plan's stages in every way and print the table and the gains (the module docstring)."""
    print(f"{args.model}, 2 ranks, {args.rounds} rounds, {'wall' if args.wall else 'CPU'} clock, load average "
          f"{os.getloadavg()[0]:.2f}; the plans' runtime cost per action (autopp.measure.runtime) F "
          f"{1e3 * profile.meta.runtime_forward_s:.3f} ms, B {1e3 * profile.meta.runtime_backward_s:.3f} ms (in the "
          f"plan's F and B), resume {1e3 * profile.meta.resume_s:.3f} ms (in the predicted step, after waits)")
    print("| split | stage | units | way | F in context / plan ms | B in context / plan ms | F+B ratio | "
          "bookkeeping F / B ms | step predicted | step re-simulated in context |\n|---|---|---|---|---|---|---|---|"
          "---|---|")
    steps: dict[tuple[str, str], tuple[float, float]] = {}
    for name, plan in plans.items():
        st = build(mf, plan, names)
        m = plan.num_microbatches
        for way in args.ways:
            timed = stage_times(st, plan, way, args.rounds, clock, 1e-3 * args.idle_ms)
            times = [(t.median(Kind.F, m), t.median(Kind.B, m)) for t in timed]  # round 0: warm-up
            steps[(name, way)] = (plan.predicted.step_time_s, resimulated(plan, times))
            for (f, b), t, s in zip(times, timed, plan.stages):
                keep = f"{1e3 * t.bookkeeping(Kind.F, m):.3f} / {1e3 * t.bookkeeping(Kind.B, m):.3f}" \
                    if t.inner[Kind.F] else "-"
                print(f"| {name} | {s.index} | {s.units[0]}-{s.units[1] - 1} | {way} | {1e3 * f:.3f} / "
                      f"{1e3 * s.forward_s:.3f} | {1e3 * b:.3f} / {1e3 * s.backward_s:.3f} | "
                      f"{(f + b) / (s.forward_s + s.backward_s):.2f} | {keep} | {1e3 * steps[(name, way)][0]:.2f} | "
                      f"{1e3 * steps[(name, way)][1]:.2f} |")
    for way in args.ways:
        ours = steps[("autopp", way)]
        for name in list(plans)[1:]:
            print(f"{way}: gain over {name}: predicted {100 * (steps[(name, way)][0] / ours[0] - 1):+.1f} %, in "
                  f"context {100 * (steps[(name, way)][1] / ours[1] - 1):+.1f} %")


if __name__ == "__main__":
    sys.exit(main())
