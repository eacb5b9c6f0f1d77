"""The `autopp` command: parses arguments and calls the public API; errors become one line on stderr and exit 2."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Callable, NoReturn, Sequence

from .errors import AutoppError
from .preflight import check_model_file, check_output_dir, check_output_file

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


def _integer(least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `least`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"expected {'a positive integer' if least == 1 else f'an integer >= {least}'}"
                                             f", got {text!r}")
        return value
    return parse


def _number(least: float, inclusive: bool, what: str = "") -> Callable[[str], float]:
    """An argparse type: a finite number >= `least` (> `least` unless `inclusive`), described as `what`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not (value >= least if inclusive else value > least) or value == float("inf"):
            bound = f"a finite number {'>=' if inclusive else '>'} {least:g}"
            raise argparse.ArgumentTypeError(f"expected {what or bound}, got {text!r}")
        return value
    return parse


_POSITIVE = _integer(1)
_COUNT = _integer(0)
_SECONDS = _number(0, inclusive=False, what="a positive number of seconds")


def _cmd_profile(args: argparse.Namespace) -> int:
    check_model_file(args.model)
    target = check_output_dir(args.output or DEFAULT_PROFILE_DIR / Path(args.model).stem,
                              "-o" if args.output else None, marker="meta.json", kind="profile")
    from .display import format_profile
    from .measure import profile_model  # torch: only once the arguments are known to be good
    sizes = [args.microbatch_size] if args.microbatch_size else args.microbatch_sizes
    try:
        profile = profile_model(args.model, microbatch_sizes=sizes, optimizer=args.optimizer, warmup=args.warmup,
                                repeats=args.repeats, threads=args.threads, progress=_progress("profiling"),
                                time_budget_s=args.time_budget, dtype=args.dtype, device=args.device,
                                co_runners=args.co_runners)
    except ValueError as exc:
        raise AutoppError(str(exc)) from None
    _end_progress()
    out = profile.save(target)
    print(format_profile(profile))
    for whole in profile.meta.whole_model:
        print(f"microbatch {whole['microbatch_size']}: units sum to {whole['units_s'] * 1e3:.3g} ms, one whole-model "
              f"step takes {whole['whole_s'] * 1e3:.3g} ms (gap {whole['gap']:+.1%})")
    relayed = [v for v in profile.meta.live_values if v["action"] != "send"]
    for v in relayed:
        print(f"value {v['name']} from unit {v['src']} is read by units {v['dsts']}: {v['action']}")
    for g in profile.meta.tied_parameters:
        print(f"tied parameters {', '.join(g['names'])} (units {g['units']}): one tensor, a copy per unit that uses it")
    print(f"\nwrote profile {out}/ ({profile.num_units} units, microbatch sizes {list(profile.meta.microbatch_sizes)})")
    return 0


def _cmd_profile_links(args: argparse.Namespace) -> int:
    check_output_file(args.output, "-o")
    from .links import DEFAULT_MESSAGE_BYTES, measure_links
    sizes = args.message_bytes or list(DEFAULT_MESSAGE_BYTES)
    print(f"profiling links: {args.ranks} ranks, messages of {sizes} bytes"
          f"{'' if args.no_calibrate else ', then (CPU) calibrating on synthetic pipelines (about 15 s)'}", file=sys.stderr)
    try:
        links = measure_links(args.ranks, sizes, repeats=args.repeats, timeout_s=args.timeout,
                              calibrate=not args.no_calibrate)
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


