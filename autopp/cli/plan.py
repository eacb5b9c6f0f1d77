"""`autopp plan`: choose stage boundaries, schedule and microbatches for a profile (measured first if needed)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..data.axes import AXES, SWITCHES, TRAINERS, Axis
from ..data.cluster import DEFAULT_LINK
from ..data.zero import ZERO, ZeroStage
from ..errors import AutoppError
from ..preflight import check_output_dir, check_output_file
from ..schedule import ScheduleName
from ..sizes import SIZE_UNITS_HELP
from .common import POSITIVE, SCHEDULE_NAMES, SECONDS, in_flags, memory_size, number
from .profile import add_hf_arguments, default_profile_dir, hf_source_of, profile_for

__all__ = ["add_parser", "DEFAULT_GLOBAL_BATCH"]

#: Samples per step when --global-batch is not given (said in one line on stderr, with the plan).
DEFAULT_GLOBAL_BATCH = 8


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """The `plan` command."""
    p = sub.add_parser("plan", help="choose stage boundaries and microbatches")
    p.add_argument("model", nargs="?", help="model file (profiled if profiles/MODEL is missing or stale)")
    p.add_argument("--profile", help="plan from this profile directory instead")
    add_hf_arguments(p)  # --hf-config C.json: profiled into profiles/C if missing or stale, like a model file
    p.add_argument("--devices", type=POSITIVE, help="devices in all (pp x dp)")
    p.add_argument("--memory", type=memory_size, metavar="SIZE",
                   help=f"memory per device, e.g. 80GiB or 80GB: {SIZE_UNITS_HELP}")
    p.add_argument("--cluster", help="cluster JSON: each device's memory and speed and each link, or nodes with "
                                     "intra- and inter-node links (docs/cluster-format.md); replaces "
                                     "--devices/--memory/--latency/--bandwidth")
    p.add_argument("--device", metavar="NAME",
                   help="device kind from the catalog (`autopp devices`) or a device JSON file (docs/devices.md): "
                        "each device's memory (unless --memory) and links come from it: devices in whole nodes "
                        "(a partly filled last node is refused) send each pipeline hop and all-reduce over the link "
                        "it crosses (intra- or inter-node; docs/cluster-format.md); no message overhead or progress "
                        "delay on GPUs, as with NCCL")
    p.add_argument("--nodes", type=POSITIVE, help="with --device: nodes, so devices = nodes x devices per node")
    p.add_argument("--devices-per-node", type=POSITIVE, metavar="K",
                   help="with --device: devices per node (default: the catalog's, 8 for the GPUs)")
    p.add_argument("--intra-node-bandwidth", type=number(0, inclusive=False), metavar="B",
                   help="with --device: intra-node link bandwidth in bytes/s per direction per device (default: "
                        "the catalog's)")
    p.add_argument("--inter-node-bandwidth", type=number(0, inclusive=False), metavar="B",
                   help="with --device: inter-node link bandwidth in bytes/s per direction per device, i.e. one "
                        "device's NIC share (default: the catalog's)")
    p.add_argument("--global-batch", type=POSITIVE,
                   help=f"samples per step (default {DEFAULT_GLOBAL_BATCH}, said on stderr: give the batch you train "
                        "with, it sets the microbatches and so the bubble)")
    p.add_argument("--microbatches", type=POSITIVE, help="pin the microbatch count per replica")
    p.add_argument("--schedule", default=ScheduleName.ONE_F_ONE_B.value, choices=["auto", *SCHEDULE_NAMES],
                   help=f"pipeline schedule (default {ScheduleName.ONE_F_ONE_B.value}; auto searches all)")
    for axis in _flag_axes():  # --pp, --dp, --tp: each axis's flag as its descriptor gives it (autopp.data.axes)
        assert axis.flag is not None
        p.add_argument(f"--{axis.name}", type=_auto_int if axis.flag.auto else POSITIVE, default=axis.flag.default,
                       help=axis.flag.help)
    sp = SWITCHES["sp"]  # --sp on|off|auto (autopp.data.axes)
    p.add_argument(f"--{sp.name}", choices=("on", "off", "auto"), default="auto", help=sp.help)
    p.add_argument("--vocab", choices=("auto", "off", "1", "2"), default="auto",
                   help="vocabulary parallelism (docs/vocabulary-parallelism.md): the embedding and the head split "
                        "along the vocabulary over the pipeline ranks, variant Vocab-1 or Vocab-2; auto (default) "
                        "chooses it where it simulates faster and the profile's model allows it (never with --for)")
    p.add_argument("--zero", type=_zero, default="0",
                   help="ZeRO stage of the data parallelism: 0 replicated, 1 optimizer state sharded, 2 + gradients "
                        "(costed only), 3 + parameters (FSDP2), or auto: 0, 1 and 3 (default 0)")
    p.add_argument("--tp-across-nodes", action="store_true",
                   help="let tensor-parallel groups span nodes (default: a group stays inside a node)")
    p.add_argument("--synthesize", action="store_true",
                   help="also try a CP-SAT-synthesized F/I/W order for the chosen split (always on with auto)")
    p.add_argument("--synth-time", type=SECONDS, default=10.0, metavar="S", help="CP-SAT time limit (default 10 s)")
    p.add_argument("--links", help="links JSON from `autopp profile-links` (default: assumed loopback gloo)")
    p.add_argument("--virtual-stages", type=POSITIVE, help="stages per rank for interleaved schedules")
    p.add_argument("--recompute", choices=["none", "all", "auto"], default="none",
                   help="activation recomputation (default none; all: full recomputation on every stage; auto: per "
                        "stage, keep, selective (when the profile has its figures), offload to host memory (when "
                        "the devices have a host link) or full recomputation, saving memory only where it is needed)")
    p.add_argument("--split", type=_indices, metavar="I,J,...",
                   help="evaluate this split instead of searching one: the unit indices where stages 1.. begin "
                        "(stages = pp x stages per rank); printed beside autopp's own choice")
    p.add_argument("--recompute-stages", type=_indices, metavar="S,...",
                   help="pin which stages recompute their activations (stage indices; the others do not)")
    p.add_argument("--latency", type=number(0, inclusive=True), help="link latency in seconds (default: assumed loopback gloo)")
    p.add_argument("--bandwidth", type=number(0, inclusive=False), help="link bandwidth in bytes/s")
    p.add_argument("--message-overhead", type=number(0, inclusive=True), metavar="S",
                   help="time a rank is kept busy per message to or from another rank, besides waiting (default: "
                        f"the --links file's, else assumed for torch's schedules over gloo on CPU, "
                        f"{DEFAULT_LINK.overhead_s:g})")
    p.add_argument("--progress-delay", type=number(0, inclusive=True), metavar="S",
                   help="longest a message waits for its sender to stop computing (default: the --links file's, "
                        f"else assumed for gloo on a CPU host whose cores all run ranks, {DEFAULT_LINK.progress_s:g}; "
                        "0 where messages move on their own, as with NCCL)")
    p.add_argument("-o", "--output", help="plan JSON path (default MODEL.plan.json)")
    p.add_argument("--for", dest="trainer", choices=TRAINERS, metavar="TRAINER",
                   help=f"search only what this trainer runs ({', '.join(TRAINERS)}: its schedules, ZeRO stages, axes "
                        "and one activation policy for every stage), and print the unrestricted plan's step beside it "
                        "(docs/export.md)")
    p.add_argument("--pin-from", metavar="FILE",
                   help="also judge the configuration you run today (torchtitan overrides or .toml, Megatron-LM "
                        "arguments; docs/export.md) and print it beside autopp's plan")
    p.set_defaults(func=_cmd_plan)


def _indices(text: str) -> tuple[int, ...]:
    """A comma list of integers >= 0 ("3,6,9")."""
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 3,6,9, got {text!r}") from None
    if any(x < 0 for x in values):
        raise argparse.ArgumentTypeError(f"indices must be >= 0, got {text!r}")
    return values


def _vocab(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """--vocab: the layouts of the vocabulary layers the search may choose (`PlanRequest.vocab`); auto is off with
    --for TRAINER, which runs none."""
    from ..data.vocab import VocabVariant
    if args.vocab in ("1", "2"):
        return (VocabVariant(f"vocab-{args.vocab}"),)
    return (None,) if args.vocab == "off" or args.trainer else (None, *VocabVariant)


def _auto_int(text: str) -> int:
    return 0 if text == "auto" else POSITIVE(text)


def _zero(text: str) -> ZeroStage | None:
    """--zero STAGE or auto (None)."""
    if text == "auto":
        return None
    if text not in tuple(map(str, ZERO)):
        raise argparse.ArgumentTypeError(f"expected a ZeRO stage {', '.join(map(str, ZERO))}, or auto, got {text!r}")
    return ZERO[int(text)]


def _flag_axes() -> tuple[Axis, ...]:
    """The axes autopp plans that have a flag, in mesh order."""
    return tuple(a for a in AXES.values() if a.flag is not None and a.unplanned is None)


def _pin(args: argparse.Namespace, axis: Axis) -> int | None:
    """The pin of `axis`'s flag: its degree, or None for auto or a flag left out whose default is searched."""
    return _dp(args) if axis.name == "dp" else getattr(args, axis.name) or None


