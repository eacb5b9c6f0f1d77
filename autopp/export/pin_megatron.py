"""--pin-from for Megatron-LM: its command-line arguments read into a Pinned configuration.

The defaults are Megatron-LM's (megatron/training/arguments.py): every parallel size 1, data parallelism the world
size left over (dp = world / (pp x cp x tp)), an even split unless `--pipeline-model-parallel-layout` or the
first/last-stage layer counts say otherwise, 1F1B, interleaved 1F1B with virtual stages; megatron-core's
`PipelineParallelLayerLayout` grammar for the layout."""

from __future__ import annotations

import math
import re
from pathlib import Path

from ..data.axes import AXES, SWITCHES
from ..data.trainers import interleaving_problem
from ..data.zero import ZERO, ZeroStage
from ..schedule import POLICIES, Activation, ScheduleName
from ..solve.assemble.pinned import Pinned
from .layers import ExportError, ModelLayers
from .pin_fields import bounds_from_counts, config_int, config_tokens, multiple_near, pinned_config, read_degrees

__all__ = ["read_megatron", "megatron_layout", "megatron_options"]


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


def megatron_options(path: Path) -> dict[str, str]:
    """{flag: its values joined by spaces (--recompute-modules a b: "a b"), or "true"}."""
    out: dict[str, str] = {}
    key, fresh = None, False
    for tok in config_tokens(path):
        if tok.startswith("--"):
            key, _, value = tok[2:].partition("=")
            out[key], fresh = value or "true", not value
        elif key is None:
            raise ExportError(f"{path}: unexpected {tok!r} before the first --flag")
        else:
            out[key], fresh = tok if fresh else f"{out[key]} {tok}", False
    return out


def _even_counts(o: dict[str, str], k: int, pp: int, where: str) -> list[int]:
    """Blocks per stage without a layout: even over pp x v stages, the first and last stages as given."""
    v = config_int(o, "num-virtual-stages-per-pipeline-rank", 1, where)
    if "num-layers-per-virtual-pipeline-stage" in o:
        per = config_int(o, "num-layers-per-virtual-pipeline-stage", 1, where)
        if k % (pp * per):
            raise ExportError(f"{where}: --num-layers {k} is not a multiple of pp {pp} x "
                              f"--num-layers-per-virtual-pipeline-stage {per}")
        v = k // (pp * per)
    first = config_int(o, "decoder-first-pipeline-num-layers", 0, where, least=0)
    last = config_int(o, "decoder-last-pipeline-num-layers", 0, where, least=0)
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
    return counts


def _zero(o: dict[str, str]) -> ZeroStage:
    """The ZeRO stage whose Megatron-LM arguments (`ZeroStage.megatron`) all appear, the most sharding first; none:
    Megatron's DDP (stage 0)."""
    def given(flag: str) -> bool:
        key, _, value = flag.removeprefix("--").partition(" ")
        return key in o and (not value or o[key] == value)
    most_first = sorted(ZERO.values(), key=lambda z: -z.stage)
    return next((z for z in most_first if z.megatron and all(map(given, z.megatron))), ZERO[0])


#: What `--recompute-granularity selective` (or `--recompute-activations`) is read as: megatron-core recomputes the
#: submodules of `--recompute-modules`, by default the core attention alone, which fused attention (TE's, the
#: default) saves nearly nothing of (megatron/core/transformer/transformer_config.py, 0.16.1, warns "no need").
SELECTIVE_READ = ("Megatron's selective recomputation (--recompute-modules core_attn, its default) is read as keep: "
                  "with fused attention the core attention saves nearly nothing, and autopp costs no attention "
                  "recomputation")


