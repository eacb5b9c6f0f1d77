"""`autopp profile` and `autopp profile-links`: measure a model's units, or the link between local ranks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import AutoppError
from ..preflight import check_model_file, check_output_dir, check_output_file
from .common import COUNT, DEFAULT_PROFILE_DIR, POSITIVE, SECONDS, comma_sizes, end_progress, progress

if TYPE_CHECKING:
    from ..data.profile import Profile

__all__ = ["add_parsers", "profile_for"]


def add_parsers(sub: argparse._SubParsersAction[Any]) -> None:
    """The `profile` and `profile-links` commands."""
    p = sub.add_parser("profile", help="measure each unit of a model file")
    p.add_argument("model", help="model file following the contract in README.md")
    p.add_argument("--microbatch-sizes", type=comma_sizes, default=[1, 4], metavar="B,B,...",
                   help="microbatch sizes to measure (default 1,4); the cost model interpolates between them")
    p.add_argument("--microbatch-size", type=POSITIVE, help="measure this one size only")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam", "adamw"], default="sgd")
    p.add_argument("--repeats", type=POSITIVE, default=5, help="timed runs per unit (median is kept)")
    p.add_argument("--warmup", type=COUNT, default=2, help="untimed runs first")
    p.add_argument("--threads", type=POSITIVE, default=1, help="torch threads while measuring (default 1)")
    p.add_argument("--time-budget", type=SECONDS, metavar="S",
                   help="stop timing after S seconds per unit even if fewer than --repeats runs were made")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="parameter and activation dtype (bfloat16: mixed precision, fp32 master copy counted)")
    p.add_argument("--co-runners", type=COUNT, default=0, metavar="N",
                   help="processes training the model beside the timing, as the other ranks of a CPU host do "
                        "(use ranks per host - 1 when CPU ranks share a host; default 0)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="measure on this device (default cpu)")
    p.add_argument("-o", "--output", help="profile directory (default profiles/MODEL)")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("profile-links", help="measure the link between local ranks (latency, bandwidth; on CPU also "
                                             "the per-message overhead and progress delay)")
    p.add_argument("--ranks", type=POSITIVE, default=2, help="processes to start (default 2)")
    p.add_argument("--message-bytes", type=comma_sizes, metavar="N,N,...", help="message sizes in bytes")
    p.add_argument("--repeats", type=POSITIVE, default=10, help="timed round trips per size (median is kept)")
    p.add_argument("--timeout", type=SECONDS, default=120.0, help="seconds before the ranks are stopped")
    p.add_argument("--no-calibrate", action="store_true",
                   help="CPU: skip fitting the per-message overhead and progress delay on synthetic pipelines")
    p.add_argument("-o", "--output", default="profiles/links.json", help="links JSON (default profiles/links.json)")
    p.set_defaults(func=_cmd_profile_links)


def _cmd_profile(args: argparse.Namespace) -> int:
    check_model_file(args.model)
    target = check_output_dir(args.output or DEFAULT_PROFILE_DIR / Path(args.model).stem,
                              "-o" if args.output else None, marker="meta.json", kind="profile")
    from ..display import format_profile
    from ..measure import profile_model  # torch: only once the arguments are known to be good
    sizes = [args.microbatch_size] if args.microbatch_size else args.microbatch_sizes
    try:
        profile = profile_model(args.model, microbatch_sizes=sizes, optimizer=args.optimizer, warmup=args.warmup,
                                repeats=args.repeats, threads=args.threads, progress=progress("profiling"),
                                time_budget_s=args.time_budget, dtype=args.dtype, device=args.device,
                                co_runners=args.co_runners)
    except ValueError as exc:
        raise AutoppError(str(exc)) from None
    end_progress()
    out = profile.save(target)
    print(format_profile(profile))
    for whole in profile.meta.whole_model:
        print(f"microbatch {whole['microbatch_size']}: units sum to {whole['units_s'] * 1e3:.3g} ms, one whole-model "
              f"step takes {whole['whole_s'] * 1e3:.3g} ms (gap {whole['gap']:+.1%})")
    from ..data.profile import ValueAction
    relayed = [v for v in profile.meta.live_values if v.action is not ValueAction.SEND]
    for v in relayed:
        print(f"value {v.name} from unit {v.src} is read by units {list(v.dsts)}: {v.action.value}")
    for g in profile.meta.tied_parameters:
        print(f"tied parameters {', '.join(g.names)} (units {list(g.units)}): one tensor, a copy per unit that uses it")
    print(f"\nwrote profile {out}/ ({profile.num_units} units, microbatch sizes {list(profile.meta.microbatch_sizes)})")
    return 0


def _cmd_profile_links(args: argparse.Namespace) -> int:
    check_output_file(args.output, "-o")
    from ..measure.links import DEFAULT_MESSAGE_BYTES, measure_links
    from ..run.calibrate import calibrate_links  # torch: only once the arguments are known to be good
    sizes = args.message_bytes or list(DEFAULT_MESSAGE_BYTES)
    print(f"profiling links: {args.ranks} ranks, messages of {sizes} bytes"
          f"{'' if args.no_calibrate else ', then (CPU) calibrating on synthetic pipelines (about 15 s)'}",
          file=sys.stderr)
    try:
        links = measure_links(args.ranks, sizes, repeats=args.repeats, timeout_s=args.timeout)
        if not args.no_calibrate:
            links = calibrate_links(links, timeout_s=args.timeout)
    except ValueError as exc:
        raise AutoppError(str(exc)) from None
    for pair in links.pairs:
        print(f"rank {pair.src} -> {pair.dst}: latency {pair.latency_s * 1e6:.3g} us, "
              f"bandwidth {pair.bandwidth_bytes_per_s / 1e9:.3g} GB/s")
    print(f"fit over all pairs ({links.backend}): latency {links.latency_s * 1e6:.3g} us, "
          f"bandwidth {links.bandwidth_bytes_per_s / 1e9:.3g} GB/s")
    if links.calibration:
        print("\ncalibration (torch schedules on synthetic stages; step times in ms)")
        print(f"{'schedule':<8} {'m':>2} {'layers':>6} {'measured':>9} {'predicted':>9} {'error':>6}")
        for r in links.calibration:
            print(f"{r.schedule:<8} {r.microbatches:>2} {r.layers:>6} {r.measured_s * 1e3:>9.2f} "
                  f"{r.predicted_s * 1e3:>9.2f} {(r.measured_s - r.predicted_s) / r.predicted_s:>+6.0%}")
    link = links.link()
    fitted = "default, not calibrated" if links.overhead_s is None else "calibrated"
    print(f"per-message overhead {link.overhead_s * 1e6:.3g} us ({fitted}), progress delay "
          f"{link.progress_s * 1e3:.3g} ms"
          + (f"; calibration rms error {links.calibration_rms:.1%}" if links.calibration_rms is not None else ""))
    print(f"\nwrote links {links.save(args.output)}")
    return 0


def profile_for(args: argparse.Namespace) -> Profile:
    """The model's default profile if it is current, else a fresh one (written there)."""
    from ..measure import profile_model
    from ..model import discover_units, fingerprint, load_model_file
    from ..data.profile import load_profile
    mf = load_model_file(args.model)
    model = mf.build()
    current = fingerprint(model, discover_units(mf, model))
    default = DEFAULT_PROFILE_DIR / Path(args.model).stem
    if (default / "meta.json").is_file():
        profile = load_profile(default)
        if profile.meta.fingerprint == current:
            print(f"using profile {default}/", file=sys.stderr)
            return profile
    profile = profile_model(args.model, progress=progress("profiling"))
    end_progress()
    print(f"wrote profile {profile.save(default)}/", file=sys.stderr)
    return profile
