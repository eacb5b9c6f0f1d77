"""Sequence-chunked pipelining (Seq1F1B): the K/V cache's gradient feedback, in one process and on 2 CPU ranks
through torch's CSV schedule runtime, against the same model run on whole sequences."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage

from autopp.run.pipeline import custom_schedule
from autopp.run.seq_chunks import unit_rows
from autopp.schedule.seqpipe import chunked_order
from tests.models import chunklm


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
