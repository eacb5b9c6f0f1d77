"""--pin-from for torchtitan: its `--section.key=value` overrides (0.3) or TOML read into a Pinned configuration.

The defaults are torchtitan's (torchtitan/config/configs.py): 1F1B, one stage per rank for single-stage schedules and
two otherwise, `data_parallel_shard_degree` -1 (the devices left over), `enable_sequence_parallel` on,
`fsdp_reshard_after_forward` "default" (kept whole under pipeline parallelism, resharded without), local batch 8; the
default split is `_generate_llm_fqn_per_model_part` (torchtitan/distributed/pipeline_parallel.py)."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from typing import Any

from ..data.axes import SWITCHES
from ..data.zero import ZERO, ZeroStage
from ..schedule import POLICIES, Activation, ScheduleName, describe
from ..solve.assemble.pinned import Pinned
from .layers import ExportError, ModelLayers
from .pin_fields import (Degrees, bounds_from_counts, config_flag, config_int, config_tokens, multiple_near,
                         pinned_config, read_config_text, read_degrees, schedule_named)

__all__ = ["read_torchtitan", "torchtitan_options", "torchtitan_default_parts"]

_BLOCK_NAME = re.compile(r"\.(\d+)$")
#: torchtitan's activation_checkpoint mode -> the policy autopp costs for it (`ActivationPolicy.torchtitan`).
_AC_MODES = {p.torchtitan: p.name for p in POLICIES.values() if p.refusal("torchtitan") is None}


def torchtitan_options(path: Path) -> dict[str, Any]:
    """{"section.key": value} from a TOML file (older torchtitan) or `--section.key=value` overrides (0.3)."""
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(read_config_text(path))
        except tomllib.TOMLDecodeError as exc:
            raise ExportError(f"{path}: not valid TOML: {exc}") from None
        out: dict[str, Any] = {f"{sec}.{k}": v for sec, table in data.items() if isinstance(table, dict)
                               for k, v in table.items()}
        if "activation_checkpoint.mode" in out:
            out["activation_checkpoint"] = out.pop("activation_checkpoint.mode")
        return out
    out = {}
    key = None
    for tok in config_tokens(path):
        if tok.startswith("activation_checkpoint:"):
            out["activation_checkpoint"], key = tok.split(":", 1)[1], None
        elif tok.startswith("--"):
            key, _, value = tok[2:].partition("=")
            out[key] = [value] if value else []
        elif key is not None:
            out[key].append(tok)
        else:
            raise ExportError(f"{path}: unexpected {tok!r}; expected --section.key=value overrides")
    return {k: (v[0] if len(v) == 1 else v) for k, v in out.items()}


def torchtitan_default_parts(num_stages: int, num_layers: int, input_weight: int = 1, output_weight: int = 1
                             ) -> list[int]:
    """Blocks per stage of torchtitan's `_generate_llm_fqn_per_model_part` (distributed/pipeline_parallel.py): the
    embedding counts as `input_weight` layers on the first stage, norm + output as `output_weight` on the last,
    and the effective layers are dealt evenly, the first stages taking the remainder."""
    if num_stages == 1:
        return [num_layers]
    total = num_layers + input_weight + output_weight
    per, extra = divmod(total, num_stages)
    if per == 0 or input_weight > per or output_weight > per:
        raise ExportError(f"torchtitan cannot split {num_layers} layers (+{input_weight} input, +{output_weight} "
                          f"output) into {num_stages} stages")
    counts, left = [], num_layers
    for s in range(num_stages):
        want = per + (s < extra) - (input_weight if s == 0 else output_weight if s == num_stages - 1 else 0)
        counts.append(min(max(want, 0), left))
        left -= counts[-1]
    return counts


def _counts_from_fqns(parts: list[list[str]], layers: ModelLayers, where: str) -> list[int]:
    """Blocks per stage from torchtitan's `module_fqns_per_model_part`; other names belong on the first or last
    stage (embedding; norm and head)."""
    counts, seen = [], []
    for s, names in enumerate(parts):
        blocks = [int(m.group(1)) for m in map(_BLOCK_NAME.search, names) if m]
        others = [n for n in names if not _BLOCK_NAME.search(n)]
        if others and 0 < s < len(parts) - 1:
            raise ExportError(f"{where}: stage {s} holds {others[0]!r}, which is not a block; only the first and "
                              "last stages may hold the embedding or the output modules")
        counts.append(len(blocks))
        seen += blocks
    if seen != list(range(len(layers.blocks))):
        raise ExportError(f"{where}: module_fqns_per_model_part must list blocks 0..{len(layers.blocks) - 1} once "
                          f"each in order (the profile has {len(layers.blocks)}), got {seen}")
    return counts


def _counts(o: dict[str, Any], layers: ModelLayers, pp: int, single: bool, where: str) -> list[int]:
    """Blocks per stage: the config's module names, else torchtitan's default split."""
    parts = o.get("parallelism.module_fqns_per_model_part")
    if parts:
        groups = [p if isinstance(p, list) else str(p).split(",") for p in ([parts] if isinstance(parts, str)
                                                                         else parts)]
        return _counts_from_fqns(groups, layers, where)
    key = "parallelism.pipeline_parallel_layers_per_stage"
    w_in = config_int(o, "parallelism.pipeline_parallel_first_stage_less_layers", 1, where, least=0)
    w_out = config_int(o, "parallelism.pipeline_parallel_last_stage_less_layers", 1, where, least=0)
    stages = (math.ceil((len(layers.blocks) + w_in + w_out) / config_int(o, key, 1, where))
              if o.get(key) not in (None, "None") else pp * (1 if single else 2))
    return torchtitan_default_parts(stages, len(layers.blocks), w_in, w_out)


def _data_parallel(o: dict[str, Any], degrees: Degrees, devices: int, where: str, notes: list[str]
                   ) -> tuple[int, ZeroStage, int]:
    """dp = replicate x shard (a shard degree of -1 taking the devices left over; refused unless pp x dp x cp x tp =
    devices), and the ZeRO stage of its FSDP (torchtitan's FSDP runs over dp_shard x cp whenever that is above 1,
    `ParallelDims.fsdp_enabled`): none for replicas alone, stage 1 for `fsdp_reshard_after_forward` never,
    3 for always ("default": never under pipeline parallelism, always without; `ZeroStage.fsdp_reshard_after_forward`).
    With replicate and shard both above 1, HSDP: that stage sharded over the shard ranks, replicated `replicate`
    times (`Layout.dp_replicate`, the third value returned; 1 otherwise); beside expert parallelism, which autopp
    plans without HSDP, as FSDP over all dp ranks, said in `notes`."""
    replicate = config_int(o, "parallelism.data_parallel_replicate_degree", 1, where)
    shard = config_int(o, "parallelism.data_parallel_shard_degree", -1, where, also=(-1,))
    group = math.prod(d for a, d in degrees.items() if a in ("pp", "cp", "tp"))
    shown = " x ".join(f"{a} {d}" for a, d in degrees.items() if a in ("pp", "cp", "tp") and (d > 1 or a == "pp"))
    if shard == -1:
        if devices % (group * replicate):
            raise ExportError(f"{where}: {devices} devices are not a multiple of {shown} x replicate {replicate} "
                              "(data_parallel_shard_degree -1 takes the devices left over); plan with --devices "
                              f"{multiple_near(devices, group * replicate)}")
        shard = devices // (group * replicate)
    if group * replicate * shard != devices:
        raise ExportError(f"{where}: {shown} x dp {replicate * shard} (replicate {replicate} x shard {shard}) != "
                          f"{devices} devices; plan with --devices {group * replicate * shard}")
    if shard == 1 and degrees.get("cp", 1) == 1:  # FSDP runs over dp_shard x cp (`ParallelDims.fsdp_enabled`)
        return replicate, ZERO[0], 1
    mode = str(o.get("parallelism.fsdp_reshard_after_forward", "default"))
    if mode not in ("default", "always", "never"):
        raise ExportError(f"{where}: fsdp_reshard_after_forward must be default, always or never, got {mode!r}")
    reshard = mode == "always" or mode == "default" and degrees["pp"] == 1
    zero = next(z for z in ZERO.values() if z.fsdp_reshard_after_forward is reshard and z.not_runnable is None)
    if replicate > 1 and shard == 1:  # HSDP whose shard group is the cp ranks alone: no `Layout.dp_replicate`
        notes.append(f"HSDP (replicate {replicate} x shard 1 x cp {degrees['cp']}) is evaluated as {zero} over all "
                     f"{replicate} x {degrees['cp']} data-parallel and cp ranks: autopp's HSDP shards over dp ranks")
        return replicate, zero, 1
    if replicate > 1 and degrees.get("ep", 1) > 1:  # autopp plans HSDP without expert parallelism
        notes.append(f"HSDP (replicate {replicate} x shard {shard}) with expert parallelism is evaluated as {zero} "
                     f"over all {replicate * shard} data-parallel ranks: autopp plans HSDP without ep")
        return replicate * shard, zero, 1
    return replicate * shard, zero, replicate


def _sequence_parallel(o: dict[str, Any], where: str) -> bool:
    """torchtitan's `enable_sequence_parallel` (the switch's torchtitan spellings, autopp.data.axes.SWITCHES: on by
    default, which is why the export writes `no_enable_sequence_parallel` to turn it off)."""
    sp = SWITCHES["sp"]
    on, off = (next(iter(sp.spelling("torchtitan", v).extra), "").removeprefix("--") for v in (True, False))
    if off in o:
        return False
    return config_flag(o, on, True, where)


def _activation(o: dict[str, Any], notes: list[str]) -> Activation:
    """torchtitan's activation checkpointing mode as the policy autopp costs (`_AC_MODES`); torchtitan 0.3 checkpoints
    selectively when the config says nothing."""
    mode = str(o.get("activation_checkpoint", "selective"))
    if mode not in _AC_MODES:
        notes.append(f"activation checkpointing {mode!r} is evaluated as none: autopp models "
                     f"{', '.join(sorted(_AC_MODES))}")
        return Activation.KEEP
    return _AC_MODES[mode]


def read_torchtitan(path: Path, layers: ModelLayers, devices: int) -> tuple[Pinned, list[str]]:
    """The torchtitan configuration in `path` for a model of `layers` on `devices` devices, and notes."""
    o, where = torchtitan_options(path), str(path)
    notes: list[str] = []
    degrees = read_degrees(o, "torchtitan", where)
    if o.get("parallelism.pipeline_parallel_schedule_csv"):
        named = o.get("parallelism.pipeline_parallel_schedule")
        raise ExportError(f"{where}: pipeline_parallel_schedule_csv: --pin-from does not read schedule CSVs yet; "
                          "remove that line to compare the named schedule " + (f"it was made on ({named})" if named
                                                                                else "the file names"))
    pp = degrees["pp"]
    name = schedule_named(str(o.get("parallelism.pipeline_parallel_schedule", ScheduleName.ONE_F_ONE_B.value)), where)
    counts = _counts(o, layers, pp, describe(name).single_stage, where)
    if len(counts) % pp:  # torchtitan raises here too (_get_pipeline_metadata: stages divisible by pp)
        raise ExportError(f"{where}: {len(counts)} stages are not a multiple of pipeline_parallel_degree {pp}; "
                          "torchtitan needs the same number of stages on every rank")
    dp, zero, replicate = _data_parallel(o, degrees, devices, where, notes)
    local = config_int(o, "training.local_batch_size", 8, where)
    # without pipeline parallelism torchtitan runs the local batch in one forward and backward (no microbatches)
    b = config_int(o, "parallelism.pipeline_parallel_microbatch_size", 1, where) if pp > 1 else local
    if local % b:
        raise ExportError(f"{where}: training.local_batch_size {local} is not divisible by microbatch size {b}")
    glob = config_int(o, "training.global_batch_size", -1, where, also=(-1,))
    steps = 1 if glob == -1 else glob // (local * dp)  # torchtitan's gradient_accumulation_steps
    if glob != -1 and (glob % (local * dp) or pp > 1 and steps > 1):
        raise ExportError(f"{where}: training.global_batch_size {glob} != local {local} x dp {dp}"
                          + (": gradient accumulation under pipeline parallelism is not modelled" if pp > 1 and not
                             glob % (local * dp) else " x a whole number of gradient-accumulation steps"))
    policy = _activation(o, notes)
    # without pp, the accumulation steps are autopp's microbatches (of the local batch each)
    m = local // b * steps
    return pinned_config(name, degrees, len(counts) // pp, dp, zero, _sequence_parallel(o, where), m, b,
                         bounds_from_counts(layers, counts), policy, where, dp_replicate=replicate), notes
