"""Read the configuration a user runs today (torchtitan overrides or TOML, Megatron-LM arguments) into a Pinned
configuration that the planner's simulator can judge. No torch; each trainer's defaults are quoted where used."""

from __future__ import annotations

import math
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any, Sequence

from ..data.axes import group_axes
from ..data.layout import Layout
from ..data.trainers import interleaving_problem
from ..schedule import NAMED, Activation, ScheduleName, describe
from ..solve.assemble.pinned import Pinned
from ..solve.search.judge import Candidate
from .layers import ExportError, ModelLayers, model_layers

__all__ = ["read_pinned", "read_config_text", "megatron_layout", "torchtitan_default_parts"]

_BLOCK_NAME = re.compile(r"\.(\d+)$")


def _schedule(name: str, where: str) -> ScheduleName:
    for s in NAMED:  # torch's get_schedule_class matches names case-insensitively
        if s.value.lower() == name.lower():
            return s
    raise ExportError(f"{where}: schedule {name!r} is not one autopp simulates ({', '.join(s.value for s in NAMED)})")


def _int(options: dict[str, Any], key: str, default: int, where: str, least: int = 1, also: tuple[int, ...] = ()
         ) -> int:
    """options[key] (or `default`) as an integer >= `least` (or one of `also`, e.g. -1 for "the rest"); booleans and
    fractions (TOML `true`, `2.7`) are refused, not truncated."""
    value = options.get(key, default)
    number: int | None = None
    if isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        try:
            number = int(value)
        except ValueError:
            pass
    if number is None:
        raise ExportError(f"{where}: {key} must be an integer, got {value!r}")
    if number < least and number not in also:
        allowed = f">= {least}" + "".join(f" or {a}" for a in also)
        raise ExportError(f"{where}: {key} must be {allowed}, got {number}")
    return number


def read_config_text(path: str | Path) -> str:
    """The text of a trainer's configuration file; an ExportError (one line naming it) when it is missing,
    unreadable or not text."""
    p = Path(path)
    if not p.is_file():
        raise ExportError(f"{p}: no such file; give a torchtitan config (.toml or --section.key=value overrides) or "
                          "a Megatron-LM arguments file")
    try:
        return p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ExportError(f"{p}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ExportError(f"{p}: not a text file (not UTF-8); give a torchtitan config or Megatron-LM "
                          "arguments") from None


def _tokens(path: Path) -> list[str]:
    try:
        return shlex.split(read_config_text(path).replace("\\\n", " "), comments=True)  # shell line continuations
    except ValueError as exc:
        raise ExportError(f"{path}: cannot split into arguments: {exc}") from None


# ---- torchtitan ---------------------------------------------------------------------------------------------------

def _torchtitan_options(path: Path) -> dict[str, Any]:
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
    for tok in _tokens(path):
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


