"""Sequence pipelining: equal-cost chunk boundaries, the Seq1F1B order, unit costs, and the chunk count's choice."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from autopp.errors import ScheduleError
from autopp.schedule import Kind, ScheduleName, StageCost, build_schedule, simulate
from autopp.schedule.named import one_f_one_b, seq_1f1b
from autopp.schedule.seqpipe import (LayerShape, attention_share, choose_chunks, chunk_costs, chunk_lengths,
                                     chunk_peaks, chunked_order, kv_share, simulate_chunks)

LLAMA_8B_32K = LayerShape(hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, seq_len=32768)


def _costs(p: int, forward: float, activation: int, overhead: float = 0.0) -> list[StageCost]:
    return [StageCost(forward_s=forward, backward_input_s=forward, backward_weight_s=forward, static_bytes=10**9,
                      activation_bytes=activation, overhead_s=overhead) for _ in range(p)]


def test_attention_share_and_kv_share_by_hand() -> None:
    # per token / h: linear 4h + h (GQA 8 of 32) + 6f = 106496; attention 2s = 65536
    assert attention_share(LLAMA_8B_32K) == pytest.approx(65536 / (106496 + 65536))
    assert kv_share(LLAMA_8B_32K) == pytest.approx(4 * 1024 / (34 * 4096))
    short = LayerShape(hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, seq_len=2048)
    assert attention_share(short) < 0.04 < attention_share(LLAMA_8B_32K)


def test_chunks_equalise_cost_and_shrink_towards_the_end() -> None:
    share = attention_share(LLAMA_8B_32K)
    lengths = chunk_lengths(32768, 4, share, multiple=128)
    assert sum(lengths) == 32768 and all(n % 128 == 0 for n in lengths)
    assert list(lengths) == sorted(lengths, reverse=True) and lengths[0] > lengths[-1] * 1.5
    costs = chunk_costs(lengths, share, 0.0)
    assert sum(costs.time) == pytest.approx(1.0)
    assert max(costs.time) - min(costs.time) < 128 / 32768 * 2  # equal to within the rounding to 128 tokens
    assert chunk_lengths(1000, 4, 0.0) == (250, 250, 250, 250)  # no attention: equal lengths


@pytest.mark.parametrize("args, message", [
    ((100, 0, 0.3), r"`chunks` >= 1 and a multiple >= 1 \(0, 1\)"),
    ((100, 4, 1.0), r"attention share must be in \[0, 1\) \(1\)"),
    ((300, 4, 0.3, 128), r"`seq_len` a multiple of 128 and >= chunks x 128 \(300, 4 chunks\)"),
    ((256, 4, 0.3, 128), r"`seq_len` a multiple of 128 and >= chunks x 128 \(256, 4 chunks\)"),
])
def test_chunk_lengths_refuse_with_numbers(args: tuple[int, ...], message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        chunk_lengths(*args)  # type: ignore[arg-type]


def test_one_chunk_is_1f1b() -> None:
    for p, m in itertools.product(range(1, 5), range(1, 9)):
        for r in range(p):
            assert seq_1f1b(r, p, m, 1) == one_f_one_b(r, p, m, 1)
    assert build_schedule(ScheduleName.SEQ_1F1B, 3, 4) == build_schedule(ScheduleName.ONE_F_ONE_B, 3, 4)


def test_chunked_order_runs_every_unit_backward_in_reverse_chunk_order() -> None:
    for p, m, k in itertools.product(range(1, 5), range(1, 5), range(1, 5)):
        order = chunked_order(p, m, k)
        for r, acts in order.items():
            forwards = [a.microbatch for a in acts if a.kind is Kind.F]
            backwards = [a.microbatch for a in acts if a.kind is Kind.B]
            assert forwards == list(range(m * k))
            assert backwards == [mb * k + c for mb in range(m) for c in reversed(range(k))]
        simulate(order, _costs(p, 1.0, 1), list(range(p)), [0.1] * (p - 1))  # no deadlock


def test_kv_of_earlier_chunks_is_held_until_their_own_backward() -> None:
    """One rank, one microbatch, two chunks: both units are held when chunk 1's backward starts, chunk 1 with the
    K/V of chunk 0's tokens it saved."""
    chunks = chunk_costs((600, 400), 0.3, 0.1)
    assert chunks.memory == pytest.approx((0.6, 0.9 * 0.4 + 0.1 * 1.0))
    order = chunked_order(1, 1, 2)
    assert [str(a) for a in order[0]] == ["0F0", "0F1", "0B1", "0B0"]
    assert chunk_peaks(order, _costs(1, 1.0, 1000), chunks) == [10**9 + 600 + 460]
    # a reviewer: each unit's outputs, its chunk's share of the tokens, are held too (torch's stage keeps them)
    with_outputs = [replace(c, output_bytes=100) for c in _costs(1, 1.0, 1000)]
    assert chunk_peaks(order, with_outputs, chunks) == [10**9 + 600 + 460 + 60 + 40]


