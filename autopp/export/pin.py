"""Read the configuration a user runs today (torchtitan overrides or TOML, Megatron-LM arguments) into a Pinned
configuration that the planner's simulator can judge: its pipeline split and schedule, and every parallel axis, ZeRO
stage and activation policy as the registries spell them for that trainer (autopp.data.axes, autopp.data.zero,
autopp.schedule.activation). No torch; each trainer's defaults are quoted where used (pin_torchtitan.py,
pin_megatron.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from ..solve.assemble.pinned import Pinned
from .layers import ExportError, model_layers
from .pin_fields import Degrees, read_config_text, read_degrees
from .pin_megatron import megatron_options, read_megatron
from .pin_torchtitan import read_torchtitan, torchtitan_options

__all__ = ["read_pinned", "config_degrees", "config_seq_len", "config_trainer", "config_kernels"]


def config_trainer(path: str | Path) -> str:
    """Which trainer's configuration `path` holds: "torchtitan" or "megatron"; an ExportError for neither."""
    p = Path(path)
    text = read_config_text(p)
    if p.suffix == ".toml" or "--parallelism." in text or "--training." in text:
        return "torchtitan"
    if "--pipeline-model-parallel" in text or "--num-layers" in text:
        return "megatron"
    raise ExportError(f"{p}: neither torchtitan settings (--parallelism.*, --training.*, or .toml) nor Megatron-LM "
                      "arguments (--pipeline-model-parallel-size ...)")


def config_degrees(path: str | Path) -> Degrees:
    """The parallel degrees the configuration in `path` sets (before any profile is read: `autopp plan` makes the
    profile's tensor-parallel rows of its tp)."""
    p = Path(path)
    if config_trainer(p) == "torchtitan":
        return read_degrees(torchtitan_options(p), "torchtitan", str(p))
    return read_degrees(megatron_options(p), "megatron", str(p), key_of=lambda flag: flag.removeprefix("--"))


def config_seq_len(path: str | Path) -> int | None:
    """The sequence length the configuration in `path` trains: torchtitan's `training.seq_len`, Megatron-LM's
    `--seq-length`; None where the file sets none (each trainer's default is then its own: not guessed here)."""
    p = Path(path)
    torchtitan = config_trainer(p) == "torchtitan"
    key = "training.seq_len" if torchtitan else "--seq-length"
    value = (torchtitan_options(p) if torchtitan else megatron_options(p)).get(key.removeprefix("--"))
    if value is None:
        return None
    if isinstance(value, bool) or not str(value).isdigit() or int(value) < 1:
        raise ExportError(f"{p}: {key} is {value!r}, not a positive whole number of tokens")
    return int(value)


def config_kernels(path: str | Path) -> tuple[str, str]:
    """The elementwise kernels the configuration in `path` runs (autopp.data.precision.KERNELS) and why: torchtitan
    compiles the model only with `compile.enable` (its CompileConfig, off by default; async TP needs it on),
    Megatron-LM runs Transformer Engine and its fusions unless `--transformer-impl local` (arguments.py's default
    transformer_engine)."""
    p = Path(path)
    if config_trainer(p) == "torchtitan":
        enable = torchtitan_options(p).get("compile.enable")
        on = enable is not None and str(enable).lower() not in ("false", "0")
        return ("fused", "compile.enable") if on else ("eager", "no compile.enable")
    if megatron_options(p).get("transformer-impl") == "local":
        return "eager", "--transformer-impl local"
    return "fused", "Transformer Engine and Megatron-LM's fusions, its defaults"


def read_pinned(path: str | Path, unit_names: Sequence[str], devices: int) -> tuple[Pinned, list[str]]:
    """The configuration in `path` (a torchtitan .toml or overrides file, or Megatron-LM arguments) for a model with
    these units on `devices` devices, and notes on what was evaluated differently from how the trainer runs it."""
    p = Path(path)
    trainer = config_trainer(p)
    layers = model_layers(unit_names, str(p))
    return (read_torchtitan if trainer == "torchtitan" else read_megatron)(p, layers, devices)
