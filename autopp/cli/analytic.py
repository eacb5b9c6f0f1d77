"""The `--analytic DEVICE [--calibration FILE]` arguments of `autopp profile` (docs/analytic.md): counted on the
meta device, timed by a catalog device's roofline, instead of measured."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ..errors import AutoppError
from .common import progress

if TYPE_CHECKING:
    from ..costmodel.roofline import Calibration
    from ..data.profile import Profile
    from ..measure.options import ProfileOptions
    from ..model.contract import ModelFile

__all__ = ["MEASURING_FLAGS", "add_analytic_arguments", "add_kernels_argument", "kernels_of", "check_kernels",
           "check_analytic", "analytic_of"]

#: Flags of `autopp profile` that only a measurement uses (flag, argparse dest): refused with --analytic.
MEASURING_FLAGS = (("--repeats", "repeats"), ("--warmup", "warmup"), ("--threads", "threads"),
                   ("--time-budget", "time_budget"), ("--co-runners", "co_runners"), ("--device", "device"),
                   ("--measure-every-unit", "measure_every_unit"))


def add_analytic_arguments(p: argparse.ArgumentParser) -> None:
    """--analytic DEVICE and --calibration FILE of `autopp profile` (after its measuring flags, whose defaults it
    records to tell a flag given from one left out)."""
    p.add_argument("--analytic", metavar="DEVICE",
                   help="count FLOPs and bytes on the meta device instead of measuring, and turn them into times "
                        "with this catalog device's roofline (`autopp devices`); nothing is materialized")
    p.add_argument("--calibration", metavar="FILE",
                   help="with --analytic: efficiencies from `autopp calibrate` (default: the documented assumptions)")
    add_kernels_argument(p)
    p.set_defaults(measuring_defaults={dest: p.get_default(dest) for _, dest in MEASURING_FLAGS})


def add_kernels_argument(p: argparse.ArgumentParser) -> None:
    """--kernels eager|fused: the elementwise kernels an analytic profile counts (autopp.measure.fusion)."""
    from ..data.precision import KERNELS
    p.add_argument("--kernels", choices=KERNELS,
                   help="analytic profiles: count elementwise ops as eager PyTorch runs them, one kernel each "
                        "(default), or fused, each chain of them between matmuls one kernel, nearest torch.compile's "
                        "fusion (docs/analytic.md, 'Fused elementwise kernels')")


def kernels_of(args: argparse.Namespace) -> str:
    """The elementwise kernels asked for: --kernels, else eager (`analytic_profile`'s)."""
    return getattr(args, "kernels", None) or "eager"


def _measuring_flags_given(args: argparse.Namespace) -> list[str]:
    """The measuring flags whose value is not their default (given on the command line)."""
    defaults = getattr(args, "measuring_defaults", {})
    return [flag for flag, dest in MEASURING_FLAGS if dest in defaults and getattr(args, dest) != defaults[dest]]


def _calibration(args: argparse.Namespace, device: str) -> Calibration | None:
    """The --calibration file, checked to be for `device` and --dtype."""
    from ..costmodel.roofline import load_calibration
    if not args.calibration:
        return None
    return load_calibration(args.calibration, device=device, dtype=args.dtype)


def check_kernels(args: argparse.Namespace) -> None:
    """Refuse --kernels without --analytic (before anything is said or counted: a new user saw the dtype line
    first)."""
    if args.kernels and not args.analytic:
        raise AutoppError(f"--kernels {args.kernels} goes with --analytic DEVICE: a measured profile times the kernels "
                          "that ran")


def check_analytic(args: argparse.Namespace) -> None:
    """Refuse --calibration without --analytic; with it, measuring flags, an unknown device, a device without the
    peaks of --precision, or a calibration file for another device or dtype, before anything is counted."""
    if args.calibration and not args.analytic:
        raise AutoppError("--calibration goes with --analytic DEVICE")
    if not args.analytic:
        return
    given = _measuring_flags_given(args)
    if given:
        one = len(given) == 1
        raise AutoppError(f"{', '.join(given)} {'applies' if one else 'apply'} to measuring only: --analytic "
                          f"{args.analytic} counts on the meta device; drop {'it' if one else 'them'}")
    from ..data.catalog import load_device
    from ..data.precision import recipe
    spec = load_device(args.analytic)
    recipe(args.precision).peaks(spec)
    _calibration(args, spec.name)


def analytic_of(args: argparse.Namespace, model: str | ModelFile, options: ProfileOptions) -> Profile:
    """The analytic profile `autopp profile --analytic` asked for, for `options`."""
    from ..data.catalog import load_device
    from ..measure.analytic import analytic_profile  # torch: only once the arguments are known to be good
    spec = load_device(args.analytic)
    return analytic_profile(model, spec, options, calibration=_calibration(args, spec.name),
                            calibration_path=args.calibration, kernels=kernels_of(args),
                            progress=progress("counting"))