def _dp(args: argparse.Namespace) -> int | None:
    """--dp N, auto (None), or unset: 1, or devices / pp when --pp is given, or --ep N's N (the runner's ep = dp),
    or searched with --ep auto."""
    if args.dp is None:
        ep = getattr(args, "ep", 1)
        return (ep or None) if ep != 1 else None if args.pp else 1
    return args.dp or None


def _plan_cluster(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from ..data.cluster import DEFAULT_LINK, Cluster, Link
    from ..data.cluster_file import load_cluster
    if args.device:
        return _device_cluster(args)
    if args.nodes or args.devices_per_node:
        raise AutoppError("--nodes and --devices-per-node go with --device NAME (or give a cluster file of nodes, "
                          "docs/cluster-format.md)")
    if args.intra_node_bandwidth or args.inter_node_bandwidth:
        raise AutoppError("--intra-node-bandwidth and --inter-node-bandwidth go with --device NAME (or give the "
                          "links in a cluster file of nodes, docs/cluster-format.md)")
    if args.cluster:
        for flag, value, field in (("--message-overhead", args.message_overhead, "overhead_s"),
                                   ("--progress-delay", args.progress_delay, "progress_s")):
            if value is not None:
                raise AutoppError(f"{flag} applies to --devices; with --cluster give each link's {field} in the file")
        return load_cluster(args.cluster)
    if args.devices is None or args.memory is None:
        raise AutoppError("give --devices N and --memory SIZE, --device NAME (`autopp devices`), or --cluster FILE")
    base = DEFAULT_LINK
    if args.links:
        from ..measure.links import load_link
        base = load_link(args.links)
    link = Link(latency_s=args.latency if args.latency is not None else base.latency_s,
                bandwidth_bytes_per_s=args.bandwidth or base.bandwidth_bytes_per_s,
                overhead_s=args.message_overhead if args.message_overhead is not None else base.overhead_s,
                progress_s=args.progress_delay if args.progress_delay is not None else base.progress_s)
    return Cluster(num_devices=args.devices, memory_bytes=args.memory, link=link)


def _device_cluster(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """--device NAME: memory and links from the catalog; --devices, or --nodes x --devices-per-node, devices."""
    from ..data.catalog import LinkOverrides, cluster_from_catalog, load_device
    for flag, value in (("--cluster", args.cluster), ("--links", args.links)):
        if value:
            raise AutoppError(f"give --device or {flag}, not both (--latency/--bandwidth override the device's link)")
    overrides = LinkOverrides(intra_bandwidth=args.intra_node_bandwidth, inter_bandwidth=args.inter_node_bandwidth,
                              latency_s=args.latency, bandwidth=args.bandwidth, overhead_s=args.message_overhead,
                              progress_s=args.progress_delay)
    return cluster_from_catalog(load_device(args.device), args.devices, nodes=args.nodes,
                                devices_per_node=args.devices_per_node, memory_bytes=args.memory, overrides=overrides)


def _warn_device(args: argparse.Namespace, meta) -> None:  # type: ignore[no-untyped-def]
    """--device NAME with a profile measured on (or analytic for) another device: one line on stderr."""
    import sys

    from ..data.catalog import device_mismatch, load_device
    why = device_mismatch(load_device(args.device).name, meta.device, meta.extra.get("analytic_device"))
    if why:
        print(f"autopp: warning: {in_flags(why)}", file=sys.stderr)


def _note_cores(args: argparse.Namespace, profile, cluster, plan):  # type: ignore[no-untyped-def]
    """A plan of CPU ranks (a CPU profile, and no GPU --device) with more ranks per host than this machine has
    cores: a note in the plan and one line on stderr, since the prediction assumes a core per rank (autopp.cores).
    Not when the profile was timed beside as many busy processes (--co-runners ranks - 1): it measured the sharing."""
    import sys

    from ..cores import oversubscribed, usable_cores
    from ..data.catalog import load_device
    if not profile.meta.device.startswith("cpu") or (args.device and load_device(args.device).name != "cpu"):
        return plan
    nodes = cluster.nodes
    per_host = min(plan.num_ranks, nodes.devices_per_node) if nodes else plan.num_ranks
    over = oversubscribed(per_host, usable_cores())
    if over is None or profile.meta.co_runners + 1 >= per_host:
        return plan
    note = f"if run on this machine: {over} (docs/accuracy.md)"
    print(f"autopp: warning: {note}", file=sys.stderr)
    return replace(plan, notes=(*plan.notes, note))


def _cmd_plan(args: argparse.Namespace) -> int:
    hf_source_of(args, ("--profile", "DIR"))  # one model source, checked before anything is loaded
    if args.output:
        check_output_file(args.output, "-o")
    pinned_tp = 1
    if args.pin_from:  # before a profile is loaded or measured
        from ..export import config_degrees
        pinned_tp = config_degrees(args.pin_from).get("tp", 1)
    from ..display import format_plan
    from ..data.layout import LayoutPins
    from ..solve import PlanRequest, RecomputeMode, make_plan
    pins = LayoutPins(v=args.virtual_stages, zero=args.zero, sp={"on": True, "off": False}.get(args.sp),
                      **{a.name: _pin(args, a) for a in _flag_axes()})
    request = PlanRequest(cluster=_plan_cluster(args), global_batch=args.global_batch or DEFAULT_GLOBAL_BATCH,
                          num_microbatches=args.microbatches,
                          schedule=None if args.schedule == "auto" else ScheduleName(args.schedule),
                          pins=pins, tp_across_nodes=args.tp_across_nodes,
                          recompute=RecomputeMode(args.recompute), recompute_stages=args.recompute_stages,
                          synthesize=args.synthesize or args.schedule == "auto" and _synthesizes(args.trainer),
                          synth_time_limit_s=args.synth_time, trainer=args.trainer, vocab=_vocab(args))
    given = None
    if args.profile:
        from ..data.profile import load_profile
        given = load_profile(args.profile)
        stem = Path(given.meta.model_path).stem
        profile_dir = Path(args.profile)
    else:
        default = profile_dir = default_profile_dir(args)
        stem = default.name
        if not (default / "meta.json").is_file():  # it will be profiled and saved there
            check_output_dir(default, marker="meta.json", kind="profile")
    out = check_output_file(args.output or f"{stem}.plan.json", "-o" if args.output else None)
    if args.split:
        from ..solve.assemble.pinned import check_split
        check_split(request, given, args.split)  # plan_split: again, once profiled
    # the profile's TP rows: the request's, and the --pin-from file's tp too
    profile = given or profile_for(args, pins.tp if pinned_tp in (1, pins.tp) else pinned_tp if pins.tp == 1 else None)
    if args.device:
        _warn_device(args, profile.meta)
    pinned = _read_pin(args, profile, request) if args.pin_from else None
    if args.split:
        from ..solve.assemble.pinned import plan_split
        plan = plan_split(profile, request, args.split)
    else:
        plan = make_plan(profile, request)
    plan = _note_cores(args, profile, request.cluster, replace(plan, profile_path=str(profile_dir)))
    plan.save(out)
    if args.global_batch is None:  # issue 26: a default that changes the answer is said
        print(f"autopp: note: global batch {DEFAULT_GLOBAL_BATCH} samples per step (the default); give --global-batch "
              "N, the batch you train with (it sets the microbatches, and so the bubble)", file=sys.stderr)
    if pinned is not None:  # issue 26: the first screen is yours beside autopp's, the plan's table after it
        from ..export.compare import format_comparison
        from ..solve import evaluate_pinned
        print(format_comparison(evaluate_pinned(profile, request.cluster, pinned[0]), plan, args.pin_from,
                                pinned[1]).lstrip("\n") + "\n\nautopp's plan in full:")
    print(format_plan(replace(plan, notes=tuple(map(in_flags, plan.notes)))))  # the file's notes name fields
    print(f"\nwrote plan {out}")
    if args.trainer and not args.split:
        print(_unrestricted(profile, request, plan))
    return 0


def _read_pin(args: argparse.Namespace, profile, request):  # type: ignore[no-untyped-def]
    """--pin-from: the user's trainer configuration (checked before the search and before anything is written) and
    notes on how it is judged."""
    from ..export import read_pinned
    from ..solve.assemble.pinned import check_pinned
    pinned, notes = read_pinned(args.pin_from, profile.meta.unit_names, request.cluster.num_devices)
    check_pinned(pinned, profile.num_units, request.cluster.num_devices)
    c = pinned.candidate
    batch = c.microbatches * c.microbatch_size * c.layout.dp
    if batch != request.global_batch:
        raise AutoppError(f"{args.pin_from}: its global batch is {batch}, --global-batch is {request.global_batch}; "
                          f"give --global-batch {batch} so both plans train the same batch")
    return pinned, notes


def _synthesizes(trainer: str | None) -> bool:
    """Whether `--schedule auto` tries a synthesized order: always, unless the trainer of --for runs none."""
    from ..data.trainers import trainer_rules
    return trainer is None or trainer_rules(trainer).synthesized


def _unrestricted(profile, request, plan) -> str:  # type: ignore[no-untyped-def]
    """--for TRAINER: the step of the plan without the restriction, and the price of it."""
    from ..display import format_grid
    from ..errors import InfeasibleError
    from ..sizes import format_time
    from ..solve import make_plan
    free = replace(request, trainer=None, synthesize=request.synthesize or request.schedule is None)
    try:
        other = make_plan(profile, free)
    except InfeasibleError:  # cannot happen for a superset of a feasible search; said, not hidden
        return f"\nwithout --for {request.trainer}: no plan fits either"
    mine, theirs = plan.predicted.step_time_s, other.predicted.step_time_s
    return (f"\nwithout --for {request.trainer}: {other.schedule.value} {format_grid(other.layout)}, "
            f"{other.num_microbatches} microbatches of {other.microbatch_size}: step {format_time(theirs)}; "
            f"the restriction to {request.trainer} costs {mine / theirs - 1:+.1%}")