def _profile_for(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The model's default profile if it is current, else a fresh one (written there)."""
    from .profile import load_profile
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


def _auto_int(text: str) -> int:
    return 0 if text == "auto" else _POSITIVE(text)


def _dp(args: argparse.Namespace) -> int | None:
    """--dp N, auto (None), or unset: 1, or devices / pp when --pp is given."""
    if args.dp is None:
        return None if args.pp else 1
    return args.dp or None


def _plan_cluster(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from .cluster import DEFAULT_LINK, Cluster, Link, load_cluster
    if args.cluster:
        for flag, value, field in (("--message-overhead", args.message_overhead, "overhead_s"),
                                   ("--progress-delay", args.progress_delay, "progress_s")):
            if value is not None:
                raise AutoppError(f"{flag} applies to --devices; with --cluster give each link's {field} in the file")
        return load_cluster(args.cluster)
    if args.devices is None or args.memory is None:
        raise AutoppError("give --devices N and --memory SIZE, or --cluster FILE")
    base = DEFAULT_LINK
    if args.links:
        from .links import load_link
        base = load_link(args.links)
    link = Link(latency_s=args.latency if args.latency is not None else base.latency_s,
                bandwidth_bytes_per_s=args.bandwidth or base.bandwidth_bytes_per_s,
                overhead_s=args.message_overhead if args.message_overhead is not None else base.overhead_s,
                progress_s=args.progress_delay if args.progress_delay is not None else base.progress_s)
    return Cluster(num_devices=args.devices, memory_bytes=args.memory, link=link)


def _cmd_plan(args: argparse.Namespace) -> int:
    if bool(args.model) == bool(args.profile):
        raise AutoppError("give either MODEL.py or --profile DIR, not both or neither")
    if args.output:  # before anything is loaded
        check_output_file(args.output, "-o")
    if args.model:
        check_model_file(args.model)
    if args.pin_from:  # before a profile is loaded or measured
        from .export import read_config_text
        read_config_text(args.pin_from)
    from .display import format_plan
    from .schedule import ScheduleName
    from .solve import PlanRequest, RecomputeMode, make_plan
    try:
        request = PlanRequest(cluster=_plan_cluster(args), global_batch=args.global_batch,
                              num_microbatches=args.microbatches,
                              schedule=None if args.schedule == "auto" else ScheduleName(args.schedule),
                              pp=args.pp, dp=_dp(args), virtual_stages=args.virtual_stages,
                              recompute=RecomputeMode(args.recompute),
                              synthesize=args.schedule == "auto" or args.synthesize,
                              synth_time_limit_s=args.synth_time)
    except ValueError as exc:
        raise AutoppError(str(exc)) from None
    given = None
    if args.profile:
        from .profile import load_profile
        given = load_profile(args.profile)
        stem = Path(given.meta.model_path).stem
    else:
        stem = Path(args.model).stem
        if not (DEFAULT_PROFILE_DIR / stem / "meta.json").is_file():  # it will be profiled and saved there
            check_output_dir(DEFAULT_PROFILE_DIR / stem, marker="meta.json", kind="profile")
    out = check_output_file(args.output or f"{stem}.plan.json", "-o" if args.output else None)
    profile = given or _profile_for(args)
    pinned = _read_pin(args, profile, request) if args.pin_from else None
    plan = make_plan(profile, request)
    plan.save(out)
    print(format_plan(plan))
    print(f"\nwrote plan {out}")
    if pinned is not None:
        from .export.compare import format_comparison
        from .solve import evaluate_pinned
        print(format_comparison(evaluate_pinned(profile, request.cluster, pinned[0]), plan, args.pin_from, pinned[1]))
    return 0


def _read_pin(args: argparse.Namespace, profile, request):  # type: ignore[no-untyped-def]
    """--pin-from: the user's trainer configuration (checked before the search and before anything is written) and
    notes on how it is judged."""
    from .export import read_pinned
    from .solve.pinned import check_pinned
    pinned, notes = read_pinned(args.pin_from, profile.meta.unit_names, request.cluster.num_devices)
    check_pinned(pinned, profile.num_units, request.cluster.num_devices)
    batch = pinned.microbatches * pinned.microbatch_size * pinned.dp
    if batch != request.global_batch:
        raise AutoppError(f"{args.pin_from}: its global batch is {batch}, --global-batch is {request.global_batch}; "
                          f"give --global-batch {batch} so both plans train the same batch")
    return pinned, notes


def _cmd_run(args: argparse.Namespace) -> int:
    from .plan import load_plan
    writes_report = not args.print_torchrun and (args.nnodes is None or args.node_rank == 0)
    out = Path(args.report or Path(args.plan).with_suffix(".report.json"))
    if writes_report:  # before any rank starts: a bad --report must not cost the run
        check_output_file(out, "--report" if args.report else None)
    plan = load_plan(args.plan)
    from .run import Nodes, RunFailedError, format_report, run_plan  # torch: only once the plan is known to be good
    from .run.torchrun import format_commands
    nodes = None
    if args.nnodes is not None or args.print_torchrun:
        try:
            nodes = Nodes(nnodes=args.nnodes or 1, node_rank=args.node_rank, master_addr=args.master_addr,
                          master_port=args.master_port)
        except ValueError as exc:
            raise AutoppError(str(exc)) from None
    if args.print_torchrun:
        assert nodes is not None
        print(format_commands(Path(args.plan).resolve(), nodes, num_ranks=plan.num_ranks,
                              run_dir=args.run_dir or "autopp-run", steps=args.steps, timeout_s=args.timeout))
        return 0
    try:
        report = run_plan(plan, steps=args.steps, timeout_s=args.timeout, progress=_progress("running"),
                          plan_path=str(Path(args.plan).resolve()), check=False, nodes=nodes, work_dir=args.run_dir)
    except RunFailedError as exc:
        _end_progress()
        exc.report.save(out)
        print(f"wrote partial report {out}", file=sys.stderr)
        if exc.logs is not None:
            print(f"logs of the ranks kept in {exc.logs} (rank*.err: each rank's traceback)", file=sys.stderr)
        raise
    _end_progress()
    if nodes is not None and nodes.node_rank != 0:
        print(f"node {nodes.node_rank}: its ranks finished; node 0 validates and writes the report")
        return 0
    report.save(out)
    print(format_report(report))
    print(f"\nwrote report {out}")
    if not report.passed:
        print(f"autopp: error: validation failed: {report.error}", file=sys.stderr)
        return 1
    return 0


#: The values of autopp.schedule.ScheduleName, spelt out so that parsing arguments imports neither the schedule
#: package nor its solver (pandas, OR-Tools: seconds on a loaded machine); tests/test_cli.py checks they agree.
SCHEDULE_NAMES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
                  "DualPipeV")

#: The values of autopp.export.Target, spelt out for the same reason; tests/export/test_export.py checks they agree.
TARGET_NAMES = ("torchtitan", "megatron", "deepspeed", "torch-csv")


def _show_report(path: Path, out: Path) -> int:
    from .plan import load_plan
    from .predict import simulate_plan
    from .run import draw_report, load_report
    from .run.timeline import measured_headline, predicted_headline
    report = load_report(path)
    plan_path = report.get("plan_path")
    predicted = simulate_plan(load_plan(plan_path)) if plan_path and Path(plan_path).is_file() else None
    draw_report(report, predicted, out)
    figures = f"measured {measured_headline(report)}" + (
        f"; predicted {predicted_headline(report, predicted)}" if predicted else "")
    print(f"wrote measured{' and predicted' if predicted else ''} timelines {out} ({figures})")
    if predicted is None:
        print(f"(plan {plan_path} not found: measured timeline only)", file=sys.stderr)
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from .jsonio import read_json
    from .plan import load_plan
    path = Path(args.file)
    data = read_json(path, "plan or report file", advice="give a file written by `autopp plan` or `autopp run`")
    out = check_output_file(args.output or path.with_suffix(".png"), "-o" if args.output else None)
    if args.trace:
        check_output_file(args.trace, "--trace")
    if isinstance(data, dict) and "grad_rtol" in data:
        return _show_report(path, out)
    plan = load_plan(path)
    from .display import format_predicted_step
    from .predict import simulate_plan
    from .schedule import draw_timeline, write_chrome_trace
    result = simulate_plan(plan)
    title = (f"{Path(plan.model_path).name}: {plan.schedule}, pp {plan.pp} x dp {plan.dp}, "
             f"{plan.num_microbatches} microbatches of {plan.microbatch_size} (simulated)")
    headline = format_predicted_step(plan, result.step_time_s)  # the plan's stored figures, as `autopp plan` prints
    draw_timeline(result, out, title=title, headline=headline)
    print(f"wrote timeline {out} ({headline})")
    if args.trace:
        write_chrome_trace(result, args.trace)
        print(f"wrote trace {args.trace} (open in chrome://tracing or ui.perfetto.dev)")
    return 0


def _unit_modules(args: argparse.Namespace, plan) -> list[list[str]] | None:  # type: ignore[no-untyped-def]
    """Each unit's module names from --profile, or from the model's default profile when its fingerprint matches."""
    from .profile import load_profile
    path = Path(args.profile) if args.profile else DEFAULT_PROFILE_DIR / Path(plan.model_path).stem
    if not args.profile and not (path / "meta.json").is_file():
        return None
    profile = load_profile(path)
    if profile.meta.fingerprint != plan.fingerprint:
        raise AutoppError(f"{path}: profile fingerprint {profile.meta.fingerprint} is not the plan's "
                          f"({plan.fingerprint}); give --profile DIR, the profile the plan was made from")
    return profile.unit_modules()


def _cmd_export(args: argparse.Namespace) -> int:
    from .export import Target, default_output, export_plan, rename_modules, write_export
    from .plan import load_plan
    renames = [tuple(r.split("=", 1)) for r in args.rename]
    if any(len(r) != 2 or not r[0] for r in renames):
        raise AutoppError(f"--rename takes OLD=NEW, got {args.rename}")
    target = Target(args.to)
    if target is not Target.TORCHTITAN:
        for flag, given in (("--rename", args.rename), ("--profile", args.profile)):
            if given:
                raise AutoppError(f"{flag} applies to --to torchtitan only (module names); {args.to} exports count "
                                  "units, not names: leave it out")
    out = check_output_file(args.output or default_output(args.plan, target), "-o" if args.output else None)
    plan = load_plan(args.plan)
    modules = _unit_modules(args, plan) if target is Target.TORCHTITAN else None
    if modules is not None:
        modules = rename_modules(modules, renames)  # type: ignore[arg-type]
    exported = export_plan(plan, target, out, modules, where=args.plan)
    for extra in exported.extra:  # every file, before any is written
        check_output_file(extra)
    for path in write_export(exported, out):
        print(f"wrote {path}")
    for note in exported.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


class _Parser(argparse.ArgumentParser):
    """Usage errors on one line (the command and what is wrong), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    from .cluster import DEFAULT_LINK
    parser = _Parser(prog="autopp", description="Automatic pipeline-parallelism planner for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the planner's search")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("profile", help="measure each unit of a model file")
    p.add_argument("model", help="model file following the contract in README.md")
    p.add_argument("--microbatch-sizes", type=_sizes, default=[1, 4], metavar="B,B,...",
                   help="microbatch sizes to measure (default 1,4); the cost model interpolates between them")
    p.add_argument("--microbatch-size", type=_POSITIVE, help="measure this one size only")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam", "adamw"], default="sgd")
    p.add_argument("--repeats", type=_POSITIVE, default=5, help="timed runs per unit (median is kept)")
    p.add_argument("--warmup", type=_COUNT, default=2, help="untimed runs first")
    p.add_argument("--threads", type=_POSITIVE, default=1, help="torch threads while measuring (default 1)")
    p.add_argument("--time-budget", type=_SECONDS, metavar="S",
                   help="stop timing after S seconds per unit even if fewer than --repeats runs were made")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="parameter and activation dtype (bfloat16: mixed precision, fp32 master copy counted)")
    p.add_argument("--co-runners", type=_COUNT, default=0, metavar="N",
                   help="processes training the model beside the timing, as the other ranks of a CPU host do "
                        "(use ranks per host - 1 when CPU ranks share a host; default 0)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="measure on this device (default cpu)")
    p.add_argument("-o", "--output", help="profile directory (default profiles/MODEL)")
    p.set_defaults(func=_cmd_profile)

    p = sub.add_parser("profile-links", help="measure the link between local ranks (latency, bandwidth; on CPU also "
                                             "the per-message overhead and progress delay)")
    p.add_argument("--ranks", type=_POSITIVE, default=2, help="processes to start (default 2)")
    p.add_argument("--message-bytes", type=_sizes, metavar="N,N,...", help="message sizes in bytes")
    p.add_argument("--repeats", type=_POSITIVE, default=10, help="timed round trips per size (median is kept)")
    p.add_argument("--timeout", type=_SECONDS, default=120.0, help="seconds before the ranks are stopped")
    p.add_argument("--no-calibrate", action="store_true",
                   help="CPU: skip fitting the per-message overhead and progress delay on synthetic pipelines")
    p.add_argument("-o", "--output", default="profiles/links.json", help="links JSON (default profiles/links.json)")
    p.set_defaults(func=_cmd_profile_links)

    p = sub.add_parser("plan", help="choose stage boundaries and microbatches")
    p.add_argument("model", nargs="?", help="model file (profiled if profiles/MODEL is missing or stale)")
    p.add_argument("--profile", help="plan from this profile directory instead")
    p.add_argument("--devices", type=_POSITIVE, help="devices in all (pp x dp)")
    p.add_argument("--memory", type=_size, help="memory per device, e.g. 80GiB")
    p.add_argument("--cluster", help="cluster JSON with each device's memory and speed and each link "
                                     "(docs/cluster-format.md); replaces --devices/--memory/--latency/--bandwidth")
    p.add_argument("--global-batch", type=_POSITIVE, default=8, help="samples per step (default 8)")
    p.add_argument("--microbatches", type=_POSITIVE, help="pin the microbatch count per replica")
    p.add_argument("--schedule", default="1F1B", choices=["auto", *SCHEDULE_NAMES],
                   help="pipeline schedule (default 1F1B, which `autopp run` executes; auto searches all)")
    p.add_argument("--pp", type=_POSITIVE, help="pin the pipeline ranks (default devices / dp)")
    p.add_argument("--dp", type=_auto_int, help="data-parallel replicas, or auto (default 1, or devices / pp)")
    p.add_argument("--synthesize", action="store_true",
                   help="also try a CP-SAT-synthesized F/I/W order for the chosen split (always on with auto)")
    p.add_argument("--synth-time", type=_SECONDS, default=10.0, metavar="S", help="CP-SAT time limit (default 10 s)")
    p.add_argument("--links", help="links JSON from `autopp profile-links` (default: assumed loopback gloo)")
    p.add_argument("--virtual-stages", type=_POSITIVE, help="stages per rank for interleaved schedules")
    p.add_argument("--recompute", choices=["none", "all", "auto"], default="none",
                   help="activation recomputation (default none; auto: only where memory needs it)")
    p.add_argument("--latency", type=_number(0, inclusive=True), help="link latency in seconds (default: assumed loopback gloo)")
    p.add_argument("--bandwidth", type=_number(0, inclusive=False), help="link bandwidth in bytes/s")
    p.add_argument("--message-overhead", type=_number(0, inclusive=True), metavar="S",
                   help="time a rank is kept busy per message to or from another rank, besides waiting (default: "
                        f"the --links file's, else assumed for torch's schedules over gloo on CPU, "
                        f"{DEFAULT_LINK.overhead_s:g})")
    p.add_argument("--progress-delay", type=_number(0, inclusive=True), metavar="S",
                   help="longest a message waits for its sender to stop computing (default: the --links file's, "
                        f"else assumed for gloo on a CPU host whose cores all run ranks, {DEFAULT_LINK.progress_s:g}; "
                        "0 where messages move on their own, as with NCCL)")
    p.add_argument("-o", "--output", help="plan JSON path (default MODEL.plan.json)")
    p.add_argument("--pin-from", metavar="FILE",
                   help="also judge the configuration you run today (torchtitan overrides or .toml, Megatron-LM "
                        "arguments; docs/export.md) and print it beside autopp's plan")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("run", help="execute a plan with torch.distributed.pipelining and validate it")
    p.add_argument("plan", help="plan JSON")
    p.add_argument("--steps", type=_POSITIVE, default=3, help="training steps (default 3)")
    p.add_argument("--timeout", type=_SECONDS, default=300.0,
                   help="seconds before the run is stopped (default 300)")
    p.add_argument("--report", help="run report JSON path (default PLAN.report.json)")
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="also log every rank's own lines (stages built, relays, each rank's steps)")
    p.add_argument("--nnodes", type=_POSITIVE, help="run through torchrun on this many machines (docs/launch.md)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1 (default 0)")
    p.add_argument("--master-addr", default="127.0.0.1", help="address of node 0, reachable from every node")
    p.add_argument("--master-port", type=int, default=29500, help="free TCP port on node 0 (default 29500)")
    p.add_argument("--run-dir", help="keep the ranks' logs and results here (default: a temporary directory)")
    p.add_argument("--print-torchrun", action="store_true",
                   help="print the torchrun command to run on each node, and exit")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("show", help="draw a plan's simulated timeline and memory, or a run's measured timeline")
    p.add_argument("file", help="plan JSON, or a run report JSON (measured drawn above predicted)")
    p.add_argument("-o", "--output", help="PNG path (default PLAN.png)")
    p.add_argument("--trace", help="also write a Chrome/Perfetto trace JSON here")
    p.set_defaults(func=_cmd_show)

    p = sub.add_parser("export", help="write a plan for torchtitan, Megatron-LM, DeepSpeed or torch's schedule CSV")
    p.add_argument("plan", help="plan JSON")
    p.add_argument("--to", required=True, choices=TARGET_NAMES,
                   help="the trainer (docs/export.md says what maps to what)")
    p.add_argument("--profile", help="the profile the plan was made from (torchtitan needs its module names; "
                                     "default profiles/MODEL if its fingerprint matches)")
    p.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                   help="rename profiled modules to the trainer's (prefix; empty NEW drops the module), repeatable")
    p.add_argument("-o", "--output", help="output file (default PLAN.torchtitan.args, .megatron.args, "
                                          ".deepspeed.json or .schedule.csv beside the plan)")
    p.set_defaults(func=_cmd_export)
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
    except BrokenPipeError:  # the reader (e.g. `| head`) went away: stop quietly, as Unix tools do
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush from failing
        return 0


if __name__ == "__main__":
    sys.exit(main())
