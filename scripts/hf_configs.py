"""Build each HF config under examples/configs/ on the meta device and print its parameters and build time.

Each config is built with autopp's own path (autopp.model.hf.hf_model_file(config).build() under
`with torch.device("meta")`), so nothing is allocated: the 70 B model builds as fast as the tiny one. The time is
the median of --repeats builds, after transformers and the model class are imported once (a first build is slower);
the spread is max - min over the repeats.

    .venv/bin/python scripts/hf_configs.py
    .venv/bin/python scripts/hf_configs.py --repeats 5 examples/configs/llama-3-8b.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from autopp.model.hf import hf_model_file

CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"


def _build_times(config: Path, repeats: int) -> tuple[int, list[float]]:
    mf = hf_model_file(config)
    with torch.device("meta"):
        params = sum(p.numel() for p in mf.build().parameters())  # imports the model class: not timed
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            mf.build()
            times.append(time.perf_counter() - start)
    return params, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", type=Path, help="config.json files (default: examples/configs/*.json)")
    parser.add_argument("--repeats", type=int, default=3, help="timed builds per config (default 3)")
    args = parser.parse_args()
    configs = args.configs or sorted(CONFIGS.glob("*.json"))
    print(f"{'config':<20} {'parameters':>16} {'billions':>9} {'build (s)':>10} {'spread (s)':>10}")
    for config in configs:
        params, times = _build_times(config, args.repeats)
        print(f"{config.stem:<20} {params:>16,} {params / 1e9:>9.3f} {statistics.median(times):>10.3f} "
              f"{max(times) - min(times):>10.3f}")


if __name__ == "__main__":
    main()
