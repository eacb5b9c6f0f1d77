"""`autopp plan`: choose stage boundaries, schedule and microbatches for a profile (measured first if needed)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ..data.axes import AXES, SWITCHES, TRAINERS, Axis
from ..data.batch import SAMPLES_PER_DEVICE, TOKENS_PER_STEP, default_global_batch_said
from ..data.cluster import DEFAULT_LINK
from ..data.overlap import NO_OVERLAP, Overlap
from ..data.trainers import frees_outputs
from ..data.zero import ZERO, ZeroStage
from ..errors import AutoppError
from ..preflight import check_output_dir, check_output_file
from ..schedule import POLICIES, ScheduleName
from ..sizes import SIZE_UNITS_HELP
from .common import (COUNT, POSITIVE, SCHEDULE_NAMES, SECONDS, end_progress, in_flags, memory_size, number,
                     progress, shown_progress)
from .pin_from import batch_of, pinned_seq_len, read_pin
from .plan_cluster import plan_cluster
from ..data.precision import counted_kernels
from .analytic import add_kernels_argument
from .profile import (add_hf_arguments, add_optimizer_argument, add_precision_argument, default_profile_dir,
                      hf_source_of, profile_for)

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[Any]) -> None:
    """The `plan` command."""
    p = sub.add_parser("plan", help="choose the layout, schedule, microbatches and stage boundaries",
                       description="Every choice a flag below leaves out is searched (the schedule, microbatches, "
                                   "dp, tp, ZeRO stage, activation policy per stage, sequence parallelism, stages "
                                   "per rank); a flag pins it and narrows the search.")
    p.add_argument("model", nargs="?", help="model file (profiled if profiles/MODEL is missing or stale)")
    p.add_argument("--profile", help="plan from this profile directory instead")
    add_hf_arguments(p)  # --hf-config C.json: profiled into profiles/C if missing or stale, like a model file
    p.add_argument("--devices", type=POSITIVE, help="devices in all (pp x dp x tp)")
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
    p.add_argument("--memory-reserve", type=_reserve, metavar="SIZE",
                   help="memory each device keeps beside the plan's tensors (CUDA context, NCCL buffers, allocator "
                        "fragmentation), taken from its memory, or 0 (default: 3GiB of a catalog GPU's own memory; none "
                        "of a --memory given, nor on CPU ranks; docs/devices.md)")
    p.add_argument("--overlap", type=_overlap, metavar="WHAT,...", help="collectives assumed hidden under compute, as "
                   "the trainers overlap them: fsdp-prefetch (FSDP2's per-layer all-gather and reduce-scatter at pp "
                   "1), grad-reduce (the data-parallel gradient reduction under the last backward), async-tp "
                   "(sequence-parallel collectives pipelined with their matmuls), ep-a2a (expert all-to-alls under "
                   "another microbatch's compute: Megatron's EP A2A overlap), or none (default: "
                   "fsdp-prefetch,grad-reduce on a GPU --device, as torchtitan and Megatron-LM run; none on CPU "
                   "ranks, as autopp run does; docs/parallelism.md#overlap)")
    add_precision_argument(p)  # the recipe of the profile plan makes (--device NAME: counted for NAME)
    add_kernels_argument(p)
    add_optimizer_argument(p)  # and the optimizer whose state it counts
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
                   help=f"samples per step over all replicas. Default, said on stderr: for a model with a sequence "
                        f"length (--hf-config), about {TOKENS_PER_STEP // 2**20}M tokens, 2^20 / seq_len sequences "
                        f"rounded to a power of two; else {SAMPLES_PER_DEVICE} per device. Give the batch you train "
                        "with: it sets the microbatches, and so the bubble")
    p.add_argument("--microbatches", type=POSITIVE, help="pin the microbatch count per replica (default: searched)")
    p.add_argument("--schedule", default="auto", choices=["auto", *SCHEDULE_NAMES],
                   help="pipeline schedule, or auto (default): every named schedule, sequence pipelining for causal "
                        "LMs (docs/sequence-pipelining.md), and a CP-SAT-synthesized order for the best split unless "
                        "the trainer of --for runs none")
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
    p.add_argument("--zero", type=_zero, default="auto",
                   help="ZeRO stage of the data parallelism: 0 replicated, 1 optimizer state sharded, 2 + gradients "
                        "(costed only), 3 + parameters (FSDP2), or auto (default): 0, 1 and 3 (those of --for's "
                        "trainer), where dp > 1")
    p.add_argument("--dp-replicate", type=_auto_int, default=1, metavar="N",
                   help="HSDP (with --zero 1 or 3): ZeRO shards over dp / N neighbouring ranks (inside a node when "
                        "they fit one) and the N groups all-reduce their shards' gradients, as torchtitan's "
                        "data_parallel_replicate_degree; or auto: 1 and every divisor of dp below it (default 1: "
                        "shard over all dp). Exported to torchtitan only")
    p.add_argument("--tp-across-nodes", action="store_true",
                   help="let tensor-parallel groups span nodes (default: a group stays inside a node)")
    p.add_argument("--synthesize", action="store_true",
                   help="also try a CP-SAT-synthesized F/I/W order for the chosen split (always on with auto)")
    p.add_argument("--synth-time", type=SECONDS, default=10.0, metavar="S", help="CP-SAT time limit (default 10 s)")
    p.add_argument("--judge-budget", type=COUNT, metavar="N",
                   help="configurations the branch and bound after the short-list may judge in order of their lower "
                        "bounds (default 2000, `PlanRequest.judge_budget`; 0: the short-list alone, faster, without "
                        "the proof that no other configuration is more than 1 %% faster; docs/planner.md, Algorithms)")
    p.add_argument("--links", help="links JSON from `autopp profile-links` (default: assumed loopback gloo)")
    p.add_argument("--virtual-stages", type=POSITIVE,
                   help="stages per rank for interleaved schedules (default: searched, 2 and 4)")
    p.add_argument("--recompute", choices=["none", "all", "auto"],
                   help="activation recomputation: none; all: whole-stage recomputation on every stage (no "
                   "trainer of --for applies it); auto (default, unless --recompute-stages): per stage, one of "
                   f"the activation policies {', '.join(a.value for a in POLICIES)} (docs/plan-format.md) that "
                   "the profile has figures for and the devices allow (offload: a host link), saving memory only "
                   "where it is needed (with --for, one policy for every stage, one the trainer applies)")
    p.add_argument("--split", type=_indices, metavar="I,J,...",
                   help="evaluate this split instead of searching one: the unit indices where stages 1.. begin "
                        "(stages = pp x stages per rank); printed beside autopp's own choice")
    p.add_argument("--recompute-stages", type=_indices, metavar="S,...",
                   help="pin which stages recompute their activations (stage indices; the others keep theirs: "
                        "--recompute none, or no --recompute)")
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
                        "arguments; docs/export.md) and print it beside autopp's plan, searched for its global batch "
                        "(unless --global-batch) and its trainer (unless --for)")
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


#: --overlap's words and the `Overlap` field each sets.
_OVERLAPS = {f.name.replace("_", "-"): f.name for f in fields(Overlap)}


def _overlap(text: str) -> Overlap:
    words = [w.strip() for w in text.split(",") if w.strip()]
    if words == ["none"]:
        return NO_OVERLAP
    bad = [w for w in words if w not in _OVERLAPS]
    if bad or not words:
        alone = " alone" if bad and bad[0] == "none" else ""  # a tester's none,grad-reduce
        raise argparse.ArgumentTypeError(f"{bad[0] if bad else text!r} is not one of {', '.join(_OVERLAPS)} "
                                         f"(comma-separated) or none{alone}")
    return Overlap(**{field: word in words for word, field in _OVERLAPS.items()})


def _reserve(text: str) -> int:
    """--memory-reserve: a size, or 0 for none."""
    return 0 if text.strip() == "0" else memory_size(text)


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
    """The pin of `axis`'s flag: its degree, or None for auto or a flag left out, searched (dp beside --ep N among
    N's multiples: a tester's --ep 8 pinned dp 8 until 2026-12-06, 12 % slower than the dp 32 --ep auto found)."""
    return getattr(args, axis.name) or None


def _profiled_tp(args: argparse.Namespace, pins) -> int | None:  # type: ignore[no-untyped-def]
    """The `tp` of `profile_for`: the pinned degree; every degree the TP plan allows (None) for `--tp auto` or a
    profile counted for --device; else 1 (no rows measured here unless asked for: tp searched over what exists)."""
    from .profile import analytic_target
    if pins.tp is not None or args.tp == 0 or analytic_target(args.device) is not None:
        return pins.tp
    return 1


def _global_batch(args: argparse.Namespace, cluster, given) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    """--global-batch, or the default (`default_global_batch`) and the line that says it (else ""): from the
    sequence length of --hf-config or of the --profile's HF model, else from the devices."""
    if args.global_batch:
        return int(args.global_batch), ""
    source = hf_source_of(args, ("--profile", "DIR"))
    hf = given.meta.extra.get("hf_config") if given is not None else None
    seq = source.seq_len if source is not None else hf.get("seq_len") if isinstance(hf, dict) else None
    dp = args.dp if isinstance(args.dp, int) and args.dp > 0 else 1
    batch, what = default_global_batch_said(cluster.num_devices, seq, args.microbatches or 1, dp)
    return batch, f"autopp: note: global batch {what}; give --global-batch N, the batch you train with (it sets " \
                  "the microbatches, and so the bubble)"


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
    pinned_tp, implied = 1, ""
    if args.pin_from:  # before a profile is loaded or measured
        from ..export import config_degrees, config_trainer
        pinned_tp = config_degrees(args.pin_from).get("tp", 1)
        if args.trainer is None:  # judged beside a plan its own trainer runs
            args.trainer = config_trainer(args.pin_from)
            implied = f"autopp: note: --for {args.trainer}, the trainer of {args.pin_from} (--for TRAINER: another)"
    seq_said = pinned_seq_len(args)  # its sequence length profiled, before the default batch is derived from it
    from ..display import format_plan
    from ..data.layout import LayoutPins
    from ..solve import PlanRequest, RecomputeMode, make_plan
    from ..data.trainers import trainer_rules
    cluster = plan_cluster(args)
    pins = LayoutPins(v=args.virtual_stages, zero=args.zero, sp={"on": True, "off": False}.get(args.sp),
                      dp_replicate=args.dp_replicate or None,
                      **{a.name: _pin(args, a) for a in _flag_axes()})
    request = PlanRequest(cluster=cluster, global_batch=_global_batch(args, cluster, None)[0],
                          num_microbatches=args.microbatches,
                          schedule=None if args.schedule == "auto" else ScheduleName(args.schedule),
                          pins=pins, tp_across_nodes=args.tp_across_nodes,
                          recompute=RecomputeMode(args.recompute or ("none" if args.recompute_stages else "auto")),
                          recompute_stages=args.recompute_stages,
                          synthesize=args.synthesize or args.schedule == "auto" and (  # unless --for runs none
                              args.trainer is None or trainer_rules(args.trainer).synthesized),
                          synth_time_limit_s=args.synth_time, trainer=args.trainer, overlap=args.overlap,
                          ties=True, vocab=_vocab(args),
                          **({} if args.judge_budget is None else {"judge_budget": args.judge_budget}))
    given = None
    if args.profile:  # after the request's checks: a bad flag costs no profile load
        from ..data.profile import load_profile
        given = load_profile(args.profile)
        if args.precision:
            raise AutoppError(f"--precision goes with a profile that plan makes; {args.profile} was made for "
                              f"{given.meta.extra.get('precision') or given.meta.dtype}: drop --precision")
        if args.optimizer:
            raise AutoppError(f"--optimizer goes with a profile that plan makes; {args.profile} counts "
                              f"{given.meta.optimizer}'s state: drop --optimizer")
        counted = counted_kernels(given.meta.extra)
        if args.kernels and args.kernels != counted:
            raise AutoppError(f"--kernels {args.kernels}: {args.profile} times "
                              f"{f'{counted} kernels' if counted else 'the kernels that ran (measured)'}; count a "
                              f"profile with `autopp profile ... --analytic DEVICE --kernels {args.kernels}` and plan "
                              "from it, or drop --kernels")
    batch, said = _global_batch(args, cluster, given)  # a --profile's sequence length known now
    request = replace(request, global_batch=batch)
    if given is not None:
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
    # the profile's TP rows: the request's (`_profiled_tp`), and the --pin-from file's tp too
    tp = _profiled_tp(args, pins)
    profile = given or profile_for(args, tp if pinned_tp in (1, tp) else pinned_tp if tp == 1 else None)
    if args.device:
        _warn_device(args, profile.meta)
    from ..export import trainer_model_problem  # what the trainer's export would refuse, before the search
    if args.trainer and (why := trainer_model_problem(args.trainer, profile)):
        raise AutoppError(f"--for {args.trainer}: {why}")
    pinned = read_pin(args, profile, request) if args.pin_from else None
    if pinned is not None and not args.global_batch:  # the batch of the configuration judged beside autopp's
        batch = batch_of(pinned[0])
        request, said = replace(request, global_batch=batch), f"autopp: note: global batch {batch} samples per " \
            f"step, that of {args.pin_from} (the default with --pin-from); give --global-batch N to plan another"
    _say_search(request)
    if args.split:
        from ..solve.assemble.pinned import plan_split
        plan = plan_split(profile, request, args.split)
    else:
        with shown_progress("planning"):  # CP-SAT's solves, each with the time left of its limit
            plan = make_plan(profile, request)
    end_progress()
    for line in filter(None, (seq_said, said, implied)):  # issue 26: a default that changes the answer is said
        print(line, file=sys.stderr)
    plan = _note_cores(args, profile, request.cluster, replace(plan, profile_path=str(profile_dir)))
    plan.save(out)
    if pinned is not None:  # issue 26: the first screen is yours beside autopp's, the plan's table after it
        from ..export.compare import format_comparison
        from ..solve import evaluate_pinned
        yours = evaluate_pinned(profile, request.cluster, pinned[0], frees_outputs(args.trainer, None), request.overlap)
        print(in_flags(format_comparison(yours, plan, args.pin_from, pinned[1], request.pins)).lstrip("\n")
              + "\n\nautopp's plan in full:")
    print(format_plan(replace(plan, notes=tuple(map(in_flags, plan.notes)))))  # the file's notes name fields
    print(f"\nwrote plan {out}")
    if args.trainer and not args.split:
        print(_unrestricted(profile, request, plan))
    return 0


