"""What every command of the `autopp` CLI shares: argument types, the usage-error parser, progress lines, the
default profile directory and the choices."""

from __future__ import annotations

import argparse
import logging
import math
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, NoReturn

from ..data.axes import AXES
from ..data.hf_config import DEFAULT_SEQ_LEN
from ..data.precision import recipe_of_dtype
from ..progress import PROGRESS_LOG
from ..schedule import DESCRIPTORS, NAMED
from ..sizes import parse_size

if TYPE_CHECKING:
    from ..measure.options import DType

__all__ = ["FLAG_TERMS", "in_flags", "DEFAULT_PROFILE_DIR", "SCHEDULE_NAMES", "TARGET_NAMES", "Parser", "progress",
           "end_progress", "shown_progress", "comma_sizes", "memory_size", "integer", "number", "POSITIVE", "COUNT",
           "SECONDS", "model_stem", "default_profile_dir", "profile_dir_name", "analytic_target", "default_dtype"]

DEFAULT_PROFILE_DIR = Path("profiles")

#: The planning core names the fields of its requests (`dp`, `recompute_stages`, "search `dp`"); the command line
#: says the same with its flags. The one table between the two, applied to every error the CLI prints (`in_flags`):
#: phrases first, then each field in backquotes.
_AXIS_FLAGS = tuple(a for a in AXES.values() if a.flag is not None and a.unplanned is None)  # autopp.cli.plan's
_SEARCHED = (*(a.name for a in _AXIS_FLAGS if a.flag is not None and a.flag.auto), "zero", "schedule")
FLAG_TERMS: tuple[tuple[str, str], ...] = (
    *((f"search `{f}`", f"--{f} auto") for f in _SEARCHED),
    *((f"`{f}` searched", f"--{f} auto") for f in _SEARCHED),
    ("`recompute_stages`", "--recompute-stages"), ("`recompute`", "--recompute"),
    ("`activations`", "the activation policies (--recompute)"),
    ("`num_microbatches`", "--microbatches"), ("`global_batch`", "--global-batch"),
    ("search `dp_replicate`", "--dp-replicate auto"), ("`dp_replicate`", "--dp-replicate"),
    ("`sp` on", "--sp on"), ("`sp` off", "--sp off"), ("`sp`", "--sp"),
    ("`vocab` off", "--vocab off"), ("`vocab` vocab-1", "--vocab 1"), ("`vocab` vocab-2", "--vocab 2"),
    ("`vocab`", "--vocab"),
    ("`tp_across_nodes`", "--tp-across-nodes"), ("`tp_degrees`", "--tp"), ("`memory_bytes`", "--memory"),
    ("`memory_reserve`", "--memory-reserve"),
    ("`split`", "--split"), ("`v`", "--virtual-stages"), ("`schedule`", "--schedule"),
    ("`latency_s`", "--latency"), ("`intra_bandwidth`", "--intra-node-bandwidth"),
    ("`inter_bandwidth`", "--inter-node-bandwidth"), ("`bandwidth`", "--bandwidth"),
    ("`devices_per_node`", "--devices-per-node"), ("`devices`", "--devices"), ("`nodes`", "--nodes"),
    ("`device`", "--device"), ("`analytic`", "--analytic"), ("`dtype`", "--dtype"), ("`seq_len`", "--seq-len"),
    ("`precision`", "--precision"), ("`overlap` ep_a2a", "--overlap ep-a2a"),
    ("`task`", "--task"), ("`trainer`", "--for"), ("`synthesize`", "--synthesize"),
    ("`judge_budget`", "--judge-budget"),
    ("`progress_s` 0 on every link", "--progress-delay 0 (with --cluster: progress_s 0 on every link)"),
    *((f"`{f}`", f"--{f}") for f in (*(a.name for a in _AXIS_FLAGS), "zero")),
)
_FLAG_PATTERNS = tuple((re.compile(r"(?<![\w-])" + re.escape(term)), flag) for term, flag in FLAG_TERMS)


def in_flags(message: str) -> str:
    """A message of the planning core as the command line says it (`FLAG_TERMS`; a phrase inside a word stays)."""
    for pattern, flag in _FLAG_PATTERNS:
        message = pattern.sub(flag, message)
    return message

#: The schedules `--schedule` pins: the named ones and sequence pipelining's (offered for causal LMs,
#: autopp.solve.search.seqpipe), by value (the schedule package loads neither torch, pandas nor OR-Tools: ~0.1 s).
SCHEDULE_NAMES = tuple(n.value for n in DESCRIPTORS if n in NAMED or DESCRIPTORS[n].sequence_chunks)

#: The values of autopp.export.Target, spelt out for the same reason; tests/export/test_export.py checks they agree.
TARGET_NAMES = ("torchtitan", "megatron", "deepspeed", "torch-csv")


def progress(prefix: str) -> Callable[[str], None]:
    """A progress callback: one updated line on a terminal, else one line per message, on stderr."""
    tty = sys.stderr.isatty()

    def show(msg: str) -> None:
        if tty:
            sys.stderr.write(f"\r\033[K{prefix}: {msg}")
            sys.stderr.flush()
        else:
            print(f"{prefix}: {msg}", file=sys.stderr, flush=True)
    return show


