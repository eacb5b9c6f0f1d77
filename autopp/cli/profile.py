"""`autopp profile` and `autopp profile-links`: measure a model's units, or the link between local ranks."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data.precision import RECIPES, Recipe, counted_kernels, recipe, recipe_of_dtype
from ..data.hf_config import DEFAULT_SEQ_LEN, DEFAULT_TASK, HF_TASKS, HfSource, hf_source
from ..data.tp_plan import tp_outdated
from ..errors import AutoppError
from ..preflight import check_model_file, check_output_dir, check_output_file
from ..sizes import format_in, time_unit
from .analytic import (add_analytic_arguments, add_kernels_argument, analytic_of, check_analytic, check_kernels,
                       kernels_of)
from .common import (COUNT, DEFAULT_PROFILE_DIR, POSITIVE, SECONDS, analytic_target, comma_sizes, default_dtype,
                     default_profile_dir, end_progress, model_stem, profile_dir_name, progress)

if TYPE_CHECKING:
    from ..data.profile import Profile
    from ..measure.options import DType, MeasureOptions, ProfileOptions
    from ..model.contract import ModelFile

__all__ = ["say_seq_len", "add_parsers", "profile_for", "default_profile_dir", "analytic_target", "default_dtype",
           "add_hf_arguments", "hf_source_of", "model_stem", "add_precision_argument", "precision_of",
           "add_optimizer_argument"]


def add_parsers(sub: argparse._SubParsersAction[Any]) -> None:
    """The `profile` and `profile-links` commands."""
    p = sub.add_parser("profile", help="measure each unit of a model file (or of a model built from an HF config)")
    p.add_argument("model", nargs="?", help="model file following the contract in README.md")
    add_hf_arguments(p)
    p.add_argument("--microbatch-sizes", type=comma_sizes, default=[1, 4], metavar="B,B,...",
                   help="microbatch sizes to measure (default 1,4); the cost model interpolates between them")
    p.add_argument("--microbatch-size", type=POSITIVE, help="measure this one size only")
    add_optimizer_argument(p)
    p.add_argument("--repeats", type=POSITIVE, default=5, help="timed runs per unit, the median kept (default 5)")
    p.add_argument("--warmup", type=COUNT, default=2, help="untimed runs first (default 2)")
    p.add_argument("--threads", type=POSITIVE, default=1, help="torch threads while measuring (default 1)")
    p.add_argument("--time-budget", type=SECONDS, metavar="S",
                   help="stop timing after S seconds per unit even if fewer than --repeats runs were made")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="parameter and activation dtype (bfloat16: mixed precision, fp32 master weights and "
                        "optimizer state counted). Default: bfloat16 for a GPU (--analytic GPU or --device cuda), "
                        "float32 on the CPU")
    add_precision_argument(p)
    p.add_argument("--co-runners", type=COUNT, default=0, metavar="N",
                   help="processes training the model beside the timing, as the other ranks of a CPU host do "
                        "(use ranks per host - 1 when CPU ranks share a host; default 0)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="measure on this device (default cpu)")
    p.add_argument("--measure-every-unit", action="store_true",
                   help="measure every unit, also those of the same structure and input shapes as an earlier one "
                        "(default: measured once, shared; docs/profile-format.md)")
    p.add_argument("--tp", type=comma_sizes, metavar="T,T,...",
                   help="also profile these tensor-parallel degrees (tp.csv; the model needs a TP plan: TP_PLAN in "
                        "the model file or an HF base_model_tp_plan). Default: none when measuring; with --analytic, "
                        "every degree up to the device's devices per node that the plan allows")
    add_analytic_arguments(p)
    p.add_argument("-o", "--output", help="profile directory (default profiles/MODEL, or profiles/CONFIG for "
                                          "--hf-config C.json)")
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


def add_precision_argument(p: argparse.ArgumentParser) -> None:
    """--precision RECIPE: the mixed-precision recipe a GPU profile is counted for (autopp.data.precision)."""
    p.add_argument("--precision", choices=list(RECIPES), metavar="RECIPE",
                   help=f"mixed-precision recipe ({', '.join(RECIPES)}; docs/analytic.md): its peaks (fp8: linear "
                        "layers' matmuls at the FP8 peak) and bytes per parameter (bf16-pure: bf16 weights, gradients "
                        "and optimizer state, no master copy). Default: bf16 for a GPU, fp32 on "
                        "the CPU; fp8 is counted (--analytic DEVICE) only")


def add_optimizer_argument(p: argparse.ArgumentParser) -> None:
    """--optimizer NAME: the optimizer whose state the profile counts (`optimizer_of`)."""
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam", "adamw"],
                   help="the optimizer whose state the profile counts and whose step it times (sgd none, momentum "
                        "one, adam(w) two fp32 values a parameter). Default: adamw for a GPU, sgd on the CPU")


def optimizer_of(args: argparse.Namespace, gpu: bool) -> str:
    """--optimizer, else adamw for a GPU and sgd on the CPU (`add_optimizer_argument`)."""
    return str(getattr(args, "optimizer", None) or ("adamw" if gpu else "sgd"))


def precision_of(args: argparse.Namespace, gpu: bool) -> Recipe:
    """The recipe asked for: --precision, else --dtype's (where the command has it), else the default for the
    target (`default_dtype`); an AutoppError for a --dtype the recipe does not compute in."""
    dtype = getattr(args, "dtype", None)
    if args.precision is None:
        found = recipe_of_dtype(dtype or default_dtype(gpu))
        if found is None:
            raise AutoppError(f"no --precision computes in --dtype {dtype}; give --precision")
        return found
    chosen = recipe(args.precision)
    if dtype is not None and dtype != chosen.dtype:
        raise AutoppError(f"--precision {chosen} computes in {chosen.dtype}, not --dtype {dtype}; drop --dtype")
    return chosen


def add_hf_arguments(p: argparse.ArgumentParser) -> None:
    """--hf-config, --seq-len, --task: a model built from a Hugging Face config.json instead of a model file."""
    p.add_argument("--hf-config", metavar="C.json",
                   help="build the model from this Hugging Face config.json (random weights, no download) instead "
                        "of a model file; batch: random token ids, loss: the task's (docs/models.md)")
    p.add_argument("--seq-len", type=POSITIVE, metavar="S",
                   help=f"with --hf-config: tokens per sample (default {DEFAULT_SEQ_LEN}, or the config's "
                        "max_position_embeddings if smaller)")
    p.add_argument("--task", choices=HF_TASKS,
                   help=f"with --hf-config: the model's head and loss (default {DEFAULT_TASK})")


def hf_source_of(args: argparse.Namespace, *others: tuple[str, str]) -> HfSource | None:
    """The checked --hf-config source (torch-free), or None when a model file is given (checked here too); exactly
    one of MODEL, --hf-config and `others` (flag, metavar: flags that replace both, e.g. --profile DIR) is given."""
    flags = [(flag, metavar, getattr(args, flag.lstrip("-").replace("-", "_"))) for flag, metavar in others]
    sources = [("MODEL.py", "", args.model), *flags, ("--hf-config", "C.json", args.hf_config)]
    given = [name for name, _, value in sources if value]
    if len(given) != 1:
        names = " or ".join(f"{name} {metavar}".strip() for name, metavar, _ in sources)
        raise AutoppError(f"give either {names} (one of them), got {' and '.join(given) if given else 'none'}")
    if not args.hf_config:
        for flag, value in (("--seq-len", args.seq_len), ("--task", args.task)):
            if value is not None:
                raise AutoppError(f"{flag} applies to --hf-config only (a model file's sample_batch sets its own "
                                  "shapes and loss)")
        if args.model:
            check_model_file(args.model)
        return None
    return hf_source(args.hf_config, args.seq_len, args.task or DEFAULT_TASK)


def say_seq_len(args: argparse.Namespace, source: HfSource | None) -> None:
    """--hf-config without --seq-len: the sequence length taken, in one line on stderr (issue 26: a default that
    changes the answer is said; activations grow with it); after the work, so that an error stays one line."""
    if source is not None and args.seq_len is None:
        capped = "" if source.seq_len == DEFAULT_SEQ_LEN else f", capped by the config's {source.seq_len} positions"
        print(f"autopp: note: sequence length {source.seq_len} tokens (the default{capped}); give --seq-len S, the "
              "length you train with (activation memory and time grow with it)", file=sys.stderr)


def _profiled(model: str | ModelFile, source: HfSource | None, *options: Any) -> Profile:
    """profile_model of the model file, or of the model built from the HF config `source`, whose profile records
    in `meta.extra["hf_config"]` the sequence length and task it was built for (its `model_path` is the config);
    `options`: its ProfileOptions and MeasureOptions (none: the defaults)."""
    from ..measure import profile_model  # torch: only once the arguments are known to be good
    return _with_source(profile_model(model, *options, progress=progress("profiling")), source)


def _options(args: argparse.Namespace) -> tuple[ProfileOptions, MeasureOptions | None]:
    """What `autopp profile` asked for: the ProfileOptions (without --tp: no degree when measuring, every one the
    plan allows with --analytic) and, when measuring, the MeasureOptions."""
    from ..measure import MeasureOptions, ProfileOptions  # torch: only once the arguments are known to be good
    sizes = [args.microbatch_size] if args.microbatch_size else args.microbatch_sizes
    tp = args.tp if args.tp is not None else (None if args.analytic else ())
    options = ProfileOptions(microbatch_sizes=sizes, optimizer=args.optimizer, dtype=args.dtype,
                             precision=args.precision, tp_degrees=tp)
    if args.analytic:
        return options, None
    return options, MeasureOptions(warmup=args.warmup, repeats=args.repeats, threads=args.threads,
                                   time_budget_s=args.time_budget, device=args.device, co_runners=args.co_runners,
                                   measure_every_unit=args.measure_every_unit)


def _with_source(profile: Profile, source: HfSource | None) -> Profile:
    """`profile`, recording in `meta.extra["hf_config"]` the HF config's sequence length and task it was built for."""
    if source is None:
        return profile
    return replace(profile, meta=replace(profile.meta, extra={**profile.meta.extra, "hf_config": source.to_json()}))


