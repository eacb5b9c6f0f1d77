"""What both --pin-from readers (pin_torchtitan.py, pin_megatron.py) share: typed values of a configuration, its text,
every parallel axis's degree as the registry spells it for the trainer (autopp.data.axes), and the Pinned
configuration built from what they read. No torch."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..data.axes import AXES, unplanned
from ..data.layout import Layout
from ..data.zero import NO_ZERO, ZeroStage
from ..errors import LayoutError
from ..schedule import NAMED, Activation, ScheduleName
from ..solve.assemble.pinned import Pinned
from ..solve.search.judge import Candidate
from .layers import ExportError, ModelLayers

__all__ = ["read_config_text", "Degrees", "config_int", "config_flag", "config_tokens",
           "read_degrees", "schedule_named", "bounds_from_counts", "multiple_near", "pinned_config"]

#: Axis name -> degree, as read from a trainer's configuration (every axis of `AXES` but dp, which the trainers
#: derive from the world size).
Degrees = dict[str, int]


def schedule_named(name: str, where: str) -> ScheduleName:
    """The named schedule `name` (torch's get_schedule_class matches names case-insensitively)."""
    for s in NAMED:
        if s.value.lower() == name.lower():
            return s
    raise ExportError(f"{where}: schedule {name!r} is not one autopp simulates ({', '.join(s.value for s in NAMED)})")


def config_int(options: Mapping[str, Any], key: str, default: int, where: str, least: int = 1,
               also: tuple[int, ...] = ()) -> int:
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


def config_flag(options: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    """options[key] as a switch: a bare flag or TOML `true`/`false`, or the words true/false; `default` without it."""
    value = options.get(key, default)
    if isinstance(value, bool):
        return value
    if value in ([], "", "true", "True"):
        return True
    if value in ("false", "False"):
        return False
    raise ExportError(f"{where}: {key} must be true or false, got {value!r}")


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


def config_tokens(path: Path) -> list[str]:
    """The file's words as a shell splits them (comments dropped, line continuations joined)."""
    try:
        return shlex.split(read_config_text(path).replace("\\\n", " "), comments=True)
    except ValueError as exc:
        raise ExportError(f"{path}: cannot split into arguments: {exc}") from None


def read_degrees(options: Mapping[str, Any], trainer: str, where: str, key_of: Any = str) -> Degrees:
    """Every axis's degree that `trainer` spells (`Axis.spelling(trainer).degree`, read through `key_of` into the
    options' keys), 1 where not given; the first axis autopp does not plan yet (`Axis.unplanned`: another issue adds
    it) above 1 is refused in one line naming the trainer's key and value."""
    out: Degrees = {}
    for axis in AXES.values():
        spelled = axis.spelling(trainer).degree
        if spelled is None:
            continue
        out[axis.name] = config_int(options, key_of(spelled), 1, where)
        if axis.name in unplanned() and out[axis.name] > 1:
            raise ExportError(f"{where}: {spelled} {out[axis.name]}: autopp does not plan {unplanned()[axis.name]} "
                              f"yet, so it cannot judge this configuration; compare one with {spelled} 1")
    return out


def multiple_near(devices: int, unit: int) -> int:
    """The multiple of `unit` nearest `devices` (at least `unit`): a device count to suggest."""
    return unit * max(1, round(devices / unit))


def bounds_from_counts(layers: ModelLayers, counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Stage unit ranges from blocks per stage, the input part on the first stage and the output part on the last."""
    start, out = 0, []
    for s, n in enumerate(counts):
        end = start + n + (s == 0 and layers.pre is not None) + (s == len(counts) - 1 and layers.post is not None)
        out.append((start, end))
        start = end
    return tuple(out)


def pinned_config(name: ScheduleName, degrees: Degrees, v: int, dp: int, zero: ZeroStage, sp: bool, m: int, b: int,
                  bounds: tuple[tuple[int, int], ...], activation: Activation, where: str,
                  dp_replicate: int = 1, ep_a2a: bool = False) -> Pinned:
    """The trainer's configuration as autopp judges it: every stage under the trainer's one activation policy; the
    ZeRO stage only where dp x cp > 1 shards something (`Layout.sync`: both trainers shard over the data-parallel
    ranks with cp), sequence parallelism only with tensor parallelism (as the trainers apply them); `dp_replicate`:
    HSDP's replicas (`Layout.dp_replicate`); `ep_a2a`: it overlaps expert all-to-alls (`Pinned.ep_a2a`). A layout
    the degrees do not make (ep not dividing dp x cp x tp) is one line naming `where`."""
    others = {a: d for a, d in degrees.items() if a != "pp"}
    sharded = dp * others.get("cp", 1) > 1
    try:
        layout = Layout(pp=degrees["pp"], v=v, dp=dp, **others, zero=zero if sharded else NO_ZERO,
                        sp=sp and others.get("tp", 1) > 1, dp_replicate=dp_replicate)
    except LayoutError as exc:
        raise ExportError(f"{where}: {exc}") from None
    return Pinned(candidate=Candidate(schedule=name, layout=layout, microbatches=m, microbatch_size=b, bounds=bounds,
                                      activations=(activation,) * len(bounds)), source=where, ep_a2a=ep_a2a)