def _bounds_from_counts(layers: ModelLayers, counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Stage unit ranges from blocks per stage, the input part on the first stage and the output part on the last."""
    start, out = 0, []
    for s, n in enumerate(counts):
        end = start + n + (s == 0 and layers.pre is not None) + (s == len(counts) - 1 and layers.post is not None)
        out.append((start, end))
        start = end
    return tuple(out)


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


def _multiple_near(devices: int, unit: int) -> int:
    """The multiple of `unit` nearest `devices` (at least `unit`): a device count to suggest."""
    return unit * max(1, round(devices / unit))


def _torchtitan_dp(o: dict[str, Any], pp: int, devices: int, where: str) -> int:
    """dp = replicate x shard, a shard degree of -1 taking the devices left over; refused unless pp x dp = devices."""
    replicate = _int(o, "parallelism.data_parallel_replicate_degree", 1, where)
    shard = _int(o, "parallelism.data_parallel_shard_degree", -1, where, also=(-1,))
    if shard == -1:
        if devices % (pp * replicate):
            raise ExportError(f"{where}: {devices} devices are not a multiple of pp {pp} x replicate {replicate} "
                              "(data_parallel_shard_degree -1 takes the devices left over); plan with --devices "
                              f"{_multiple_near(devices, pp * replicate)}")
        return devices // pp
    if pp * replicate * shard != devices:
        raise ExportError(f"{where}: pp {pp} x dp {replicate * shard} (replicate {replicate} x shard {shard}) != "
                          f"{devices} devices; plan with --devices {pp * replicate * shard}")
    return replicate * shard


def _group_keys(trainer: str) -> list[str]:
    """`trainer`'s keys of the axes inside a pipeline rank (context, tensor parallelism: autopp.data.axes), which
    --pin-from does not read yet."""
    return [k for a in group_axes() if (k := a.spelling(trainer).degree) is not None]


def _torchtitan(path: Path, layers: ModelLayers, devices: int) -> tuple[Pinned, list[str]]:
    o, where, notes = _torchtitan_options(path), str(path), []
    for key in _group_keys("torchtitan"):
        if _int(o, key, 1, where) != 1:
            raise ExportError(f"{where}: {key} = {o[key]}: --pin-from does not read tensor or context parallelism "
                              "yet; pin the configuration with autopp plan --tp T --pp P --dp D --zero Z instead")
    if o.get("parallelism.pipeline_parallel_schedule_csv"):
        raise ExportError(f"{where}: pipeline_parallel_schedule_csv: --pin-from does not read schedule CSVs yet")
    pp = _int(o, "parallelism.pipeline_parallel_degree", 1, where)
    name = _schedule(str(o.get("parallelism.pipeline_parallel_schedule", ScheduleName.ONE_F_ONE_B.value)), where)
    single = describe(name).single_stage
    parts = o.get("parallelism.module_fqns_per_model_part")
    if parts:
        groups = [p if isinstance(p, list) else str(p).split(",") for p in ([parts] if isinstance(parts, str)
                                                                         else parts)]
        counts = _counts_from_fqns(groups, layers, where)
    else:
        key = "parallelism.pipeline_parallel_layers_per_stage"
        w_in = _int(o, "parallelism.pipeline_parallel_first_stage_less_layers", 1, where, least=0)
        w_out = _int(o, "parallelism.pipeline_parallel_last_stage_less_layers", 1, where, least=0)
        stages = (math.ceil((len(layers.blocks) + w_in + w_out) / _int(o, key, 1, where))
                  if o.get(key) not in (None, "None") else pp * (1 if single else 2))
        counts = torchtitan_default_parts(stages, len(layers.blocks), w_in, w_out)
    if len(counts) % pp:  # torchtitan raises here too (_get_pipeline_metadata: stages divisible by pp)
        raise ExportError(f"{where}: {len(counts)} stages are not a multiple of pipeline_parallel_degree {pp}; "
                          "torchtitan needs the same number of stages on every rank")
    dp = _torchtitan_dp(o, pp, devices, where)
    replicate = _int(o, "parallelism.data_parallel_replicate_degree", 1, where)
    if dp > replicate:
        notes.append(f"FSDP (data_parallel_shard_degree {dp // replicate}) is evaluated as plain data-parallel "
                     "replicas: --pin-from does not read ZeRO stages yet (autopp plan --zero 1 or 3 does)")
    b = _int(o, "parallelism.pipeline_parallel_microbatch_size", 1, where)
    local = _int(o, "training.local_batch_size", 8, where)
    if local % b:
        raise ExportError(f"{where}: training.local_batch_size {local} is not divisible by microbatch size {b}")
    glob = _int(o, "training.global_batch_size", -1, where, also=(-1,))
    if glob not in (-1, local * dp):
        raise ExportError(f"{where}: training.global_batch_size {glob} != local {local} x dp {dp}: gradient "
                          "accumulation is not modelled")
    ac = str(o.get("activation_checkpoint", "selective"))
    if ac not in ("full", "none"):
        notes.append(f"activation checkpointing {ac!r} is evaluated as none: autopp models full recomputation only")
    bounds = _bounds_from_counts(layers, counts)
    policy = Activation.RECOMPUTE if ac == "full" else Activation.KEEP
    return _pinned(name, Layout(pp=pp, v=len(counts) // pp, dp=dp), local // b, b, bounds, policy, where), notes


# ---- Megatron-LM --------------------------------------------------------------------------------------------------

def megatron_layout(text: str) -> list[str]:
    """Stages of a `--pipeline-model-parallel-layout` string, each a string of E/t/m/L (Megatron-Core's grammar in
    PipelineParallelLayerLayout.parse_str_to_list: commas are cosmetic, `(..)*n` and `x*n` repeat)."""
    s = text.replace(",", "")
    s = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    s = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), s)
    return s.split("|")


def _layout_counts(text: str, where: str) -> list[int]:
    """Blocks per stage of a Megatron layout; refused unless megatron-core's `validate_layer_layout` takes it (one E,
    one L, no MTP) and autopp reads it as given: E opening the first stage, L closing the last."""
    stages = megatron_layout(text)
    flat = "".join(stages)
    if not (set(flat) <= set("EtL") and flat.count("E") == 1 and flat.count("L") == 1
            and stages[0].startswith("E") and stages[-1].endswith("L")):
        raise ExportError(f"{where}: the layout {text!r} must open its first stage with E, close its last with L, "
                          "hold each once and only t between (MTP layers are not modelled)")
    return [st.count("t") for st in stages]


def _megatron_options(path: Path) -> dict[str, str]:
    """{flag: its first value, or "true"}; further values of a flag (e.g. --recompute-modules a b) are skipped."""
    out: dict[str, str] = {}
    key, fresh = None, False
    for tok in _tokens(path):
        if tok.startswith("--"):
            key, _, value = tok[2:].partition("=")
            out[key], fresh = value or "true", not value
        elif key is None:
            raise ExportError(f"{path}: unexpected {tok!r} before the first --flag")
        elif fresh:
            out[key], fresh = tok, False
    return out


def _megatron(path: Path, layers: ModelLayers, devices: int) -> tuple[Pinned, list[str]]:
    o, where, notes = _megatron_options(path), str(path), []
    for key in (k.removeprefix("--") for k in _group_keys("megatron")):
        if _int(o, key, 1, where) != 1:
            raise ExportError(f"{where}: --{key} {o[key]}: --pin-from does not read tensor or context parallelism "
                              "yet; pin the configuration with autopp plan --tp T --pp P --dp D --zero Z instead")
    for key in ("account-for-embedding-in-pipeline-split", "account-for-loss-in-pipeline-split"):
        if key in o:
            raise ExportError(f"{where}: --{key} is not read by --pin-from yet; give the split as "
                              "--pipeline-model-parallel-layout")
    pp = _int(o, "pipeline-model-parallel-size", 1, where)
    k = _int(o, "num-layers", len(layers.blocks), where)
    if k != len(layers.blocks):
        raise ExportError(f"{where}: --num-layers {k}, but the profile has {len(layers.blocks)} blocks")
    if "pipeline-model-parallel-layout" in o:
        counts = _layout_counts(o["pipeline-model-parallel-layout"], where)
    else:
        v = _int(o, "num-virtual-stages-per-pipeline-rank", 1, where)
        if "num-layers-per-virtual-pipeline-stage" in o:
            per = _int(o, "num-layers-per-virtual-pipeline-stage", 1, where)
            if k % (pp * per):
                raise ExportError(f"{where}: --num-layers {k} is not a multiple of pp {pp} x "
                                  f"--num-layers-per-virtual-pipeline-stage {per}")
            v = k // (pp * per)
        first = _int(o, "decoder-first-pipeline-num-layers", 0, where, least=0)
        last = _int(o, "decoder-last-pipeline-num-layers", 0, where, least=0)
        if (first or last) and v > 1:
            raise ExportError(f"{where}: uneven first/last stages with virtual stages: give the split as "
                              "--pipeline-model-parallel-layout")
        n = pp * v
        middle = n - (first > 0) - (last > 0)
        rest = k - first - last
        if middle < 0 or (middle and rest % middle) or (not middle and rest):
            raise ExportError(f"{where}: {k} layers do not divide evenly over {n} stages (first {first}, last {last})")
        counts = [rest // middle if middle else 0] * n
        if first:
            counts[0] = first
        if last:
            counts[-1] = last
    if len(counts) % pp:
        raise ExportError(f"{where}: {len(counts)} layout stages are not a multiple of pp {pp}")
    v = len(counts) // pp
    if devices % pp:  # Megatron: dp = world size / (tp x pp), which must divide
        raise ExportError(f"{where}: {devices} devices are not a multiple of --pipeline-model-parallel-size {pp} "
                          f"(Megatron's dp = world size / pp); plan with --devices {_multiple_near(devices, pp)}")
    dp = devices // pp
    b = _int(o, "micro-batch-size", 1, where)
    glob = _int(o, "global-batch-size", b * dp, where)
    if glob % (b * dp):
        raise ExportError(f"{where}: global batch {glob} is not divisible by micro batch {b} x dp {dp}")
    if v > 1 and (problem := interleaving_problem(pp, glob // (b * dp))):
        raise ExportError(f"{where}: {problem}")
    full = o.get("recompute-granularity") == "full"
    if full and o.get("recompute-method") == "block" and \
            _int(o, "recompute-num-layers", 0, where, least=0) < max(counts):
        raise ExportError(f"{where}: block recomputation of some layers per stage is not modelled; autopp "
                          "recomputes whole stages")
    if "recompute-activations" in o or o.get("recompute-granularity") == "selective":
        notes.append("selective recomputation is evaluated as none: autopp models full recomputation only")
    bounds = _bounds_from_counts(layers, counts)
    name = ScheduleName.INTERLEAVED_1F1B if v > 1 else ScheduleName.ONE_F_ONE_B
    policy = Activation.RECOMPUTE if full else Activation.KEEP
    return _pinned(name, Layout(pp=pp, v=v, dp=dp), glob // (b * dp), b, bounds, policy, where), notes


def _pinned(name: ScheduleName, layout: Layout, m: int, b: int, bounds: tuple[tuple[int, int], ...],
            activation: Activation, where: str) -> Pinned:
    """The trainer's configuration as autopp judges it: every stage under the trainer's one activation policy."""
    return Pinned(candidate=Candidate(schedule=name, layout=layout, microbatches=m, microbatch_size=b, bounds=bounds,
                                      activations=(activation,) * len(bounds)), source=where)


def read_pinned(path: str | Path, unit_names: Sequence[str], devices: int) -> tuple[Pinned, list[str]]:
    """The configuration in `path` (a torchtitan .toml or overrides file, or Megatron-LM arguments) for a model with
    these units on `devices` devices, and notes on what was evaluated differently from how the trainer runs it."""
    p = Path(path)
    text = read_config_text(p)
    layers = model_layers(unit_names, str(p))
    if p.suffix == ".toml" or "--parallelism." in text or "--training." in text:
        return _torchtitan(p, layers, devices)
    if "--pipeline-model-parallel" in text or "--num-layers" in text:
        return _megatron(p, layers, devices)
    raise ExportError(f"{p}: neither torchtitan settings (--parallelism.*, --training.*, or .toml) nor Megatron-LM "
                      "arguments (--pipeline-model-parallel-size ...)")
