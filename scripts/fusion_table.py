"""Each distinct unit of an HF config counted with eager and with fused elementwise kernels (autopp.measure.fusion),
timed on a catalog device's roofline: per pass, eager ms -> fused ms, the kernels (entries) of the forward, and what
the forward keeps for the backward (MiB per microbatch: eager's saved bytes -> fused kernels', `kept_bytes`). A
markdown table (quoted in docs/analytic.md, "Fused elementwise kernels").

    .venv/bin/python scripts/fusion_table.py examples/configs/llama-3-8b.json --seq-len 8192 --microbatch-size 1
    .venv/bin/python scripts/fusion_table.py examples/configs/qwen3-30b-a3b.json --seq-len 4096 --microbatch-size 4

Counts the model twice on the meta device, without TP rows (Llama-3-8B at 8,192 tokens: about 15 s; Qwen3-30B-A3B at
4 x 4,096: about 40 s on the 2-core development machine).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PASSES = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "selective_recompute_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="an HF config.json (examples/configs/)")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--microbatch-size", type=int, default=1)
    parser.add_argument("--device", default="h100-sxm", help="catalog device (default h100-sxm)")
    parser.add_argument("--precision", default="bf16", help="recipe (default bf16)")
    args = parser.parse_args()
    from autopp.costmodel.roofline import default_efficiency
    from autopp.data.catalog import load_device
    from autopp.data.hf_config import hf_source
    from autopp.data.precision import recipe
    from autopp.measure import ProfileOptions
    from autopp.measure.analytic import count_model, runs_fused_attention, unit_times
    from autopp.model.hf import load_model
    source = hf_source(args.config, args.seq_len, "causal-lm")
    model = load_model(source.config_path, source.to_json())
    spec, chosen = load_device(args.device), recipe(args.precision)
    eff = default_efficiency(spec.name)
    options = ProfileOptions(microbatch_sizes=(args.microbatch_size,), dtype=chosen.dtype, optimizer="adamw",
                             precision=chosen.name)
    counts = {k: count_model(model, options, fused_attention=runs_fused_attention(spec), kernels=k)
              for k in ("eager", "fused")}
    print(f"{args.config}, {args.microbatch_size} x {args.seq_len} tokens, {spec.name}, {chosen.name}: "
          "ms per pass, eager -> fused (ratio)\n")
    print("| unit | " + " | ".join(p.removesuffix("_s") for p in PASSES) + " | forward kernels | kept, MiB |")
    print("|---|" + "---:|" * (len(PASSES) + 2))
    for eager, fused in zip(counts["eager"].rows, counts["fused"].rows):
        if eager.same_as is not None:
            continue
        te, tf = (unit_times(r.counts, spec, chosen, eff) for r in (eager, fused))
        cells = [f"{te[p] * 1e3:.2f} -> {tf[p] * 1e3:.2f} ({tf[p] / te[p]:.2f})" if te[p] else "-" for p in PASSES]
        modules = counts["eager"].units[eager.unit].modules
        name = " ".join(modules) if len(modules) <= 3 else f"{' '.join(modules[:2])} ... {modules[-1]}"
        kept = f"{eager.counts.activation_bytes / 2**20:.0f} -> {fused.counts.activation_bytes / 2**20:.0f}"
        print(f"| {eager.unit} {name} | " + " | ".join(cells) +
              f" | {len(eager.counts.forward.flops)} -> {len(fused.counts.forward.flops)} | {kept} |")


if __name__ == "__main__":
    main()