def _model_of(args: argparse.Namespace, source: HfSource | None) -> ModelFile:
    """The model file, or the ModelFile built from the HF config (torch, and for a config transformers, load here):
    autopp.model.hf.load_model, as a profile's model is loaded again from its `model_path` and `extra.hf_config`."""
    from ..model.hf import load_model
    return load_model(source.config_path, source.to_json()) if source else load_model(args.model)


def _for_gpu(args: argparse.Namespace) -> bool:
    """Whether `autopp profile` profiles for a GPU: --analytic of a catalog GPU, or --device cuda."""
    return (analytic_target(args.analytic) is not None) if args.analytic else args.device == "cuda"


def _resolve_dtype(args: argparse.Namespace) -> None:
    """--precision and --dtype: the recipe (`precision_of`) and the dtype it computes in; both left out for a GPU
    (--analytic of a catalog GPU, or --device cuda): bf16, said in one line on stderr. A recipe other than its
    dtype's peaks (fp8) is counted only."""
    gpu = _for_gpu(args)
    chosen, said = precision_of(args, gpu), args.dtype is None and args.precision is None
    if chosen.matmul_peak != chosen.peak and not args.analytic:
        raise AutoppError(f"--precision {chosen} is counted, not measured: give --analytic DEVICE (the profiler runs "
                          "the model's own layers, no FP8 matmuls)")
    args.dtype, args.precision = chosen.dtype, chosen.name
    if gpu and said:
        print(f"dtype {args.dtype} (mixed precision, the default for a GPU: fp32 master weights and optimizer state "
              "counted); --dtype float32 to change", file=sys.stderr)
    args.optimizer = optimizer_of(args, gpu)  # said with the profile written


