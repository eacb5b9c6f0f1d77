"""Sequence-chunked pipelining (Seq1F1B): the K/V cache's gradient feedback, in one process and on 2 CPU ranks
through torch's CSV schedule runtime, against the same model run on whole sequences; and `autopp run` of a Seq1F1B
plan through the normal runner path, validated against one process: tests/models/seqlm.py on 2 ranks, the tiny HF
Llama on 2 and 4 (pp 4, 2 microbatches in 4 chunks: the 4-rank case of seqlm's pp 4, 2 microbatches in 2 chunks,
with more chunks and rotary positions)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage

from autopp.data.layout import Layout
from autopp.data.plan import Plan
from autopp.errors import RunError
from autopp.run import RunOptions, run_plan
from autopp.run.pipeline import custom_schedule
from autopp.run.seq_chunks import SeqChunks, check_seq_plan, rotated, unit_rows
from autopp.schedule.seqpipe import ChunkCosts, chunked_order
from tests.models import chunklm, seqlm
from tests.run.conftest import ROOT, pipeline_plan

SEQLM = ROOT / "tests" / "models" / "seqlm.py"


def _reference(m: int, pieces: int = 2) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = chunklm.build(1, pieces)
    x, y = chunklm.batch(m)
    loss = chunklm.loss_fn(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_unit_rows_split_each_sequence_in_order() -> None:
    rows = unit_rows(torch.arange(12).reshape(2, 6), 3)
    assert rows.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    with pytest.raises(ValueError, match=r"equal chunks \(6 % 4 = 2\)"):
        unit_rows(torch.zeros(2, 6), 4)


def test_unit_rows_keep_a_microbatch_of_several_samples_together() -> None:
    """With microbatches of 2 samples, unit u holds both samples' chunk u % k of microbatch u // k."""
    batch = torch.arange(24).reshape(4, 6)  # 2 microbatches of 2 samples, 6 tokens
    rows = unit_rows(batch, 2, microbatch_size=2)
    assert rows.tolist() == [[0, 1, 2], [6, 7, 8], [3, 4, 5], [9, 10, 11],
                             [12, 13, 14], [18, 19, 20], [15, 16, 17], [21, 22, 23]]


