"""`autopp plan --pin-from FILE`: the user's trainer configuration read beside the plan, with the batch and the
sequence length it trains, so that both plans are judged on the same work."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import AutoppError

__all__ = ["read_pin", "batch_of", "pinned_seq_len"]


def read_pin(args: argparse.Namespace, profile: Any, request: Any) -> tuple[Any, list[str]]:
    """--pin-from: the user's trainer configuration (checked before the search and before anything is written) and
    notes on how it is judged. Its global batch and sequence length must be the plan's (`--global-batch`, and the
    profile's HF sequence length)."""
    from ..export import read_pinned
    from ..solve.assemble.pinned import check_pinned
    pinned, notes = read_pinned(args.pin_from, profile.meta.unit_names, request.cluster.num_devices)
    check_pinned(pinned, profile.num_units, request.cluster.num_devices)
    batch = batch_of(pinned)
    if args.global_batch and batch != request.global_batch:
        raise AutoppError(f"{args.pin_from}: its global batch is {batch}, --global-batch is {request.global_batch}; "
                          f"give --global-batch {batch} so both plans train the same batch")
    _check_profile_seq_len(args, profile)
    return pinned, notes + _kernels_note(args.pin_from, profile)


def _kernels_note(path: str, profile: Any) -> list[str]:
    """Where the configuration runs other elementwise kernels than the profile counted (a new user: a torchtitan
    config without torch.compile was judged as fast as autopp's fused plan, whose export compiles)."""
    from ..data.precision import counted_kernels
    from ..export import config_kernels
    counted = counted_kernels(profile.meta.extra)
    runs, why = config_kernels(path)
    if counted is None or runs == counted:
        return []
    return [f"{path} runs {runs} elementwise kernels ({why}), the profile counted {counted}: both configurations "
            f"are predicted with {counted} kernels, so yours runs {'faster' if runs == 'fused' else 'slower'} than "
            f"its prediction; count the profile with `--kernels {runs}` to judge it as it runs"]


def batch_of(pinned: Any) -> int:
    """The global batch of a pinned configuration."""
    c = pinned.candidate
    return int(c.microbatches * c.microbatch_size * c.layout.dp)


def pinned_seq_len(args: argparse.Namespace) -> str:
    """--pin-from with --hf-config: the sequence length the configuration trains (`config_seq_len`) is the one
    profiled, unless --seq-len gives it (another is refused); returns the line that says so ("" when nothing was
    taken). Issue 26: a TOML of 8192 tokens was judged on a profile of the 512-token default."""
    from ..export import config_seq_len
    if not (args.pin_from and args.hf_config):
        return ""
    seq = config_seq_len(args.pin_from)
    if seq is None:
        return ""
    if args.seq_len is not None and args.seq_len != seq:
        raise AutoppError(f"{args.pin_from}: its sequence length is {seq} tokens, --seq-len is {args.seq_len}; "
                          f"give --seq-len {seq} so both plans train the same sequences")
    if args.seq_len is not None:
        return ""
    args.seq_len = seq
    return f"autopp: note: sequence length {seq} tokens, that of {args.pin_from} (the default with --pin-from)"


def _check_profile_seq_len(args: argparse.Namespace, profile: Any) -> None:
    """--pin-from with --profile DIR of an HF config: the configuration's sequence length must be the profile's."""
    from ..export import config_seq_len
    hf = profile.meta.extra.get("hf_config")
    made = hf.get("seq_len") if isinstance(hf, dict) else None
    seq = config_seq_len(args.pin_from)
    if args.profile and made is not None and seq is not None and int(made) != seq:
        raise AutoppError(f"{args.pin_from}: its sequence length is {seq} tokens, the profile {args.profile} was "
                          f"made for {made}; profile at {seq} (`autopp profile --hf-config C.json --seq-len {seq}`) "
                          "or plan with --hf-config C.json, which profiles at the configuration's length")