def _cmd_profile(args: argparse.Namespace) -> int:
    source = hf_source_of(args)
    if source is not None and args.co_runners:
        raise AutoppError("--co-runners is not supported with --hf-config yet (co-runner processes load a model "
                          "file); profile without it")
    check_kernels(args)
    _resolve_dtype(args)
    check_analytic(args)
    from ..data.catalog import load_device  # the catalog's name, as `autopp plan --device` names the directory
    device = load_device(args.analytic).name if args.analytic else None
    target = check_output_dir(args.output or DEFAULT_PROFILE_DIR / profile_dir_name(args, device, _for_gpu(args)),
                              "-o" if args.output else None, marker="meta.json", kind="profile")
    from ..display import format_profile
    try:
        options, measuring = _options(args)
        if measuring is None:  # counted on meta, timed by the catalog device's roofline (autopp.cli.analytic)
            profile = _with_source(analytic_of(args, _model_of(args, source), options), source)
        else:
            profile = _profiled(_model_of(args, source), source, options, measuring)
    except ValueError as exc:
        raise AutoppError(str(exc)) from None
    end_progress()
    out = profile.save(target)
    say_seq_len(args, source)
    print(format_profile(profile))
    for whole in profile.meta.whole_model:
        unit = time_unit((whole["units_s"], whole["whole_s"]))
        print(f"microbatch {whole['microbatch_size']}: units sum to {format_in(whole['units_s'], unit)}, one "
              f"whole-model step takes {format_in(whole['whole_s'], unit)} (gap {whole['gap']:+.1%})")
    meta = profile.meta
    if meta.runtime_forward_s or meta.runtime_backward_s:
        unit = time_unit((meta.runtime_forward_s, meta.runtime_backward_s))
        print(f"torch's pipelining runtime per action: F {format_in(meta.runtime_forward_s, unit)}, B "
              f"{format_in(meta.runtime_backward_s, unit)} (added once to each action of every stage); an action "
              f"after a wait: {format_in(meta.resume_s, time_unit((meta.resume_s,)))} more")
    from ..data.profile import ValueAction
    relayed = [v for v in profile.meta.live_values if v.action is not ValueAction.SEND]
    for v in relayed:
        print(f"value {v.name} from unit {v.src} is read by units {list(v.dsts)}: {v.action.value}")
    for g in profile.meta.tied_parameters:
        print(f"tied parameters {', '.join(g.names)} (units {list(g.units)}): one tensor, a copy per unit that uses it")
    if profile.meta.tp_degrees:
        print(f"tensor-parallel rows (tp.csv) at tp {', '.join(map(str, profile.meta.tp_degrees))}: plan "
              f"{profile.meta.tp_plan_source}")
    if profile.meta.extra.get("tp_skipped"):
        print(f"no tensor-parallel rows: {profile.meta.extra['tp_skipped']}")
    print(f"\nwrote profile {out}/ ({profile.num_units} units, microbatch sizes {list(profile.meta.microbatch_sizes)}, "
          f"optimizer {profile.meta.optimizer}'s state: --optimizer)")
    return 0


