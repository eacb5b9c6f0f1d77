"""The proof at size (issue 16): a model larger than this machine is profiled one unit at a time and planned for a
cluster of catalog devices, and the same model is profiled analytically without materializing anything.

Each step runs the `autopp` command in a fresh process under `/usr/bin/time -v`, which reports the process's peak
resident memory (the largest RSS the kernel saw) and the wall time; the table prints both with the command. Quoted in
docs/scale.md.

    .venv/bin/python scripts/bench_scale.py                      # Llama-3-8B: measured on CPU, analytic for H100
    .venv/bin/python scripts/bench_scale.py --config examples/configs/tiny-llama.json   # the same flow, small
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]


@dataclass(frozen=True)
class Result:
    step: Step
    wall_s: float
    peak_rss_bytes: int
    returncode: int
    tail: str


def _run(step: Step) -> Result:
    """Run `autopp ARGS` under /usr/bin/time -v; its peak RSS and wall time are read from time's report."""
    cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "autopp", *step.argv]
    print(f"$ autopp {shlex.join(step.argv)}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", proc.stderr)
    if rss is None or wall is None:
        raise SystemExit(f"could not read /usr/bin/time's report for {step.name}:\n{proc.stderr[-2000:]}")
    hours, minutes, seconds = wall.groups()
    wall_s = int(hours or 0) * 3600 + int(minutes) * 60 + float(seconds)
    tail = "\n".join((proc.stdout + proc.stderr.split("\tCommand being timed")[0]).strip().splitlines()[-6:])
    return Result(step, wall_s, int(rss.group(1)) * 1024, proc.returncode, tail)


def _steps(config: str, out: Path, args: argparse.Namespace) -> list[Step]:
    measured, analytic = out / "measured", out / "analytic"
    cluster = ["--device", args.device, "--nodes", str(args.nodes), "--devices-per-node", str(args.devices_per_node),
               "--global-batch", str(args.global_batch), "--schedule", "auto", "--dp", "auto"]
    steps = []
    if not args.skip_measured:
        steps += [Step("profile, measured on this CPU (one unit at a time)",
                       ["profile", "--hf-config", config, "--seq-len", str(args.cpu_seq_len), "--microbatch-size", "1",
                        "--optimizer", "adamw", "--repeats", "3", "--warmup", "1", "-o", str(measured)]),
                  Step(f"plan the CPU profile for {args.nodes} x {args.devices_per_node} {args.device}",
                       ["plan", "--profile", str(measured), *cluster, "-o", str(out / "measured.plan.json")])]
    steps += [Step(f"profile, analytic for {args.device} (nothing materialized)",
                   ["profile", "--hf-config", config, "--seq-len", str(args.seq_len), "--microbatch-sizes", "1,2",
                    "--dtype", "bfloat16", "--optimizer", "adamw", "--analytic", args.device, "-o", str(analytic)]),
              Step(f"plan the analytic profile for {args.nodes} x {args.devices_per_node} {args.device}",
                   ["plan", "--profile", str(analytic), *cluster, "-o", str(out / "analytic.plan.json")])]
    return steps


def _summary(out: Path, name: str) -> str:
    path = out / f"{name}.plan.json"
    if not path.is_file():
        return ""
    plan = json.loads(path.read_text())
    pred = plan["predicted"]
    return (f"pp {plan['pp']} x dp {plan['dp']}, {plan['schedule']}, v {plan['virtual_stages']}, "
            f"{plan['num_microbatches']} microbatches of {plan['microbatch_size']}, "
            f"step {pred['step_time_s']:.3g} s, peak {max(pred['peak_memory_bytes']) / 2**30:.3g} GiB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/configs/llama-3-8b.json")
    parser.add_argument("--cpu-seq-len", type=int, default=16, help="tokens per sample when measuring on this CPU")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per sample of the analytic profile")
    parser.add_argument("--device", default="h100-sxm")
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=512)
    parser.add_argument("--skip-measured", action="store_true", help="only the analytic profile and its plan")
    parser.add_argument("--out", help="directory for the profiles and plans (default: a temporary one)")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="autopp-scale-"))
    results = [_run(step) for step in _steps(args.config, out, args)]
    print(f"{'step':<58} {'wall s':>7} {'peak RSS GiB':>12} {'exit':>4}")
    for r in results:
        print(f"{r.step.name:<58} {r.wall_s:>7.1f} {r.peak_rss_bytes / 2**30:>12.2f} {r.returncode:>4}")
    for name in ("measured", "analytic"):
        if summary := _summary(out, name):
            print(f"{name} plan: {summary}")
    for r in results:
        if r.returncode != 0:
            print(f"\n{r.step.name} failed (exit {r.returncode}):\n{r.tail}", file=sys.stderr)
    print(f"\nprofiles and plans under {out}")
    return max(r.returncode for r in results)


if __name__ == "__main__":
    raise SystemExit(main())