def _activation(o: dict[str, str], counts: list[int], where: str, notes: list[str]) -> Activation:
    """Megatron's recomputation as the policy autopp costs: full recomputation checkpoints each layer
    (`recompute-units`: `--recompute-method uniform --recompute-num-layers 1`, or `block` with at least a stage's
    layers) or each stage's layers as one chunk (`recompute`: `uniform` with at least a stage's layers); selective
    (`--recompute-granularity selective`, `--recompute-activations`) with the default core_attn as keep
    (`SELECTIVE_READ`, said in `notes`), with other modules refused (not modelled)."""
    granularity = "selective" if "recompute-activations" in o else o.get("recompute-granularity")
    if granularity is None:
        return Activation.KEEP
    if granularity == "selective":
        modules = o.get("recompute-modules", "core_attn").split()
        if modules != ["core_attn"]:
            raise ExportError(f"{where}: --recompute-modules {' '.join(modules)} is not modelled (autopp reads "
                              "selective recomputation of core_attn alone, as keep); pin from a config with "
                              "--recompute-granularity full, or none")
        notes.append(SELECTIVE_READ)
        return Activation.KEEP
    if granularity == "full":
        method, layers = o.get("recompute-method"), config_int(o, "recompute-num-layers", 1, where, least=0)
        if method == "uniform" and layers >= max(counts) > 1:
            return Activation.RECOMPUTE
        if (method == "block" and layers < max(counts)) or (method == "uniform" and layers > 1):
            raise ExportError(f"{where}: --recompute-method {method} --recompute-num-layers {layers} is not modelled "
                              f"(stages of up to {max(counts)} layers); autopp recomputes each layer or whole stages")
    policy = next((p.name for p in POLICIES.values() if p.megatron[:1] == (f"--recompute-granularity {granularity}",)),
                  None)
    if policy is None:
        raise ExportError(f"{where}: --recompute-granularity must be full or selective, got {granularity!r}")
    return policy


def read_megatron(path: Path, layers: ModelLayers, devices: int) -> tuple[Pinned, list[str]]:
    """The Megatron-LM arguments in `path` for a model of `layers` on `devices` devices, and notes."""
    o, where = megatron_options(path), str(path)
    notes: list[str] = []
    degrees = read_degrees(o, "megatron", where, key_of=lambda flag: flag.removeprefix("--"))
    for key in ("account-for-embedding-in-pipeline-split", "account-for-loss-in-pipeline-split"):
        if key in o:
            raise ExportError(f"{where}: --{key} is not read by --pin-from yet; give the split as "
                              "--pipeline-model-parallel-layout")
    pp = degrees["pp"]
    k = config_int(o, "num-layers", len(layers.blocks), where)
    if k != len(layers.blocks):
        raise ExportError(f"{where}: --num-layers {k}, but the profile has {len(layers.blocks)} blocks")
    counts = (_layout_counts(o["pipeline-model-parallel-layout"], where) if "pipeline-model-parallel-layout" in o
              else _even_counts(o, k, pp, where))
    if len(counts) % pp:
        raise ExportError(f"{where}: {len(counts)} layout stages are not a multiple of pp {pp}")
    v = len(counts) // pp
    group = math.prod(d for a, d in degrees.items() if a in ("pp", "cp", "tp"))
    if devices % group:  # Megatron: dp = world size / (pp x cp x tp), which must divide
        shown = " x ".join(f"{AXES[a].spelling('megatron').degree} {d}" for a, d in degrees.items()
                           if a in ("pp", "cp", "tp") and (d > 1 or a == "pp"))
        raise ExportError(f"{where}: {devices} devices are not a multiple of {shown} (Megatron's dp = world size / "
                          f"(pp x cp x tp)); plan with --devices {multiple_near(devices, group)}")
    dp = devices // group
    b = config_int(o, "micro-batch-size", 1, where)
    glob = config_int(o, "global-batch-size", b * dp, where)
    if glob % (b * dp):
        raise ExportError(f"{where}: global batch {glob} is not divisible by micro batch {b} x dp {dp}")
    if v > 1 and (problem := interleaving_problem(pp, glob // (b * dp))):
        raise ExportError(f"{where}: {problem}")
    policy = _activation(o, counts, where, notes)
    sp_flag = SWITCHES["sp"].spelling("megatron", True).extra[0].removeprefix("--")
    name = ScheduleName.INTERLEAVED_1F1B if v > 1 else ScheduleName.ONE_F_ONE_B
    return pinned_config(name, degrees, v, dp, _zero(o), sp_flag in o, glob // (b * dp), b,
                         bounds_from_counts(layers, counts), policy, where,
                         ep_a2a="overlap-moe-expert-parallel-comm" in o), notes