def _cmd_profile_links(args: argparse.Namespace) -> int:
    check_output_file(args.output, "-o")
    from ..measure.calibration import format_link_calibration
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
        print(format_link_calibration(links.calibration))
    link = links.link()
    fitted = "default, not calibrated" if links.overhead_s is None else "calibrated"
    print(f"per-message overhead {link.overhead_s * 1e6:.3g} us ({fitted}), progress delay "
          f"{link.progress_s * 1e3:.3g} ms"
          + (f"; calibration rms error {links.calibration_rms:.1%}" if links.calibration_rms is not None else ""))
    print(f"\nwrote links {links.save(args.output)}")
    return 0


def _current(profile: Profile, fingerprint: str, recorded: dict[str, Any] | None, device: str | None,
             degrees: tuple[int, ...] | None, precision: str, routing: dict[str, Any] | None = None,
             optimizer: str | None = None, tp_plan: dict[str, str] | None = None, kernels: str = "eager"
             ) -> str | None:
    """Why `profile` is not the one `autopp plan` needs (None: it is): another model, sequence length or task,
    recipe, optimizer (when given), device, elementwise `kernels` (an analytic profile's `extra.analytic.kernels`;
    absent: counted before the choice, eager), TP rows not those needed (`tp_outdated`, `tp_plan` the model's now), an
    analytic profile counted otherwise than `analytic_profile` counts now (`count_outdated`), or one whose
    `extra.moe` lacks a routing fact the model has (`routing`: autopp.model.experts.moe_facts; a group-limited
    routing's groups)."""
    if profile.meta.fingerprint != fingerprint:
        return "the model changed"
    if profile.meta.extra.get("hf_config") != recorded:
        return "it was made for another sequence length or task"
    counted = profile.meta.extra.get("precision") or getattr(recipe_of_dtype(profile.meta.dtype), "name", None)
    if counted != precision:
        return f"it was counted for precision {counted}, the plan needs {precision}"
    if optimizer is not None and profile.meta.optimizer != optimizer:
        return f"it counts optimizer {profile.meta.optimizer}'s state, the plan needs {optimizer}'s"
    made_for = profile.meta.extra.get("analytic_device")
    if made_for != device:
        return f"it is {f'analytic for {made_for}' if made_for else 'measured'}, the plan needs one " + (
            f"analytic for {device}" if device else "measured here")
    timed = counted_kernels(profile.meta.extra)
    if made_for and timed != kernels:
        return f"it counted {timed} kernels, the plan needs {kernels}"
    if rows := tp_outdated(profile.meta.tp_plan, profile.meta.tp_degrees, degrees, tp_plan):
        return rows
    if made_for:
        from ..measure.analytic import count_outdated  # torch: a cached analytic profile is being judged
        outdated = count_outdated(profile)
        if outdated:
            return outdated
    recorded_moe = profile.meta.extra.get("moe") or {}
    lacking = [k for k, v in (routing or {}).items() if v is not None and k not in recorded_moe]
    if lacking:
        return f"it was counted before the routing fact {lacking[0]}"
    return None


