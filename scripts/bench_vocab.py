"""Measured step time of vocabulary parallelism against the best split without it, on 2 CPU ranks, with the
simulator's predicted gain beside it.

examples/gpt_big_vocab.py (examples/gpt.py's GPT with a vocabulary of 32768 = 256 x the width 128 and two blocks: the
head, the last unit with ln_f, is several blocks of work), 1F1B, --microbatches microbatches of --microbatch-size,
profiled first at that size (one thread; or --profile DIR, a profile of the same model). On examples/gpt.py itself
(head about 4 x a block, six blocks) the best plain split of 2 ranks is already balanced and the simulator predicts
no gain. The plain
layout: every single split point of the model (the head on rank 1), each measured; the best measured is the
baseline ("the best split without it"). Vocabulary parallelism: the body split autopp.solve.search.vocab chooses,
the embedding and head split over both ranks (autopp.run.vocab). The runs are INTERLEAVED: round r runs every layout
in an order rotated by r, for --rounds rounds; each run starts 2 processes (one thread each), takes --steps steps
and keeps the median of the steps after the first. Prints per layout the median over rounds, the rounds' min-max,
and the measured and predicted gain of vocabulary parallelism over the best plain split.

    .venv/bin/python scripts/bench_vocab.py                          # 5 rounds of 6 steps
    .venv/bin/python scripts/bench_vocab.py --rounds 2 --steps 3     # a quick look

Ratios are comparable within one invocation only (the machine's load changes between invocations).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopp.costmodel import unit_arrays
from autopp.data.cluster import DEFAULT_LINK, Cluster
from autopp.data.profile import load_profile
from autopp.measure.options import ProfileOptions
from autopp.measure.profiler import profile_model
from autopp.model.contract import load_model_file
from autopp.run.vocab_step import VocabJob, body_stages, build_vocab_rank
from autopp.schedule import ScheduleName
from autopp.solve.search.vocab import choose_vocab
from autopp.spawn import spawn_local

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "examples" / "gpt_big_vocab.py")
VOCAB = "vocab"


def _plain_step(job: VocabJob, rank: int) -> Any:
    """A closure running one step of the plain split (embedding and head on their stages)."""
    mf = load_model_file(job.model_path)
    model = mf.build(job.seed)
    inputs, target = mf.sample_batch(job.num_microbatches * job.microbatch_size, job.seed)
    example = tuple(t[:job.microbatch_size] for t in inputs)
    stages = body_stages(model, example, job.split_points, [0, 1], rank, None)
    schedule = torch.distributed.pipelining.schedules.Schedule1F1B(stages[0], job.num_microbatches,
                                                                   loss_fn=mf.loss_fn)

    def step() -> None:
        stages[0].submod.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(*inputs)
        else:
            schedule.step(target=target)
    return step


def _worker(rank: int, world: int, port: int, layout: str, job: VocabJob, steps: int, queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
        if layout == VOCAB:
            built = build_vocab_rank(job, rank)

            def step() -> None:
                built.zero_grad()
                built.step()
        else:
            step = _plain_step(job, rank)
        times = []
        for _ in range(steps):
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            times.append(time.perf_counter() - start)
        dist.destroy_process_group()
        queue.put((rank, statistics.median(times[1:]), None))
    except Exception as exc:  # noqa: BLE001 - one line to the parent
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--profile", help="a profile of examples/gpt_big_vocab.py (default: measure one now)")
    args = ap.parse_args(argv)
    profile = load_profile(args.profile) if args.profile else profile_model(
        MODEL, ProfileOptions(microbatch_sizes=(args.microbatch_size,)))
    a = unit_arrays(profile, args.microbatch_size)
    names = profile.meta.unit_names
    choice = choose_vocab(a, Cluster(num_devices=2, memory_bytes=2**40, link=DEFAULT_LINK), 2, args.microbatches,
                          args.microbatch_size)
    vocab_opt = min((o for o in choice.options if o.variant is not None), key=lambda o: o.verdict.step_s)
    body_point = names[vocab_opt.verdict.candidate.bounds[1][0]]
    m, b = args.microbatches, args.microbatch_size
    jobs = {f"plain @{p}": VocabJob(MODEL, (p,), ScheduleName.ONE_F_ONE_B, 2, m, b) for p in names[1:]}
    jobs[VOCAB] = VocabJob(MODEL, (body_point,), ScheduleName.ONE_F_ONE_B, 2, m, b)
    order = list(jobs)
    measured: dict[str, list[float]] = {k: [] for k in order}
    for r in range(args.rounds):
        for layout in order[r % len(order):] + order[:r % len(order)]:
            out = spawn_local(_worker, 2, (layout, jobs[layout], args.steps), args.timeout, f"running {layout}")
            measured[layout].append(max(out.values()))
    med = {k: statistics.median(v) for k, v in measured.items()}
    best_plain = min((k for k in order if k != VOCAB), key=lambda k: med[k])
    print(f"examples/gpt_big_vocab.py, 2 ranks, 1F1B, {m} microbatches of {b}; "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"{'layout':<16}{'median s':>10}{'min-max s':>20}")
    for k in order:
        print(f"{k:<16}{med[k]:>10.4f}{min(measured[k]):>10.4f}-{max(measured[k]):.4f}")
    gain = med[best_plain] / med[VOCAB] - 1
    predicted = choice.without.verdict.step_s / vocab_opt.verdict.step_s - 1
    plain_at = names[choice.without.verdict.candidate.bounds[1][0]]
    print(f"vocabulary parallelism ({vocab_opt.variant.value if vocab_opt.variant else '-'}, body split at "
          f"{body_point}) vs best measured plain split ({best_plain}): measured gain {100 * gain:+.1f} %, "
          f"predicted {100 * predicted:+.1f} % (against the predicted best plain split at {plain_at}; chosen: "
          f"{choice.chosen.variant.value if choice.chosen.variant else 'plain'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
