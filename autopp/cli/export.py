"""`autopp export`: write a plan for torchtitan, Megatron-LM, DeepSpeed or torch's schedule CSV."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import AutoppError
from ..preflight import check_output_file
from .common import DEFAULT_PROFILE_DIR, TARGET_NAMES

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """The `export` command."""
    p = sub.add_parser("export", help="write a plan for torchtitan, Megatron-LM, DeepSpeed or torch's schedule CSV")
    p.add_argument("plan", help="plan JSON")
    p.add_argument("--to", required=True, choices=TARGET_NAMES,
                   help="the trainer (docs/export.md says what maps to what)")
    p.add_argument("--profile", help="the profile the plan was made from (torchtitan needs its module names, "
                                     "Megatron checks the model's layers with it; default: the one the plan names, "
                                     "else profiles/MODEL if its fingerprint matches)")
    p.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                   help="rename profiled modules to the trainer's (prefix; empty NEW drops the module), on top of the "
                        "built-in HF -> torchtitan mapping; repeatable")
    p.add_argument("-o", "--output", help="output file (default PLAN.torchtitan.args, .megatron.args, "
                                          ".deepspeed.json or .schedule.csv beside the plan)")
    p.set_defaults(func=_cmd_export)


def _profile(args: argparse.Namespace, plan):  # type: ignore[no-untyped-def]
    """The profile from --profile, else the one the plan records it was made from, else the model's default
    profile, when its fingerprint matches (None: none there)."""
    from ..data.profile import load_profile
    path = Path(getattr(args, "profile", None) or plan.profile_path or DEFAULT_PROFILE_DIR / Path(plan.model_path).stem)
    if not getattr(args, "profile", None) and not (path / "meta.json").is_file():
        return None
    profile = load_profile(path)
    if profile.meta.fingerprint != plan.fingerprint:
        raise AutoppError(f"{path}: profile fingerprint {profile.meta.fingerprint} is not the plan's "
                          f"({plan.fingerprint}); give --profile DIR, the profile the plan was made from")
    return profile


def _moe(profile):  # type: ignore[no-untyped-def]
    """The profile's routing facts (`meta.extra["moe"]`) and, for a mixture of experts, each unit's MoE layers
    (`moe_units`, the `moe_layers` column: Megatron's `--moe-layer-freq`); None for a dense model."""
    moe = profile.meta.extra.get("moe")
    if not moe:
        return moe
    units = profile.units[profile.units.microbatch_size == profile.units.microbatch_size.min()].sort_values("unit")
    return {**moe, "moe_units": [int(n) for n in units.moe_layers]}


#: The targets that read the plan's profile: torchtitan (module names), Megatron (the model's live values).
_READ_PROFILE = ("torchtitan", "megatron")


def _cmd_export(args: argparse.Namespace) -> int:
    from ..export import Target, default_output, export_plan, write_export
    from ..data.plan import load_plan
    renames = [tuple(r.split("=", 1)) for r in args.rename]
    if any(len(r) != 2 or not r[0] for r in renames):
        raise AutoppError(f"--rename takes OLD=NEW, got {args.rename}")
    target = Target(args.to)
    if target is not Target.TORCHTITAN and args.rename:
        raise AutoppError(f"--rename applies to --to torchtitan only (module names); {args.to} exports count units, "
                          "not names: leave it out")
    if args.to not in _READ_PROFILE and args.profile:
        raise AutoppError(f"--profile applies to --to {' and '.join(_READ_PROFILE)} only; {args.to} exports read "
                          "the plan alone: leave it out")
    if target is Target.DEEPSPEED and args.output and not args.output.endswith(".json"):  # a tester: JSON in x.yaml
        raise AutoppError(f"-o {args.output}: --to deepspeed writes DeepSpeed's JSON config (ds_config.json); give -o "
                          "a path ending in .json")
    out = check_output_file(args.output or default_output(args.plan, target), "-o" if args.output else None)
    plan = load_plan(args.plan)
    profile = _profile(args, plan) if args.to in _READ_PROFILE else None
    if profile is None and target is Target.MEGATRON and plan.layout.ep > 1:  # a tester was told to profile again
        where = plan.profile_path or DEFAULT_PROFILE_DIR / Path(plan.model_path).stem
        raise AutoppError(f"{args.plan}: ep {plan.layout.ep}: Megatron-LM needs the model's experts and top-k from "
                          f"the profile the plan was made from, and {where} has no profile (the plan moved?): give "
                          "--profile DIR")
    modules = None if profile is None or target is not Target.TORCHTITAN else profile.unit_modules()
    exported = export_plan(plan, target, out, modules, where=args.plan, renames=renames,  # type: ignore[arg-type]
                           moe=None if profile is None else _moe(profile),
                           values=None if profile is None else profile.meta.live_values)
    for extra in exported.extra:  # every file, before any is written
        check_output_file(extra)
    for path in write_export(exported, out):
        print(f"wrote {path}")
    for note in exported.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
