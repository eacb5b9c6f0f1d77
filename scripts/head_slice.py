"""The LM head's times measured whole and on slices of its vocabulary (autopp.measure.head), side by side.

    PYTHONPATH=. .venv/bin/python scripts/head_slice.py [--vocab 32768] [--hidden 512] [--seq-len 256] [--k 8]

Builds a one-layer Llama from examples/configs/tiny-llama.json with the given vocabulary and hidden size, and
measures its last unit (final norm, head, loss) `--rounds` times each way, alternating, on one thread: whole, and on
slices of 2 V / k and V / k rows extrapolated to V. Prints the median of the rounds and their spread per kind of time,
and the ratio sliced / whole (the claim: within a few %). Times on a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from autopp.measure.options import MeasureOptions, ProfileOptions
from autopp.measure.pieces import measure_pieces
from autopp.measure.settings import Settings
from autopp.model.hf import hf_model_file
from autopp.model.meta import build_units

KINDS = ("forward_s", "backward_input_s", "backward_weight_s", "backward_s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    config = json.loads((Path(__file__).parents[1] / "examples/configs/tiny-llama.json").read_text())
    config.update(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                  num_hidden_layers=1, max_position_embeddings=args.seq_len)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(config))
        mf = hf_model_file(path, seq_len=args.seq_len)
        meta, units, _ = build_units(mf, torch.float32)
        settings = Settings(ProfileOptions(), MeasureOptions(warmup=1, repeats=args.repeats))
        ways = {"whole": None, "sliced": args.hidden * args.vocab // args.k}
        got: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
        for _ in range(args.rounds):
            for way, numel in ways.items():
                at = measure_pieces(mf, meta, units, 1, settings, limit_bytes=0, head_slice_numel=numel)
                got[way].append(at.rows[-1])
    print(f"vocab {args.vocab}, hidden {args.hidden}, {args.seq_len} tokens, k {args.k}: median of {args.rounds} "
          f"rounds (spread), each the median of {args.repeats} runs")
    print(f"{'kind':<18} {'whole ms':>16} {'sliced ms':>16} {'sliced/whole':>13}")
    for kind in KINDS:
        whole, sliced = ([r[kind] * 1e3 for r in got[w]] for w in ways)
        cell = [f"{statistics.median(v):8.1f} ({max(v) - min(v):4.1f})" for v in (whole, sliced)]
        print(f"{kind:<18} {cell[0]:>16} {cell[1]:>16} {statistics.median(sliced) / statistics.median(whole):13.3f}")


if __name__ == "__main__":
    main()
