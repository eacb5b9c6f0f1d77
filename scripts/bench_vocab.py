"""Measured step time of vocabulary parallelism against the best split without it, on 2 CPU ranks, with the
simulator's prediction of every layout beside it.

examples/gpt_big_vocab.py (examples/gpt.py's GPT with a vocabulary of 32768 = 256 x the width 128 and two blocks: the
head, the last unit with ln_f, is several blocks of work), 1F1B, --microbatches microbatches of --microbatch-size,
profiled first at that size (one thread; or --profile DIR, a profile of the same model). On examples/gpt.py itself
(head about 4 x a block, six blocks) the best plain split of 2 ranks is already balanced and the simulator predicts
no gain. The plain layouts: every single split point of the model (the head on rank 1), each measured; the best
measured is the baseline ("the best split without it"). Vocabulary parallelism: the body split
autopp.solve.search.vocab chooses, the embedding and head split over both ranks (autopp.run.vocab).

The runs are INTERLEAVED: round r runs every layout in an order rotated by r, for --rounds rounds; each run starts 2
processes (one thread each), takes --steps steps and keeps the median of the steps after the first. Progress and an
ETA go to stderr. The table: per layout the median over rounds, the rounds' min-max and spread, the simulator's
prediction (the pipeline's step, no optimizer step: the benchmark takes none) and measured / predicted; then the
measured and predicted gain of vocabulary parallelism over the best plain split (both from this run's predictions)
and their gap in points. Where the step goes, per microbatch on each rank (medians over rounds, timed inside the
runs by wrapping the torch stages' forward_one_chunk / backward_one_chunk, the loss and the vocabulary passes)
against the cost model's figures. The 1-minute load average is printed before and after: figures taken above 1 per
core are marked LOADED (a claim needs a quiet machine).

    .venv/bin/python scripts/bench_vocab.py                          # 5 rounds of 6 steps (~5 min on a quiet machine)
    .venv/bin/python scripts/bench_vocab.py --rounds 2 --steps 3     # a quick look

Ratios are comparable within one invocation only (the machine's load changes between invocations).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from autopp.costmodel import unit_arrays
from autopp.data.cluster import DEFAULT_LINK, Cluster
from autopp.data.layout import Layout
from autopp.data.profile import load_profile
from autopp.data.vocab import vocab_tied
from autopp.measure.options import ProfileOptions
from autopp.measure.profiler import profile_model
from autopp.model.contract import load_model_file
from autopp.run.vocab_step import VocabJob, body_stages, build_vocab_rank
from autopp.schedule import Activation, ScheduleName
from autopp.solve.search.judge import Candidate, Verdict, judge
from autopp.solve.search.vocab import choose_vocab
from autopp.spawn import spawn_local

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "gpt_big_vocab.py")
VOCAB = "vocab"


class Clock:
    """Seconds spent inside wrapped callables of this rank, by name (nested calls count in both)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def timed(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - start
        return run

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        setattr(obj, attr, self.timed(getattr(obj, attr), name))


def _watch_stages(stages: list[Any], clock: Clock) -> None:
    for s in stages:
        clock.wrap(s, "forward_one_chunk", f"F{s.stage_index}")
        clock.wrap(s, "backward_one_chunk", f"B{s.stage_index}")


def _plain_step(job: VocabJob, rank: int, clock: Clock) -> Callable[[], None]:
    """A closure running one step of the plain split (embedding and head on their stages)."""
    mf = load_model_file(job.model_path)
    model = mf.build(job.seed)
    inputs, target = mf.sample_batch(job.num_microbatches * job.microbatch_size, job.seed)
    example = tuple(t[:job.microbatch_size] for t in inputs)
    stages = body_stages(model, example, job.split_points, [0, 1], rank, None)
    _watch_stages(stages, clock)
    schedule = torch.distributed.pipelining.schedules.Schedule1F1B(
        stages[0], job.num_microbatches, loss_fn=clock.timed(mf.loss_fn, "loss F"))

    def step() -> None:
        stages[0].submod.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(*inputs)
        else:
            schedule.step(target=target)
    return step


def _vocab_step(job: VocabJob, rank: int, clock: Clock) -> Callable[[], None]:
    built = build_vocab_rank(job, rank)
    _watch_stages(built.stages, clock)
    for attr, name in (("begin", "input pass"), ("_output_pass", "output pass"), ("finish", "input backward")):
        clock.wrap(built.runtime, attr, name)
    for attr in ("broadcast", "all_gather", "reduce"):  # the passes' collectives, waits for the other rank included
        clock.wrap(dist, attr, "collectives (waits included)")

    def step() -> None:
        built.zero_grad()
        built.step()
    return step


def _worker(rank: int, world: int, port: int, layout: str, job: VocabJob, steps: int, queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=600))
        clock = Clock()
        step = (_vocab_step if layout == VOCAB else _plain_step)(job, rank, clock)
        times = []
        for k in range(steps):
            if k == 1:  # the first step warms up: its times are not kept
                clock.spent.clear()
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            times.append(time.perf_counter() - start)
        dist.destroy_process_group()
        per_mb = {n: s / (steps - 1) / job.num_microbatches for n, s in clock.spent.items()}
        queue.put((rank, (statistics.median(times[1:]), per_mb), None))
    except Exception as exc:  # noqa: BLE001 - one line to the parent
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))