def _chunked(k: int) -> ChunkCosts:
    return ChunkCosts((seqlm.SEQ // k,) * k, (1 / k,) * k, (1 / k,) * k)


def _seq_plan(pp: int, m: int, k: int, b: int = 1, dp: int = 1) -> Plan:
    per = seqlm.LAYERS // pp
    return pipeline_plan(SEQLM, [f"blocks.{per * i}" for i in range(1, pp)], "Seq1F1B", Layout(pp=pp, dp=dp), m, b,
                         seq_chunks=_chunked(k))


def test_the_chunk_mode_gives_the_whole_sequence_gradients_in_one_process() -> None:
    """`SeqChunks` over the model file's own causal SDPA (grouped-query), chunks forward in order and backward in
    reverse: loss and every gradient equal the whole-sequence run's."""
    torch.manual_seed(0)
    reference = seqlm.build_model()
    model = seqlm.build_model()
    model.load_state_dict(reference.state_dict())
    (x, pos), y = seqlm.sample_batch(1)
    loss = seqlm.loss_fn(reference(x, pos), y)
    loss.backward()
    k, caches = 3, SeqChunks([model], 3)
    losses = []
    with caches.attention():
        for c in range(k):
            xs, ps, ys = (unit_rows(t, k)[c:c + 1] for t in (x, pos, y))
            losses.append(seqlm.loss_fn(model(xs, ps), ys) / k)
        for chunk_loss in reversed(losses):
            chunk_loss.backward()
    torch.testing.assert_close(sum(x.detach() for x in losses), loss.detach())
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, msg=name)


def test_the_runner_refuses_what_it_does_not_chunk_in_one_line() -> None:
    plan = _seq_plan(2, 2, 2)
    with pytest.raises(RunError, match=r"seqlm.py: Seq1F1B runs model files that declare SEQUENCE_CHUNKS = True .* "
                                       r"and HF causal LMs of llama, qwen2, qwen3 .*; re-plan with --schedule 1F1B$"):
        check_seq_plan(plan, declared=False)
    check_seq_plan(plan, declared=True)
    odd = replace(plan, seq_chunks=ChunkCosts((7, 6), (0.5, 0.5), (0.5, 0.5)))
    with pytest.raises(RunError, match=r"chunks of equal length, and 13 tokens do not split into 2 \(13 % 2 = 1\)"):
        check_seq_plan(odd, declared=True)


@pytest.mark.integration
@pytest.mark.parametrize("pp, m, k, b, dp", [(2, 2, 3, 1, 1), (2, 1, 2, 2, 2)])
def test_autopp_run_runs_a_seq1f1b_plan_validated(pp: int, m: int, k: int, b: int, dp: int) -> None:
    """`run_plan` on pp x dp CPU ranks: pieces exported at one chunk's length, the batch as units, causal attention
    over the chunks; the runner validates loss and every gradient (and each step's update) against one process."""
    plan = _seq_plan(pp, m, k, b, dp)
    if k == 2:  # the planner's equal-cost chunks are unequal in length; the runner runs equal ones and says so
        plan = replace(plan, seq_chunks=ChunkCosts((seqlm.SEQ // 2 + 2, seqlm.SEQ // 2 - 2), (0.5, 0.5), (0.5, 0.5)))
    report = run_plan(plan, RunOptions(steps=2, timeout_s=300))
    assert report.passed and report.validated
    said = [n for n in report.notes if n.startswith("sequence pipelining: the plan's chunks are")]
    assert len(said) == (k == 2) and (k != 2 or f"autopp run ran 2 of {seqlm.SEQ // 2} tokens each" in said[0])


def test_chunks_backward_in_reverse_order_give_the_whole_sequence_gradients() -> None:
    """One process, k = 3: forwards chunk by chunk, backwards in reverse chunk order, each chunk's loss weighted by
    its share of the tokens: the loss and every gradient equal the whole-sequence run's."""
    loss, grads = _reference(2)
    k, model = 3, chunklm.build(3)
    x, y = chunklm.batch(2)
    total = torch.zeros(())
    for mb in range(2):
        xs, ys = unit_rows(x[mb:mb + 1], k), unit_rows(y[mb:mb + 1], k)
        losses = [chunklm.loss_fn(model(xs[c:c + 1]), ys[c:c + 1]) / (2 * k) for c in range(k)]
        for chunk_loss in reversed(losses):
            chunk_loss.backward()
            total = total + chunk_loss.detach()
    torch.testing.assert_close(total, loss)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], msg=name)


def _rank(rank: int, world: int, m: int, k: int, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = chunklm.build(k, world)
        piece = model[rank]
        x, y = chunklm.batch(m)
        rows, targets = unit_rows(x, k), unit_rows(y, k)
        n = chunklm.SEQ // k  # shapes given: torch's shape inference would run a forward and advance the caches
        hidden = torch.zeros(1, n, chunklm.WIDTH, requires_grad=True)  # requires grad: torch sends its gradient back
        inputs = rows[:1] if rank == 0 else hidden
        outputs = torch.zeros(1, n, chunklm.VOCAB) if rank == world - 1 else hidden
        stage = PipelineStage(piece, rank, world, torch.device("cpu"), input_args=inputs, output_args=outputs)
        order = chunked_order(world, m, k)
        schedule = custom_schedule([stage], [order[r] for r in range(world)], m * k, chunklm.loss_fn,
                                   Path(out) / f"order{rank}.csv")
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(rows)
        elif rank == world - 1:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        grads = {f"{rank}.{n}": p.grad for n, p in piece.named_parameters()}
        torch.save({"grads": grads, "losses": losses}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.parametrize("world, m, k", [(2, 2, 2), (2, 2, 3), (4, 3, 2)])
def test_seq1f1b_on_cpu_ranks_matches_one_process(tmp_path: Path, world: int, m: int, k: int) -> None:
    """Loss and every gradient of m sequences in k chunks on `world` ranks equal one process on whole sequences."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_rank, args=(world, m, k, init, str(tmp_path)), nprocs=world, join=True)
    loss, grads = _reference(m, world)
    saved = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    torch.testing.assert_close(torch.stack(saved[-1]["losses"]).mean(), loss)
    got = {n: g for s in saved for n, g in s["grads"].items()}
    assert set(got) == set(grads)
    for name, grad in grads.items():
        torch.testing.assert_close(got[name], grad, msg=name)


def test_rotated_keys_score_as_at_their_true_positions() -> None:
    """RoPE in HF's half-split layout: a key rotated for position j and turned by -d scores against a query rotated
    for position i as a key at j and a query at i + d would."""
    torch.manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    q, k = torch.randn(8), torch.randn(8)

    def at(x: torch.Tensor, pos: int) -> torch.Tensor:
        return rotated(x.reshape(1, 8), pos, inv_freq).reshape(8)

    i, j, d = 3, 1, 12
    torch.testing.assert_close(at(q, i) @ rotated(at(k, j).reshape(1, 8), -d, inv_freq).reshape(8),
                               at(q, i + d) @ at(k, j))


@pytest.mark.integration
@pytest.mark.parametrize("pp, k", [(2, 2), (4, 4)])
def test_an_hf_llama_runs_seq1f1b_validated(pp: int, k: int) -> None:
    """The tiny HF Llama (rotary positions computed inside the model, baked as 0..n-1 into the exported pieces):
    every earlier chunk's key turned to its true positions, validated against one process on whole sequences."""
    from tests.run.test_context_run import TINY_LLAMA, llama_plan

    pytest.importorskip("transformers")
    splits = [f"model.layers.{4 // pp * i}" for i in range(1, pp)]
    plan = replace(llama_plan(Layout(pp=pp), splits, "Seq1F1B", microbatch_size=1),
                   seq_chunks=ChunkCosts((16 // k,) * k, (1 / k,) * k, (1 / k,) * k))
    assert plan.model_path == str(TINY_LLAMA)
    report = run_plan(plan, RunOptions(steps=2, timeout_s=400))
    assert report.passed and report.validated
