"""The `autopp` command: parses arguments and calls the public API; errors become one line on stderr and exit 2.

One module per command group (profile, plan, run, show, export); each adds its subcommands to the parser and keeps
torch out of the import path until its arguments check out."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Sequence

from ..errors import AutoppError
from . import calibrate, devices, export, plan, profile, run, show
from .common import SCHEDULE_NAMES, TARGET_NAMES, Parser, end_progress, in_flags

__all__ = ["main", "SCHEDULE_NAMES", "TARGET_NAMES"]


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="autopp", description="Automatic pipeline-parallelism planner for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the planner's search")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    profile.add_parsers(sub)
    plan.add_parser(sub)
    run.add_parser(sub)
    show.add_parser(sub)
    export.add_parser(sub)
    devices.add_parser(sub)
    calibrate.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command `argv` (default: sys.argv[1:]); returns the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s",
                        force=True)  # this call's stderr: an earlier in-process call's may be closed
    try:
        return int(args.func(args))
    except AutoppError as exc:
        end_progress()
        first, *rest = in_flags(str(exc)).splitlines() or [""]
        print(f"autopp: error: {first}", file=sys.stderr)
        for line in rest:
            print(f"  {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autopp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader (e.g. `| head`) went away: stop quietly, as Unix tools do
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush from failing
        return 0
