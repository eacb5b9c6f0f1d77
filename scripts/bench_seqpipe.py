"""Simulated Seq1F1B (sequence pipelining, Sun et al., NAACL 2025) against 1F1B on a long-sequence Llama.

Seq1F1B reports 1.14x the throughput of 1F1B at about half its memory. Here: a Llama config (default
examples/configs/llama-3-8b.json) at --seq-len tokens (default 32768) on --pp H100 SXM stages (one per GPU, NVLink
between them), microbatch 1, --microbatches sequences per step, each stage an equal share of the layers, the embedding
on the first and the LM head on the last. Stage costs in closed form (no profile is measured):
  forward FLOPs   per token and layer 4h^2 + 4h h_kv + 6hf + 2hs (autopp.schedule.seqpipe.attention_share), head 2hV
  time            FLOPs / (bf16 peak x --mfu), backward input and weight passes each the forward's time
  activations     34 s h bytes per layer (Korthikanti et al. 2022, Table 2, no s x s scores: flash attention)
  static          16 bytes per parameter (bf16 weights and gradients, fp32 master and Adam moments)
  transfer        2 s h bytes per stage boundary over the catalog's NVLink bandwidth
For chunks k the sequence is split by `chunk_lengths` (boundaries a multiple of 128 tokens, equal cost) and simulated
by `autopp.schedule.seqpipe.simulate_chunks`; k = 1 is 1F1B. The LM head's time is split by the layers' shares (an
approximation: it has no attention). No per-unit overhead is charged: shorter chunks running at lower GPU efficiency
is not modelled, so the time gain is an upper bound. Simulator figures are exact and repeatable.

    .venv/bin/python scripts/bench_seqpipe.py
    .venv/bin/python scripts/bench_seqpipe.py --seq-len 65536 --pp 8 --microbatches 16

With --profile DIR (a profile of a causal LM with its attention shape, e.g. the shipped
profiles/llama-3.1-8b-h100-sxm-s32768) the planner instead: `make_plan` on --pp devices of --device with
--microbatches sequences per step, searched (Seq1F1B offered), the named schedules alone (its note's figures), and
1F1B pinned with recomputation searched and with every stage keeping its activations.

    .venv/bin/python scripts/bench_seqpipe.py --profile profiles/llama-3.1-8b-h100-sxm-s32768 --pp 16 --microbatches 16
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from autopp.data.catalog import load_device
from autopp.schedule import ScheduleName, StageCost
from autopp.schedule.seqpipe import LayerShape, attention_share, chunk_costs, chunk_lengths, kv_share, simulate_chunks

ROOT = Path(__file__).resolve().parent.parent


def _shape(config: dict[str, int], seq_len: int) -> LayerShape:
    return LayerShape(hidden=config["hidden_size"], ffn_hidden=config["intermediate_size"],
                      heads=config["num_attention_heads"],
                      kv_heads=config.get("num_key_value_heads", config["num_attention_heads"]), seq_len=seq_len)


def stage_costs(config: dict[str, int], shape: LayerShape, pp: int, mfu: float) -> list[StageCost]:
    """Closed-form per-microbatch costs of `pp` equal stages (the module docstring)."""
    h, s, f, vocab = shape.hidden, shape.seq_len, shape.ffn_hidden, config["vocab_size"]
    h_kv = h * shape.kv_heads // shape.heads
    layers = config["num_hidden_layers"]
    if layers % pp:
        raise SystemExit(f"--pp must divide the {layers} layers ({layers} % {pp} = {layers % pp})")
    speed = load_device("h100-sxm").peak_flops["bfloat16"] * mfu
    per_layer = s * (4 * h * h + 4 * h * h_kv + 6 * h * f + 2 * h * s)
    layer_params = 2 * h * h + 2 * h * h_kv + 3 * h * f
    costs = []
    for i in range(pp):
        head = s * 2 * h * vocab if i == pp - 1 else 0
        forward = (per_layer * layers // pp + head) / speed
        params = layer_params * layers // pp + (vocab * h if i in (0, pp - 1) else 0)
        costs.append(StageCost(forward_s=forward, backward_input_s=forward, backward_weight_s=forward,
                               static_bytes=16 * params, activation_bytes=34 * s * h * layers // pp))
    return costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples/configs/llama-3-8b.json"))
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--mfu", type=float, default=0.5, help="achieved share of the bf16 peak (assumed)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--profile", help="plan this profile instead (module docstring)")
    ap.add_argument("--device", default="h100-sxm", help="with --profile: the catalog device of every rank")
    args = ap.parse_args()
    if args.profile:
        return planned(args.profile, args.device, args.pp, args.microbatches)
    config = json.loads(Path(args.config).read_text())
    shape = _shape(config, args.seq_len)
    costs = stage_costs(config, shape, args.pp, args.mfu)
    link = load_device("h100-sxm").intra_node_link.link.bandwidth_bytes_per_s
    comm = [2 * shape.seq_len * shape.hidden / link] * (args.pp - 1)
    share, kv = attention_share(shape), kv_share(shape)
    print(f"{Path(args.config).name} at {args.seq_len} tokens, pp {args.pp}, {args.microbatches} microbatches, "
          f"attention share {share:.3f}, K/V share of activations {kv:.3f}")
    print(f"{'schedule':<14} {'chunk lengths':<44} {'step s':>8} {'speedup':>8} {'peak GB':>8} {'memory':>7}")
    base = None
    for k in args.chunks:
        lengths = chunk_lengths(shape.seq_len, k, share, multiple=128)
        run = simulate_chunks(costs, comm, args.microbatches, chunk_costs(lengths, share, kv))
        base = base or run
        name = "1F1B" if k == 1 else f"Seq1F1B k={k}"
        shown = ",".join(map(str, lengths)) if k <= 4 else f"{lengths[0]}..{lengths[-1]}"
        print(f"{name:<14} {shown:<44} {run.step_time_s:8.3f} {base.step_time_s / run.step_time_s:7.2f}x "
              f"{run.peak_bytes / 1e9:8.1f} {run.peak_bytes / base.peak_bytes:6.0%}")


def planned(profile_dir: str, device: str, pp: int, microbatches: int) -> None:
    """The planner's choice on `pp` devices against the named schedules and 1F1B (module docstring)."""
    from dataclasses import replace

    from autopp.data.catalog import cluster_from_catalog
    from autopp.data.layout import LayoutPins
    from autopp.data.profile import load_profile
    from autopp.errors import InfeasibleError
    from autopp.solve import PlanRequest, RecomputeMode, make_plan

    profile = load_profile(profile_dir)
    base = PlanRequest(cluster=cluster_from_catalog(load_device(device), pp), global_batch=microbatches, schedule=None,
                       pins=LayoutPins(pp=pp), recompute=RecomputeMode.AUTO)
    rows = [("searched", base), ("1F1B, recompute searched", replace(base, schedule=ScheduleName.ONE_F_ONE_B)),
            ("1F1B, keep", replace(base, schedule=ScheduleName.ONE_F_ONE_B, recompute=RecomputeMode.NONE))]
    print(f"{Path(profile_dir).name}: pp {pp} x {device}, {microbatches} sequences per step")
    print(f"{'request':<26} {'schedule':<28} {'step s':>8} {'peak GiB':>9}  note")
    for name, req in rows:
        try:
            plan = make_plan(profile, req)
        except InfeasibleError as exc:
            print(f"{name:<26} {'(none fits)':<28} {'':>8} {'':>9}  {str(exc).split(';')[0]}")
            continue
        what = plan.schedule.value + (f" k={len(plan.seq_chunks.lengths)}" if plan.seq_chunks else "")
        what += f" m={plan.num_microbatches}" + (" +recompute" if any(s.activation.value != "keep"
                                                                          for s in plan.stages) else "")
        note = next((n for n in plan.notes if n.startswith("sequence pipelining chosen")), "")
        print(f"{name:<26} {what:<28} {plan.predicted.step_time_s:8.3f} "
              f"{max(plan.predicted.peak_memory_bytes) / 2**30:9.1f}  {note}")


if __name__ == "__main__":
    main()