def _candidate(bounds: tuple[tuple[int, int], ...], m: int, b: int) -> Candidate:
    return Candidate(schedule=ScheduleName.ONE_F_ONE_B, layout=Layout(pp=2), microbatches=m, microbatch_size=b,
                     bounds=bounds, activations=(Activation.KEEP,) * 2)


def _load() -> str:
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return f"load {load:.1f} on {cores} cores" + (" (LOADED)" if load > cores else "")


def _fmt_eta(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


def _measure(jobs: dict[str, VocabJob], rounds: int, steps: int, timeout: float
             ) -> tuple[dict[str, list[float]], dict[str, dict[str, list[float]]]]:
    """Every layout `rounds` times, interleaved; per layout the step times and, per rank:timer, per-microbatch
    seconds, one value per round."""
    order = list(jobs)
    measured: dict[str, list[float]] = {k: [] for k in order}
    timers: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in order}
    total, done, start = rounds * len(order), 0, time.monotonic()
    for r in range(rounds):
        for layout in order[r % len(order):] + order[:r % len(order)]:
            out = spawn_local(_worker, 2, (layout, jobs[layout], steps), timeout, f"running {layout}")
            measured[layout].append(max(step for step, _ in out.values()))
            for rank, (_, per_mb) in out.items():
                for name, s in per_mb.items():
                    timers[layout][f"rank {rank}: {name}"].append(s)
            done += 1
            elapsed = time.monotonic() - start
            print(f"[{done}/{total}] round {r + 1} {layout}: {measured[layout][-1]:.4f} s/step; elapsed "
                  f"{_fmt_eta(elapsed)}, ETA {_fmt_eta(elapsed / done * (total - done))}; {_load()}",
                  file=sys.stderr, flush=True)
    return measured, timers


