"""Simulated vocabulary parallelism on the paper's headline case: a 4B-parameter model with a 256K vocabulary on 8
A100 (Yeung et al., "Balancing Pipeline Parallelism with Vocabulary Parallelism", MLSys 2025: MFU 27.6 % -> 57.3 %,
peak memory 33.9 -> 27.4 GB against the naive layout).

The model is examples/configs/vocab-4b-256k.json (32 layers, hidden 3072, 24 heads, vocabulary 256000, untied: the
paper's 4B setting in Llama form, its MLP as wide in FLOPs as GPT's 4h), profiled analytically for an A100 80GB:

    .venv/bin/python -m autopp profile --hf-config examples/configs/vocab-4b-256k.json --analytic a100-80gb \\
        --seq-len 2048 --microbatch-sizes 1 --tp 1 -o profiles/vocab-4b-256k
    .venv/bin/python scripts/bench_vocab_sim.py --profile profiles/vocab-4b-256k

1F1B on 8 ranks (the catalog's A100 80GB links), microbatch 1, --microbatches microbatches (the paper: 128). Layouts:
"naive" (4 layers per stage, the embedding on the first and the head on the last, as Megatron splits by default),
"plain" (autopp's best split without vocabulary parallelism: the paper's layer-redistribution baseline), and each
variant of vocabulary parallelism (autopp.solve.search.vocab). MFU counts the model's FLOPs as Megatron does
(Narayanan et al. 2021, eq. 3: 72 B s L h^2 (1 + s / 6h + V / 12 L h)) over the step time and the 8 devices' bf16
peak. Simulator figures are exact and repeatable.
"""

from __future__ import annotations

import argparse
import sys

from autopp.costmodel import unit_arrays
from autopp.costmodel.vocab import body_arrays, vocab_link, vocab_passes
from autopp.data.catalog import cluster_from_catalog, load_device
from autopp.data.layout import Layout
from autopp.data.profile import load_profile
from autopp.schedule import Activation, ScheduleName
from autopp.solve.search.judge import Candidate, judge
from autopp.solve.search.vocab import choose_vocab

LAYERS, HIDDEN, SEQ, VOCAB, RANKS = 32, 3072, 2048, 256000, 8


def model_flops(microbatches: int) -> float:
    """Megatron's count of one step's FLOPs (forward and backward) for `microbatches` sequences."""
    return 72 * microbatches * SEQ * LAYERS * HIDDEN**2 * (1 + SEQ / (6 * HIDDEN) + VOCAB / (12 * LAYERS * HIDDEN))


def naive(profile_units: int) -> tuple[tuple[int, int], ...]:
    """Layers split evenly; the embedding with the first stage's layers, the head with the last's."""
    per = (profile_units - 2) // RANKS
    cuts = [0] + [1 + per * k for k in range(1, RANKS)] + [profile_units]
    return tuple(zip(cuts[:-1], cuts[1:]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--microbatches", type=int, default=128)
    ap.add_argument("--device", default="a100-80gb")
    args = ap.parse_args(argv)
    profile = load_profile(args.profile)
    a = unit_arrays(profile, 1)
    spec = load_device(args.device)
    cluster = cluster_from_catalog(spec, RANKS)
    choice = choose_vocab(a, cluster, RANKS, args.microbatches, 1)
    base = choice.without.verdict.candidate
    naive_c = Candidate(schedule=ScheduleName.ONE_F_ONE_B, layout=Layout(pp=RANKS), microbatches=args.microbatches,
                        microbatch_size=1, bounds=naive(a.n),
                        activations=(Activation.KEEP,) * RANKS)
    rows = [("naive", judge(a, cluster, naive_c)), ("plain", choice.without.verdict)]
    rows += [(o.variant.value, o.verdict) for o in choice.options if o.variant is not None]
    peak = spec.peak("bfloat16") * RANKS
    flops = model_flops(args.microbatches)
    print(f"{profile.meta.model_path}: {a.n} units, 1F1B on {RANKS} x {args.device}, {args.microbatches} "
          f"microbatches of 1 x {SEQ} tokens; unit 0 F {a.forward[0] * 1e3:.2f} ms, head F "
          f"{a.forward[-1] * 1e3:.2f} ms, a layer F {a.forward[1] * 1e3:.2f} ms")
    print(f"{'layout':<10}{'step s':>9}{'MFU %':>8}{'peak GB':>9}{'bubble %':>10}  stages (units)")
    for name, v in rows:
        sizes = [j - i for i, j in v.candidate.bounds]
        print(f"{name:<10}{v.step_s:>9.3f}{100 * flops / (v.step_s * peak):>8.1f}{max(v.peak_memory) / 1e9:>9.1f}"
              f"{100 * v.bubble:>10.1f}  {sizes}")
    passes = vocab_passes(a, RANKS, vocab_link(cluster.placed(base.layout), RANKS, float(a.cut[a.n - 1])),
                          microbatches=args.microbatches)
    print(f"vocabulary passes per microbatch and rank: input {passes.input_s * 1e3:.2f} ms, output "
          f"{passes.output_s * 1e3:.2f} ms (collectives {passes.comm_s * 1e3:.2f} ms, {passes.link_bytes / 1e6:.1f} "
          f"MB); body units {body_arrays(a).n - 2}; chosen: "
          f"{choice.chosen.variant.value if choice.chosen.variant else 'plain'} (gain {100 * choice.gain:+.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