def end_progress() -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")


class _Shown(logging.Handler):
    """A progress line of the planning core (`PROGRESS_LOG`), on the command's progress line."""

    def __init__(self, show: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.show = show

    def emit(self, record: logging.LogRecord) -> None:
        self.show(record.getMessage())


#: Seconds between the planning core's progress lines where stderr is no terminal (a job's log): one line per
#: interval, not one per message.
LOG_EVERY_S = 10.0


def _every(show: Callable[[str], None], seconds: float) -> Callable[[str], None]:
    """`show`, passing on every phase's first line (one without a progress bar) and of the bars' lines the first
    and then at most one every `seconds`."""
    last = [-math.inf]

    def shown(msg: str) -> None:
        if msg.startswith("["):  # a bar's line: at most one per `seconds`
            now = time.monotonic()
            if now - last[0] < seconds:
                return
            last[0] = now
        show(msg)
    return shown


@contextmanager
def shown_progress(prefix: str) -> Iterator[None]:
    """The planning core's progress lines (the search's bounds, CP-SAT's solves: autopp.progress) while inside: on a
    terminal on the `prefix` line, elsewhere (a job's log) one line every `LOG_EVERY_S` seconds, so that a search of
    minutes is never silent."""
    show = progress(prefix) if sys.stderr.isatty() else _every(progress(prefix), LOG_EVERY_S)
    logger, handler = logging.getLogger(PROGRESS_LOG), _Shown(show)
    level, propagate = logger.level, logger.propagate
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def comma_sizes(text: str) -> list[int]:
    """An argparse type: comma-separated positive integers such as 1,2,4."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,4, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"microbatch sizes must be positive integers, got {text!r}")
    return sizes


def memory_size(text: str) -> int:
    """An argparse type: a byte size such as 80GiB (autopp.sizes.parse_size)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def integer(least: int) -> Callable[[str], int]:
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


def number(least: float, inclusive: bool, what: str = "") -> Callable[[str], float]:
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


POSITIVE = integer(1)
COUNT = integer(0)
SECONDS = number(0, inclusive=False, what="a positive number of seconds")


class Parser(argparse.ArgumentParser):
    """Usage errors on one line (the command and what is wrong), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def model_stem(args: argparse.Namespace) -> str:
    """The name of the model's default profile directory under profiles/ (and of its plan): the model file's or
    the config's file name without its suffix."""
    return Path(args.hf_config or args.model).stem


def default_profile_dir(args: argparse.Namespace) -> Path:
    """Where `autopp plan` keeps the profile it plans from: profiles/MODEL (or profiles/CONFIG) when measured here,
    profiles/MODEL-DEVICE when analytic for `--device` (`analytic_target`), with the length and recipe when given
    (`profile_dir_name`), as `autopp profile --analytic` names it."""
    device = analytic_target(getattr(args, "device", None))
    return DEFAULT_PROFILE_DIR / profile_dir_name(args, device, device is not None)


def profile_dir_name(args: argparse.Namespace, device: str | None, gpu: bool) -> str:
    """A default profile directory's name: the model's stem (`model_stem`), `-DEVICE` when analytic for it (the
    catalog's name), `-sS` for an HF config's --seq-len S other than the default (`DEFAULT_SEQ_LEN`, which names
    nothing), `-P` for a --precision P and `-O` for an --optimizer O other than the target's
    default (bf16 and adamw on a GPU, fp32 and sgd here), `-fused` for --kernels fused, as scripts/published.py
    names its profiles: each length, recipe, optimizer and kernels has a directory of its own (a tester:
    `--optimizer adam` overwrote the shipped profiles/gpt)."""
    name = model_stem(args) + (f"-{device}" if device else "")
    if getattr(args, "hf_config", None) and getattr(args, "seq_len", None) not in (None, DEFAULT_SEQ_LEN):
        name += f"-s{args.seq_len}"
    default = recipe_of_dtype(default_dtype(gpu))
    if getattr(args, "precision", None) and args.precision != getattr(default, "name", None):
        name += f"-{args.precision}"
    if getattr(args, "optimizer", None) and args.optimizer != ("adamw" if gpu else "sgd"):  # `optimizer_of`'s default
        name += f"-{args.optimizer}"
    if getattr(args, "kernels", None) == "fused":
        name += "-fused"
    return name


def analytic_target(device: str | None) -> str | None:
    """The catalog device `autopp plan --device NAME` profiles analytically for: NAME unless it is this machine (the
    `cpu` entry, which is measured here); None without --device. A device given as a JSON file is a catalog entry
    too (`load_device`)."""
    from ..data.catalog import load_device
    name = None if device is None else load_device(device).name
    return None if name == "cpu" else name  # the catalog's entry for this machine (docs/devices.md)


def default_dtype(gpu: bool) -> DType:
    """The dtype a profile defaults to: bfloat16 mixed precision (bf16 weights and activations, fp32 master weights
    and optimizer state, as every published large run trains) for a GPU, float32 on the CPU, whose bfloat16 matmuls
    are slow (docs/devices.md)."""
    return "bfloat16" if gpu else "float32"