def _predicted_timers(v: Verdict, vocab: bool) -> dict[str, float]:
    """The cost model's per-microbatch figures of the timers the runs report."""
    out = {}
    for s, c in enumerate(v.costs):
        passes = v.passes if vocab and v.passes is not None else None
        f = c.forward_s - (passes.input_s if passes else 0.0)
        back = c.backward_s if c.backward_s is not None else c.backward_input_s + c.backward_weight_s
        out[f"rank {s}: F{s}"] = f
        out[f"rank {s}: B{s}"] = back - (passes.output_s if passes and s < len(v.costs) - 1 else 0.0)
    if vocab and v.passes is not None:
        for r in range(len(v.costs)):
            out[f"rank {r}: output pass"] = v.passes.output_s
            out[f"rank {r}: input pass + input backward"] = v.passes.input_s
            out[f"rank {r}: collectives (waits included)"] = v.passes.comm_s
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--profile", help="a profile of examples/gpt_big_vocab.py (default: measure one now)")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step is not kept)")
    print(f"start: {_load()}", file=sys.stderr, flush=True)
    profile = load_profile(args.profile) if args.profile else profile_model(
        MODEL, ProfileOptions(microbatch_sizes=(args.microbatch_size,)))
    a = unit_arrays(profile, args.microbatch_size)
    names, m, b = profile.meta.unit_names, args.microbatches, args.microbatch_size
    cluster = Cluster(num_devices=2, memory_bytes=2**40, link=DEFAULT_LINK)
    choice = choose_vocab(a, cluster, 2, m, b, tied=vocab_tied(profile.meta.extra))
    vocab_opt = min((o for o in choice.options if o.variant is not None), key=lambda o: o.verdict.step_s)
    body_point = names[vocab_opt.verdict.candidate.bounds[1][0]]
    jobs = {f"plain @{p}": VocabJob(MODEL, (p,), ScheduleName.ONE_F_ONE_B, 2, m, b) for p in names[1:]}
    jobs[VOCAB] = VocabJob(MODEL, (body_point,), ScheduleName.ONE_F_ONE_B, 2, m, b)
    verdicts = {f"plain @{p}": judge(a, cluster, _candidate(((0, k), (k, a.n)), m, b))
                for k, p in enumerate(names[1:], start=1)}
    verdicts[VOCAB] = vocab_opt.verdict
    predicted = {k: v.pipeline_s for k, v in verdicts.items()}
    measured, timers = _measure(jobs, args.rounds, args.steps, args.timeout)
    _report(args, measured, timers, predicted, verdicts, body_point, vocab_opt.variant.value if vocab_opt.variant
            else "-")
    return 0


def _report(args: argparse.Namespace, measured: dict[str, list[float]], timers: dict[str, dict[str, list[float]]],
            predicted: dict[str, float], verdicts: dict[str, Verdict], body_point: str, variant: str) -> None:
    med = {k: statistics.median(v) for k, v in measured.items()}
    plains = [k for k in measured if k != VOCAB]
    best_plain = min(plains, key=lambda k: med[k])
    best_predicted = min(plains, key=lambda k: predicted[k])
    print(f"examples/gpt_big_vocab.py, 2 ranks, 1F1B, {args.microbatches} microbatches of {args.microbatch_size}; "
          f"{args.rounds} rounds x {args.steps} steps; end: {_load()}")
    print(f"| layout | median s | min-max s | spread % | predicted s | measured / predicted |")
    print("|---|---|---|---|---|---|")
    for k in measured:
        lo, hi = min(measured[k]), max(measured[k])
        print(f"| {k} | {med[k]:.4f} | {lo:.4f}-{hi:.4f} | {100 * (hi - lo) / med[k]:.0f} | {predicted[k]:.4f} | "
              f"{med[k] / predicted[k]:.2f} |")
    gain = med[best_plain] / med[VOCAB] - 1
    pred_gain = predicted[best_predicted] / predicted[VOCAB] - 1
    print(f"vocabulary parallelism ({variant}, body split at {body_point}) vs the best measured plain split "
          f"({best_plain}): measured gain {100 * gain:+.1f} %; predicted {100 * pred_gain:+.1f} % (against the best "
          f"predicted plain split, {best_predicted}); gap {100 * (gain - pred_gain):+.1f} points")
    print("\nper microbatch, ms (median over rounds; F and B: the torch stage's forward_one_chunk / "
          "backward_one_chunk, the output pass inside the last stage's B; loss F: the plain head's loss; the "
          "passes' times include their collectives, and these the waits for the other rank)")
    print("| layout | timer | measured ms | predicted ms |")
    print("|---|---|---|---|")
    for k in (best_plain, VOCAB):
        pred = _predicted_timers(verdicts[k], k == VOCAB)
        got = {n: statistics.median(v) for n, v in sorted(timers[k].items())}
        if k == VOCAB:
            for r in (0, 1):
                got[f"rank {r}: input pass + input backward"] = got.pop(f"rank {r}: input pass", 0.0) + \
                    got.pop(f"rank {r}: input backward", 0.0)
        for n in sorted(set(got) | set(pred)):
            p = f"{1e3 * pred[n]:.2f}" if n in pred else "-"
            print(f"| {k} | {n} | {1e3 * got[n]:.2f} | {p} |" if n in got else f"| {k} | {n} | - | {p} |")


if __name__ == "__main__":
    sys.exit(main())