def _say_search(request) -> None:  # type: ignore[no-untyped-def]
    """A progress line while the search runs (on a terminal cleared with the plan; in a log a line): what it searches
    (the choices no flag pinned) and CP-SAT's time bound."""
    pins = request.pins
    free = [name for name, free in (
        ("schedule", request.schedule is None), ("microbatches", request.num_microbatches is None),
        *((a.name, getattr(pins, a.name) is None) for a in _flag_axes()), ("ZeRO stage", pins.zero is None),
        ("activation policy", request.recompute_stages is None and len(request.allowed()) > 1),
        ("sp", pins.sp is None), ("stages per rank", pins.v is None),
        ("dp_replicate", pins.dp_replicate is None)) if free]
    synth = f"; then CP-SAT synthesizes an order for at most {request.synth_time_limit_s:g} s (--synth-time)" \
        if request.synthesize else ""
    progress("planning")(f"searching {', '.join(free) or 'the split only'} (a flag pins each){synth}")


def _unrestricted(profile, request, plan) -> str:  # type: ignore[no-untyped-def]
    """--for TRAINER: the step of the plan without the restriction, and the price of it."""
    from ..display import format_grid, format_microbatches
    from ..errors import InfeasibleError
    from ..sizes import format_time
    from ..solve import make_plan
    free = replace(request, trainer=None, synthesize=request.synthesize or request.schedule is None,
                   frees_outputs=frees_outputs(request.trainer, request.frees_outputs))
    try:
        other = make_plan(profile, free)
    except InfeasibleError:  # cannot happen for a superset of a feasible search; said, not hidden
        return f"\nwithout --for {request.trainer}: no plan fits either"
    mine, theirs = plan.predicted.step_time_s, other.predicted.step_time_s  # a faster restricted plan: other is a tie
    cost = f"the restriction to {request.trainer} costs {mine / theirs - 1:+.1%}" + (
        " (the unrestricted choice is a tie inside its step band, kept by the tie rule)" if mine < theirs else "")
    return (f"\nwithout --for {request.trainer}: {other.schedule.value} {format_grid(other.layout)}, "
            f"{format_microbatches(other.num_microbatches, other.microbatch_size)}: step {format_time(theirs)}; {cost}")
