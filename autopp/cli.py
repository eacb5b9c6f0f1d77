"""The `autopp` command: parses arguments and calls the public API; errors become one line on stderr and exit 2."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable, Sequence

from .errors import AutoppError

__all__ = ["main"]

DEFAULT_PROFILE_DIR = Path("profiles")


def _progress(prefix: str) -> Callable[[str], None]:
    tty = sys.stderr.isatty()

    def show(msg: str) -> None:
        if tty:
            sys.stderr.write(f"\r\033[K{prefix}: {msg}")
            sys.stderr.flush()
        else:
            print(f"{prefix}: {msg}", file=sys.stderr, flush=True)
    return show


def _end_progress() -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"microbatch sizes must be positive integers, got {text!r}")
    return sizes


def _size(text: str) -> int:
    from .sizes import parse_size
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _cmd_profile(args: argparse.Namespace) -> int:
    from .display import format_profile
    from .measure import profile_model
    sizes = [args.microbatch_size] if args.microbatch_size else args.microbatch_sizes
    profile = profile_model(args.model, microbatch_sizes=sizes, optimizer=args.optimizer, warmup=args.warmup,
                            repeats=args.repeats, threads=args.threads, progress=_progress("profiling"))
    _end_progress()
    out = profile.save(args.output or DEFAULT_PROFILE_DIR / Path(args.model).stem)
    print(format_profile(profile))
    print(f"\nwrote profile {out}/ ({profile.num_units} units, microbatch sizes {list(profile.meta.microbatch_sizes)})")
    return 0


def _profile_for(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The profile named by --profile, or the model's default profile if it is current, else a fresh one."""
    from .profile import load_profile
    if args.profile:
        return load_profile(args.profile)
    from .measure import profile_model
    from .modelfile import discover_units, fingerprint, load_model_file
    mf = load_model_file(args.model)
    model = mf.build()
    current = fingerprint(model, discover_units(mf, model))
    default = DEFAULT_PROFILE_DIR / Path(args.model).stem
    if (default / "meta.json").is_file():
        profile = load_profile(default)
        if profile.meta.fingerprint == current:
            print(f"using profile {default}/", file=sys.stderr)
            return profile
    profile = profile_model(args.model, progress=_progress("profiling"))
    _end_progress()
    print(f"wrote profile {profile.save(default)}/", file=sys.stderr)
    return profile


def _cmd_plan(args: argparse.Namespace) -> int:
    from .cluster import DEFAULT_LINK, Cluster, Link
    from .display import format_plan
    from .solve import PlanRequest, make_plan
    if bool(args.model) == bool(args.profile):
        raise AutoppError("give either MODEL.py or --profile DIR, not both or neither")
    try:
        link = Link(latency_s=args.latency if args.latency is not None else DEFAULT_LINK.latency_s,
                    bandwidth_bytes_per_s=args.bandwidth or DEFAULT_LINK.bandwidth_bytes_per_s)
        request = PlanRequest(cluster=Cluster(num_devices=args.devices, memory_bytes=args.memory, link=link),
                              global_batch=args.global_batch, num_microbatches=args.microbatches)
    except ValueError as exc:
        raise AutoppError(str(exc)) from None
    profile = _profile_for(args)
    plan = make_plan(profile, request)
    out = plan.save(args.output or f"{Path(profile.meta.model_path).stem}.plan.json")
    print(format_plan(plan))
    print(f"\nwrote plan {out}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from .plan import load_plan
    from .run import RunFailedError, format_report, run_plan
    plan = load_plan(args.plan)
    out = Path(args.report or Path(args.plan).with_suffix(".report.json"))
    try:
        report = run_plan(plan, steps=args.steps, timeout_s=args.timeout, progress=_progress("running"),
                          plan_path=args.plan, check=False)
    except RunFailedError as exc:
        _end_progress()
        exc.report.save(out)
        print(f"wrote partial report {out}", file=sys.stderr)
        raise
    _end_progress()
    report.save(out)
    print(format_report(report))
    print(f"\nwrote report {out}")
    if not report.passed:
        print(f"autopp: error: validation failed: {report.error}", file=sys.stderr)
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopp", description="Automatic pipeline-parallelism planner for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the planner's search")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("profile", help="measure each unit of a model file")
    p.add_argument("model", help="model file following the contract in README.md")
    p.add_argument("--microbatch-sizes", type=_sizes, default=[1, 4], metavar="B,B,...",
                   help="microbatch sizes to measure (default 1,4); the cost model interpolates between them")
    p.add_argument("--microbatch-size", type=_positive, help="measure this one size only")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam", "adamw"], default="sgd")
    p.add_argument("--repeats", type=_positive, default=5, help="timed runs per unit (median is kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    p.add_argument("--threads", type=_positive, default=1, help="torch threads while measuring (default 1)")
    p.add_argument("-o", "--output", help="profile directory (default profiles/MODEL)")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("plan", help="choose stage boundaries and microbatches")
    p.add_argument("model", nargs="?", help="model file (profiled if profiles/MODEL is missing or stale)")
    p.add_argument("--profile", help="plan from this profile directory instead")
    p.add_argument("--devices", type=_positive, required=True, help="pipeline ranks")
    p.add_argument("--memory", type=_size, required=True, help="memory per device, e.g. 80GiB")
    p.add_argument("--global-batch", type=_positive, default=8, help="samples per step (default 8)")
    p.add_argument("--microbatches", type=_positive, help="pin the microbatch count")
    p.add_argument("--latency", type=float, help="link latency in seconds (default: assumed loopback gloo)")
    p.add_argument("--bandwidth", type=float, help="link bandwidth in bytes/s")
    p.add_argument("-o", "--output", help="plan JSON path (default MODEL.plan.json)")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("run", help="execute a plan with torch.distributed.pipelining and validate it")
    p.add_argument("plan", help="plan JSON")
    p.add_argument("--steps", type=_positive, default=3, help="training steps (default 3)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the run is stopped (default 300)")
    p.add_argument("--report", help="run report JSON path (default PLAN.report.json)")
    p.set_defaults(func=_cmd_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return int(args.func(args))
    except AutoppError as exc:
        _end_progress()
        first, *rest = str(exc).splitlines() or [""]
        print(f"autopp: error: {first}", file=sys.stderr)
        for line in rest:
            print(f"  {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
