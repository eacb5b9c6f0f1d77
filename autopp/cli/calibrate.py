"""`autopp calibrate PROFILE`: fit a catalog device's roofline efficiencies to a measured profile
(docs/analytic.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import AutoppError
from ..preflight import check_output_file
from .common import end_progress, progress

if TYPE_CHECKING:
    from ..costmodel.roofline import Calibration

__all__ = ["add_parser", "format_calibration"]


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """The `calibrate` command."""
    p = sub.add_parser("calibrate", help="fit a catalog device's compute and memory efficiencies and per-op and "
                                         "per-call overheads to a measured profile (for `profile --analytic`)")
    p.add_argument("profile", metavar="PROFILE", help="a measured profile directory (`autopp profile`)")
    p.add_argument("--device", metavar="NAME",
                   help="catalog device the profile was measured on (default: recognised from the profile)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="calibration file to write (default: PROFILE.calibration-DEVICE.json beside the profile "
                        "directory)")
    p.set_defaults(func=_cmd_calibrate)


def format_calibration(cal: Calibration) -> str:
    """Per unit measured vs analytic forward + backward, then the fitted efficiencies and the median and worst
    error."""
    lines = [f"{'unit':>4} {'name':<24} {'b':>3} {'measured ms':>11} {'analytic ms':>11} {'error':>7}"]
    for u in cal.units:
        lines.append(f"{u.unit:>4} {u.name[:24]:<24} {u.microbatch_size:>3} {u.measured_s * 1e3:>11.3f} "
                     f"{u.analytic_s * 1e3:>11.3f} {u.error:>+7.1%}")
    e = cal.efficiency
    lines.append(f"\n{cal.device} ({cal.dtype}): compute efficiency {e.compute:.3g}, memory efficiency "
                 f"{e.memory:.3g}, per-op overhead {e.op_overhead_s * 1e6:.3g} us, per-call overhead "
                 f"{e.call_overhead_s * 1e6:.3g} us")
    lines.append(f"forward + backward error over {len(cal.units)} unit x microbatch rows: median "
                 f"{cal.median_error:.1%}, worst {cal.worst_error:.1%}")
    return "\n".join(lines)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from ..data.catalog import identify_device, load_device
    from ..data.profile import load_profile
    profile = load_profile(args.profile)
    if profile.meta.extra.get("analytic_device"):
        raise AutoppError(f"{args.profile}: is an analytic profile; calibrate from a measured one (`autopp profile`)")
    name = args.device or identify_device(profile.meta.device)
    if name is None:
        raise AutoppError(f"{args.profile}: measured on {profile.meta.device!r}, which no catalog device matches; "
                          "give --device NAME (`autopp devices` lists them)")
    spec = load_device(name)
    spec.peak(profile.meta.dtype)
    where = Path(args.profile)
    output = args.output or str(where.parent / f"{where.name}.calibration-{spec.name}.json")
    check_output_file(output, "-o" if args.output else None)
    from ..measure.fitting import calibrate  # torch: only once the arguments are known to be good
    try:  # counting failures are ModelFileErrors naming the model file and unit already
        cal = calibrate(profile, spec, str(args.profile), progress=progress("counting"))
    except ValueError as exc:
        raise AutoppError(f"{args.profile}: {exc}") from None
    end_progress()
    print(format_calibration(cal))
    print(f"\nwrote calibration {cal.save(output)}", file=sys.stderr)
    return 0