def profile_for(args: argparse.Namespace, tp: int | None = 1) -> Profile:
    """The profile `autopp plan` plans from: the model's default profile (`default_profile_dir`) if it is current,
    else a fresh one written there. For `--device NAME` of a device this machine is not, it is counted analytically
    for NAME in its --precision recipe (default bf16: `precision_of`), said in one line before any work; otherwise
    measured here in float32. It has the tensor-parallel rows the request needs: `tp` T > 1 pinned makes rows of
    degree T, `tp` None (searched) rows of every degree the model's TP plan allows, 1 none. Current means: the same
    fingerprint, HF sequence length and task, recipe, device, and (for a pinned T) rows of degree T."""
    from ..data.profile import load_profile
    from ..measure import ProfileOptions
    from ..model.hf import load_model
    from ..model.experts import moe_facts
    from ..model.meta import build_units
    from ..model.tp import find_tp_plan
    source = hf_source_of(args, ("--profile", "DIR"))
    recorded = source.to_json() if source else None
    mf = load_model(source.config_path, recorded) if source else load_model(args.model)
    built, _, fingerprint = build_units(mf)  # on meta: the model may be larger than this machine
    device = analytic_target(getattr(args, "device", None))
    degrees = () if tp == 1 else (None if tp is None else (tp,))
    chosen, optimizer = precision_of(args, device is not None), optimizer_of(args, device is not None)
    if device is None and chosen.matmul_peak != chosen.peak:
        raise AutoppError(f"--precision {chosen} is counted, not measured: give --device of a GPU that has it")
    kernels = kernels_of(args)
    if device is None and getattr(args, "kernels", None):
        raise AutoppError(f"--kernels {kernels} goes with a profile plan counts: give --device NAME of a catalog GPU "
                          "(without --device, or with --device cpu, plan measures here, the kernels that ran)")
    default = default_profile_dir(args)
    if (default / "meta.json").is_file():
        profile = load_profile(default)
        why = _current(profile, fingerprint, recorded, device, degrees, chosen.name, moe_facts(built.model),
                       optimizer, getattr(find_tp_plan(mf, built.model, counting=True), "patterns", None), kernels)
        if why is None:
            print(f"using profile {default}/", file=sys.stderr)
            say_seq_len(args, source)
            return profile
        print(f"profile {default}/ is not current ({why}): profiling again", file=sys.stderr)
    options = ProfileOptions(dtype=chosen.dtype, precision=chosen.name, tp_degrees=degrees,
                             optimizer=optimizer)  # type: ignore[arg-type]
    if device is None:
        profile = _profiled(mf if source else args.model, source, options)
    else:
        model = f"--hf-config {args.hf_config}" if source else args.model
        flags = (f" --seq-len {args.seq_len}" if source and args.seq_len else "") + \
            (f" --tp {tp}" if tp not in (1, None) else "") + (f" --precision {chosen}" if args.precision else "")
        flags += (f" --optimizer {optimizer}" if getattr(args, "optimizer", None) else "") + \
            (f" --kernels {kernels}" if getattr(args, "kernels", None) else "")
        print(f"profiling {model} analytically for {device} ({chosen.what}; optimizer {optimizer}; this machine is "
              f"not a {device}), as `autopp profile {model} --analytic {device}{flags}` would", file=sys.stderr)
        from ..measure.analytic import analytic_profile
        profile = _with_source(analytic_profile(mf, device, options, kernels=kernels, progress=progress("counting")),
                               source)
    end_progress()
    print(f"wrote profile {profile.save(default)}/", file=sys.stderr)
    say_seq_len(args, source)
    return profile
