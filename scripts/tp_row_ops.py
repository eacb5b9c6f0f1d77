"""Where a transformer block's tensor-parallel row goes, op by op: one block of a Hugging Face config counted by
autopp's own analytic count (autopp.measure.analytic.count_model, FakeTensorMode, nothing materialized) at tp 1 and
as TP rank 0's local shard at tp t (autopp.model.tp.local_model_file, the shard `counted_tp_rows` counts), each op
timed on the catalog device's roofline (autopp.costmodel.roofline, the profile's default efficiencies), grouped by
aten op name, the largest first. A column `t x tp t / tp 1` of 1.00 marks an op the shard runs whole per rank; 1/t
(0.12 at t 8) would be a fully sharded op.

    PYTHONPATH=$PWD python scripts/tp_row_ops.py examples/configs/llama-3-70b.json --seq-len 8192 --precision fp8 \
        --device h100-sxm --tp 8 --microbatch 1

The config is counted with three hidden layers (the middle block is the one the shipped profiles'
tp rows copy for every later layer). Quoted in docs/analytic.md ("Why a block's TP row is more than 1/t of it")."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import cast

from autopp.costmodel.roofline import OpCounts, default_efficiency, phase_time
from autopp.data.catalog import load_device
from autopp.measure.analytic import count_model, runs_fused_attention
from autopp.measure.options import DType, ProfileOptions
from autopp.measure.tp_rows import tp_setup
from autopp.model.hf import hf_model_file
from autopp.model.meta import build_meta
from autopp.model.tp import local_model_file
from autopp.model.tp_sequence import sequence_model_file
from autopp.data.precision import recipe


def op_seconds(ops: OpCounts, peak: float, linear_peak: float, bw: float, device: str) -> list[float]:
    """Each op's roofline seconds, as `OpCounts.load` and `phase_time` time it alone (its op overhead included, the
    phase's call overhead not; fused attention at its own efficiency)."""
    eff = default_efficiency(device)
    ridge = eff.ridge(peak, bw)
    linear = ops.linear or (False,) * len(ops.flops)
    return [phase_time(OpCounts((f,), (b,), (fast,), names=(n,)).load(ridge, linear_peak / peak,
                                                                      eff.attention_slowdown), peak, bw, eff)
            - eff.call_overhead_s for f, b, fast, n in zip(ops.flops, ops.bytes, linear, ops.names)]


def by_name(ops: OpCounts, seconds: list[float]) -> dict[str, list[float]]:
    """Per aten op name: [seconds, FLOPs, bytes, calls]."""
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
    for name, s, f, b in zip(ops.names, seconds, ops.flops, ops.bytes):
        row = table[name]
        row[0], row[1], row[2], row[3] = row[0] + s, row[1] + f, row[2] + b, row[3] + 1
    return table


def block_counts(config: Path, seq_len: int, options: ProfileOptions, t: int, fused: bool, sp: bool = False
                 ) -> dict[str, OpCounts]:
    """The passes of the model's second block (unit `*.layers.1`, inside the residual stream) counted at tp 1 (`t`
    1) or as rank 0's shard, with `sp` under sequence parallelism (autopp.model.tp_sequence)."""
    mf = hf_model_file(config, seq_len)
    if t > 1:
        setup = tp_setup(mf, build_meta(mf).model, (t,))
        mf = (sequence_model_file(mf, setup.resolved, setup.sequence, t) if sp
              else local_model_file(mf, setup.resolved, t))
    c = count_model(mf, options, fused_attention=fused)
    unit = next(i for i, u in enumerate(c.units) if u.name.endswith("layers.1"))
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
        one.write_text(json.dumps({**data, "num_hidden_layers": 3}))
        options = ProfileOptions(microbatch_sizes=(args.microbatch,), dtype=cast(DType, rec.dtype), precision=rec.name)
        fused = runs_fused_attention(spec)
        counts = {t: block_counts(one, args.seq_len, options, t, fused)[args.phase] for t in (1, args.tp)}
        counts[0] = block_counts(one, args.seq_len, options, args.tp, fused, sp=True)[args.phase]
    t = args.tp
    tables = {k: by_name(v, op_seconds(v, peak, linear_peak, bw, spec.name)) for k, v in counts.items()}
    total = {k: sum(r[0] for r in v.values()) for k, v in tables.items()}
    print(f"{args.config.name}, one block, {args.phase}, microbatch {args.microbatch} x {args.seq_len} tokens, "
          f"{rec.name} on {spec.name}: tp 1 {total[1] * 1e3:.2f} ms, tp {t} {total[t] * 1e3:.2f} ms; "
          f"{t} x tp {t} / tp 1 = {t * total[t] / total[1]:.2f}; with SP tp {t} {total[0] * 1e3:.2f} ms, "
          f"{t} x / tp 1 = {t * total[0] / total[1]:.2f}")
    print(f"{'op':44} {'calls':>5} {'GFLOP':>8} {'GB tp1':>7} {'GB tpt':>7} {'GB SP':>7} {'ms tp1':>7} "
          f"{'ms tpt':>7} {'t*tpt/tp1':>9} {'ms SP':>7} {'t*SP/tp1':>8} {'excess':>7}")
    excess = t * total[t] - total[1]
    names = sorted(set(tables[1]) | set(tables[0]), key=lambda n: -max(tables[1].get(n, [0.0])[0],
                                                                        t * tables[0].get(n, [0.0])[0]))
    for name in names[:args.top]:
        one_, at_t, sp = (tables[k].get(name, [0.0, 0.0, 0.0, 0.0]) for k in (1, t, 0))
        share = (t * at_t[0] - one_[0]) / excess if excess else 0.0

        def ratio(x: float) -> str:
            return f"{t * x / one_[0]:.2f}" if one_[0] else "-"
        print(f"{name[6:] if name.startswith('aten::') else name:44} {int(one_[3]):5d} {one_[1] / 1e9:8.0f} "
              f"{one_[2] / 1e9:7.3f} {at_t[2] / 1e9:7.3f} {sp[2] / 1e9:7.3f} {one_[0] * 1e3:7.3f} "
              f"{at_t[0] * 1e3:7.3f} {ratio(at_t[0]):>9} {sp[0] * 1e3:7.3f} {ratio(sp[0]):>8} {share:7.1%}")
    rest = names[args.top:]
    if rest:
        print(f"{'(' + str(len(rest)) + ' other op names)':44} {'':5} {'':8} {'':7} {'':7} {'':7} "
              + " ".join(f"{sum(tables[k].get(n, [0.0])[0] for n in rest) * 1e3:7.3f}" for k in (1, t, 0)))

if __name__ == "__main__":
    main()
