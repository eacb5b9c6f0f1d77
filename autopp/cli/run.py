"""`autopp run`: execute a plan on local ranks or through torchrun, validate it, write the run report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import AutoppError
from ..preflight import check_output_file
from .common import POSITIVE, SECONDS, end_progress, number, progress

if TYPE_CHECKING:
    from ..run.options import RunOptions

__all__ = ["add_parser"]


#: What --print-torchrun writes for --master-addr when several nodes were asked for without one.
NODE0 = "NODE0_ADDRESS"


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """The `run` command."""
    p = sub.add_parser("run", help="execute a plan with torch.distributed.pipelining and validate it")
    p.add_argument("plan", help="plan JSON")
    p.add_argument("--steps", type=POSITIVE, default=3, help="training steps (default 3)")
    p.add_argument("--timeout", type=SECONDS, default=300.0,
                   help="seconds before the run is stopped (default 300)")
    p.add_argument("--report", help="run report JSON path (default: the plan's, .json -> .report.json)")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="also log every rank's own lines (stages built, relays, each rank's steps)")
    p.add_argument("--nnodes", type=POSITIVE, help="run through torchrun on this many machines (docs/launch.md)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1 (default 0)")
    p.add_argument("--master-addr", help="address of node 0, reachable from every node (default 127.0.0.1 on one "
                   f"node; several need it: --print-torchrun writes {NODE0} in its place)")
    p.add_argument("--master-port", type=int, default=29500, help="free TCP port on node 0 (default 29500)")
    p.add_argument("--run-dir", help="keep the ranks' logs and results here (default: a temporary directory)")
    p.add_argument("--print-torchrun", action="store_true",
                   help="print the torchrun command to run on each node, and exit")
    p.add_argument("--backend", choices=["gloo", "nccl"],
                   help="torch.distributed backend (default: the plan's device kind: nccl for GPUs, gloo for cpu)")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam", "adamw"],
                   help="the ranks' optimizer (default: the plan's, the profile's, whose state the plan's memory "
                        "counts; sgd for plans that name none)")
    p.add_argument("--lr", type=number(0, inclusive=True), default=0.01,
                   help="the optimizer's learning rate (default 0.01)")
    p.add_argument("--no-validate", dest="validate", action="store_false",
                   help="measure only: skip the single-process reference (for a model one process cannot hold); "
                        "the report says it was not validated")
    p.set_defaults(func=_cmd_run)


def _options(args: argparse.Namespace, nnodes: int) -> RunOptions:
    """What `autopp run` asked for: torchrun's `nnodes` nodes with --nnodes or --print-torchrun, and `check` off (a
    failed validation is the report's verdict, and exit status 1)."""
    from ..run.options import Nodes, RunOptions
    addr = args.master_addr or ("127.0.0.1" if nnodes == 1 else NODE0 if args.print_torchrun else None)
    if addr is None:
        raise AutoppError(f"--nnodes {nnodes} runs across machines: give --master-addr, node 0's address reachable "
                          "from every node")
    try:
        nodes = None
        if args.nnodes is not None or args.print_torchrun:
            nodes = Nodes(nnodes=nnodes, node_rank=args.node_rank, master_addr=addr, master_port=args.master_port)
        return RunOptions(steps=args.steps, timeout_s=args.timeout, nodes=nodes, work_dir=args.run_dir, check=False,
                          backend=args.backend, optimizer=args.optimizer, lr=args.lr, validate=args.validate)
    except ValueError as exc:
        raise AutoppError(str(exc)) from None


def _cmd_run(args: argparse.Namespace) -> int:
    from ..data.plan import load_plan
    writes_report = not args.print_torchrun and (args.nnodes is None or args.node_rank == 0)
    out = Path(args.report or Path(args.plan).with_suffix(".report.json"))
    if writes_report:  # before any rank starts: a bad --report must not cost the run
        check_output_file(out, "--report" if args.report else None)
    plan = load_plan(args.plan)
    from ..run import RunFailedError, format_report, run_plan  # torch: only once the plan is known to be good
    from ..run.resolve import resolve_options
    from ..run.torchrun import format_commands, plan_nnodes
    nnodes, nodes_reason, not_the_plans = plan_nnodes(plan, args.nnodes)
    options = _options(args, nnodes)
    if not_the_plans and not args.print_torchrun:  # a given --nnodes not the plan's cluster: run as asked, said
        print(f"autopp: note: nodes {nodes_reason}", file=sys.stderr)
    if args.print_torchrun:
        chosen = resolve_options(plan, options, cuda_devices=None)
        print(f"# backend {chosen.backend_reason}")
        print(f"# nodes {nodes_reason}" + (f"; {NODE0}: node 0's address, reachable from every node (--master-addr)"
                                            if options.nodes and options.nodes.master_addr == NODE0 else ""))
        print(format_commands(Path(args.plan).resolve(), chosen.options, num_ranks=plan.num_ranks,
                              run_dir=args.run_dir or "autopp-run"))
        return 0
    try:
        report = run_plan(plan, options, progress=progress("running"), plan_path=str(Path(args.plan).resolve()))
    except RunFailedError as exc:
        end_progress()
        exc.report.save(out)
        print(f"wrote partial report {out}", file=sys.stderr)
        if exc.logs is not None:
            print(f"logs of the ranks kept in {exc.logs} (rank*.err: each rank's traceback)", file=sys.stderr)
        raise
    end_progress()
    if options.nodes is not None and options.nodes.node_rank != 0:
        print(f"node {options.nodes.node_rank}: its ranks finished; node 0 validates and writes the report")
        return 0
    report.save(out)
    print(format_report(report))
    print(f"\nwrote report {out}")
    if not report.validated:
        print("autopp: not validated: measured only (--no-validate)", file=sys.stderr)
        return 0
    if not report.passed:  # the verdict above says why: one stream holds the reason
        at = f" at step {report.failed_steps[0]} of {report.steps}" if report.failed_steps else ""
        print(f"autopp: error: validation failed{at}: the verdict above says why", file=sys.stderr)
        return 1
    return 0
