"""Where a transformer block's tensor-parallel row goes, op by op: one block of a Hugging Face config counted by
autopp's own analytic count (autopp.measure.analytic.count_model, FakeTensorMode, nothing materialized) at tp 1 and
as TP rank 0's local shard at tp t (autopp.model.tp.local_model_file, the shard `counted_tp_rows` counts), each op
timed on the catalog device's roofline (autopp.costmodel.roofline, the profile's default efficiencies), grouped by
aten op name, the largest first. A column `t x tp t / tp 1` of 1.00 marks an op the shard runs whole per rank; 1/t
(0.12 at t 8) would be a fully sharded op.

    PYTHONPATH=$PWD python scripts/tp_row_ops.py examples/configs/llama-3-70b.json --seq-len 8192 --precision fp8 \
        --device h100-sxm --tp 8 --microbatch 1

The config is counted with two hidden layers (the block is the same at any depth, and the unit the shipped profiles'
tp rows copy for every layer). Quoted in docs/analytic.md ("Why a block's TP row is more than 1/t of it")."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

from autopp.costmodel.roofline import OpCounts, default_efficiency
from autopp.data.catalog import load_device
from autopp.measure.analytic import count_model
from autopp.measure.options import ProfileOptions
from autopp.measure.tp_rows import tp_setup
from autopp.model.hf import hf_model_file
from autopp.model.meta import build_meta
from autopp.model.tp import local_model_file
from autopp.data.precision import recipe


def op_seconds(ops: OpCounts, peak: float, linear_peak: float, bw: float, device: str) -> list[float]:
    """Each op's roofline seconds as `OpCounts.load` and `phase_time` split and time it (its overhead included)."""
    eff = default_efficiency(device)
    ridge = eff.ridge(peak, bw)
    out = []
    for f, b, fast in zip(ops.flops, ops.bytes, ops.linear or (False,) * len(ops.flops)):
        f = f / (linear_peak / peak) if fast else f
        work = f / (peak * eff.compute) if f > ridge * b else b / (bw * eff.memory)
        out.append(work + eff.op_overhead_s)
    return out


def by_name(ops: OpCounts, seconds: list[float]) -> dict[str, list[float]]:
    """Per aten op name: [seconds, FLOPs, bytes, calls]."""
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for name, s, f, b in zip(ops.names, seconds, ops.flops, ops.bytes):
        row = table[name]
        row[0], row[1], row[2], row[3] = row[0] + s, row[1] + f, row[2] + b, row[3] + 1
    return table


def block_counts(config: Path, seq_len: int, options: ProfileOptions, t: int, fused: bool) -> dict[str, OpCounts]:
    """The passes of the model's first block (unit `*.layers.0`) counted at tp 1 (`t` 1) or as rank 0's shard."""
    mf = hf_model_file(config, seq_len)
    if t > 1:
        setup = tp_setup(mf, build_meta(mf).model, (t,))
        mf = local_model_file(mf, setup.resolved, t)
    c = count_model(mf, options, fused_attention=fused)
    unit = next(i for i, u in enumerate(c.units) if u.name.endswith("layers.0"))
    row = next(r for r in c.rows if r.unit == unit)
    return row.counts.passes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--device", default="h100-sxm")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--microbatch", type=int, default=1)
    ap.add_argument("--phase", default="forward", choices=["forward", "backward"])
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    rec = recipe(args.precision)
    if rec is None:
        raise SystemExit(f"no precision recipe {args.precision!r}")
    spec = load_device(args.device)
    (peak, linear_peak), bw = rec.peaks(spec), spec.memory_bandwidth_bytes_per_s
    data = json.loads(args.config.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        one = Path(tmp) / args.config.name
        one.write_text(json.dumps({**data, "num_hidden_layers": 2}))
        options = ProfileOptions(microbatch_sizes=(args.microbatch,), dtype=rec.dtype, precision=rec.name)
        counts = {t: block_counts(one, args.seq_len, options, t, not spec.memory_shared)[args.phase]
                  for t in (1, args.tp)}
    t = args.tp
    tables = {k: by_name(v, op_seconds(v, peak, linear_peak, bw, spec.name)) for k, v in counts.items()}
    total = {k: sum(r[0] for r in v.values()) for k, v in tables.items()}
    print(f"{args.config.name}, one block, {args.phase}, microbatch {args.microbatch} x {args.seq_len} tokens, "
          f"{rec.name} on {spec.name}: tp 1 {total[1] * 1e3:.2f} ms, tp {t} {total[t] * 1e3:.2f} ms; "
          f"{t} x tp {t} / tp 1 = {t * total[t] / total[1]:.2f}")
    print(f"{'op':44} {'ms tp1':>8} {'ms tp' + str(t):>8} {'t*tpt/tp1':>9} {'GFLOP tp1':>10} {'GB tp1':>8} "
          f"{'GB tp' + str(t):>8} {'calls':>5} {'share of excess':>15}")
    excess = t * total[t] - total[1]
    names = sorted(tables[1], key=lambda n: -tables[1][n][0])
    for name in names[:args.top]:
        one_, at_t = tables[1][name], tables[t].get(name, [0.0, 0.0, 0.0, 0.0])
        share = (t * at_t[0] - one_[0]) / excess if excess else 0.0
        print(f"{name:44} {one_[0] * 1e3:8.3f} {at_t[0] * 1e3:8.3f} {t * at_t[0] / one_[0]:9.2f} "
              f"{one_[1] / 1e9:10.1f} {one_[2] / 1e9:8.3f} {at_t[2] / 1e9:8.3f} {int(one_[3]):5d} {share:15.1%}")
    rest = [n for n in names[args.top:]]
    print(f"{'(' + str(len(rest)) + ' other op names)':44} {sum(tables[1][n][0] for n in rest) * 1e3:8.3f} "
          f"{sum(tables[t].get(n, [0.0])[0] for n in rest) * 1e3:8.3f}")


if __name__ == "__main__":
    main()
