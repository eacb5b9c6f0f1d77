"""scripts/bench_causal_attention.py: one row per length and pass, the measured ratio beside the counted shares."""

from __future__ import annotations

import sys

import pytest

from .conftest import load_script


def test_it_prints_a_row_per_length_and_pass_with_the_counted_shares(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_script("bench_causal_attention")
    monkeypatch.setattr(sys, "argv", ["bench_causal_attention.py", "--tokens", "64", "1024", "--repeats", "1",
                                      "--heads", "1", "--head-dim", "8"])
    bench.main()
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 1,024")
            or line.startswith("| 64 ")]
    assert [r[1] for r in rows] == ["forward", "forward + backward"] * 2
    assert [r[5] for r in rows] == ["1.000"] * 2 + ["0.750"] * 2  # 512-key blocks: one block, then 3 of 4
    assert [r[6].rstrip(" |") for r in rows] == ["1.000"] * 2 + ["0.562"] * 2  # 128 x 128: 36 of 64 blocks
    assert all(float(r[4]) > 0 for r in rows)