def test_seq1f1b_wins_at_32k_on_memory_and_time() -> None:
    """Seq1F1B (NAACL 2025) reports 1.14x the throughput of 1F1B at about half its memory: at 32K tokens on four
    stages with four microbatches the search picks chunks > 1, and its step and peak beat 1F1B's."""
    choice = choose_chunks(_costs(4, 1.0, 10**10, overhead=1e-3), [0.01] * 3, 4, LLAMA_8B_32K, multiple=128)
    one_f_one_b_run = choice.candidates[0]
    assert one_f_one_b_run.chunks == 1 and choice.chosen.chunks > 1
    assert choice.chosen.step_time_s < one_f_one_b_run.step_time_s / 1.1
    assert choice.chosen.peak_bytes < one_f_one_b_run.peak_bytes * 0.6


def test_1f1b_kept_where_chunks_only_add_overhead() -> None:
    """Short sequences on a pipeline with many microbatches: the bubble is small already, and each extra unit pays
    its message overhead, so the search keeps one chunk (1F1B)."""
    short = LayerShape(hidden=4096, ffn_hidden=14336, heads=32, kv_heads=8, seq_len=2048)
    choice = choose_chunks(_costs(2, 0.01, 10**8, overhead=5e-3), [1e-3], 16, short)
    assert choice.chosen.chunks == 1
    assert all(c.step_time_s > choice.chosen.step_time_s for c in choice.candidates[1:])


def test_memory_limit_picks_a_fitting_chunk_count_or_refuses() -> None:
    costs, comm = _costs(4, 0.01, 10**10, overhead=1e-2), [1e-3] * 3
    free = choose_chunks(costs, comm, 4, LLAMA_8B_32K, multiple=128)
    assert free.chosen.chunks == 1  # overhead dominates: 1F1B is fastest without a limit
    limit = free.candidates[-1].peak_bytes
    tight = choose_chunks(costs, comm, 4, LLAMA_8B_32K, memory_limit=limit, multiple=128)
    assert tight.chosen.chunks == 8 and tight.chosen.peak_bytes <= limit
    with pytest.raises(ScheduleError, match=r"no chunk count fits `memory_limit` \(least peak [\d.]+ GB > 1.00 GB\)"):
        choose_chunks(costs, comm, 4, LLAMA_8B_32K, memory_limit=10**9, multiple=128)


def test_simulated_units_cost_their_share() -> None:
    """Two chunks on one rank: the step is the microbatch's compute (shares sum to about 1) plus one overhead per
    extra action."""
    share = attention_share(LLAMA_8B_32K)
    chunks = chunk_costs(chunk_lengths(32768, 2, share, 128), share, 0.0)
    run = simulate_chunks(_costs(1, 1.0, 10, overhead=0.5), [], 1, chunks)
    assert run.step_time_s == pytest.approx(3 * 2 * max(chunks.time) + 4 * 0.5)
