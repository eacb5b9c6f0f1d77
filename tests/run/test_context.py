"""autopp.run.context: ring attention over a cp group of gloo ranks, against one process (loss and every gradient),
and the one-line refusals of what it cannot compute."""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch.nn import functional as F

from autopp.errors import ContextParallelError
from autopp.model.hf import hf_model_file
from autopp.run.context import (RingConfig, check_attention, check_sequence, context_parallel_backward, ring_attention,
                                shard_sequence)
from autopp.spawn import spawn_local

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = ROOT / "examples" / "configs" / "tiny-llama.json"
SEQ = 16
BATCH = 2
#: (causal load balancing, K/V rotation) run on the cp ranks, each against the same one-process reference.
CASES = [(False, "allgather"), (True, "allgather"), (True, "alltoall")]


def _llama_step(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor,
                target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; the all-ones attention_mask tells HF there is no padding, so it passes
    is_causal=True to SDPA instead of building a mask (with head-tail positions it would see packed sequences)."""
    logits = model(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids)).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    (ids,), target = hf_model_file(TINY_LLAMA, seq_len=SEQ).sample_batch(BATCH, seed=1)
    return ids, torch.arange(SEQ).expand(BATCH, SEQ), target


def _cp_rank(rank: int, ranks: int, port: int, queue: Any) -> None:
    """One cp rank: every case's full-sequence loss and gradients after context_parallel_backward (as numpy arrays:
    a tensor sent through the queue is shared memory that dies with this process)."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=ranks)
        results = {}
        for balance, rotate in CASES:
            model = hf_model_file(TINY_LLAMA, seq_len=SEQ).build(0)
            config = RingConfig(group=dist.group.WORLD, balance=balance, rotate=rotate)  # type: ignore[arg-type]
            loss = context_parallel_backward(model, lambda b: _llama_step(model, *b), _batch(), [1, 1, 1], config)
            grads = {n: _grad(p).numpy() for n, p in model.named_parameters()}
            results[(balance, rotate)] = (loss.numpy(), grads)
        dist.destroy_process_group()
        queue.put((rank, results, None))
    except Exception:
        queue.put((rank, None, traceback.format_exc(limit=4)))


@pytest.fixture(scope="module")
def cp2_results() -> dict[int, Any]:
    return spawn_local(_cp_rank, 2, (), timeout_s=600, what="running tiny Llama with cp=2")


@pytest.fixture(scope="module")
def reference() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = hf_model_file(TINY_LLAMA, seq_len=SEQ).build(0)
    ids, positions, target = _batch()
    loss = _llama_step(model, ids, positions, target)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.integration
@pytest.mark.parametrize(("balance", "rotate"), CASES)
def test_tiny_llama_cp2_matches_one_process(cp2_results: dict[int, Any], reference: Any, balance: bool,
                                            rotate: str) -> None:
    ref_loss, ref_grads = reference
    for rank in (0, 1):
        loss, grads = cp2_results[rank][(balance, rotate)]
        torch.testing.assert_close(torch.from_numpy(loss), ref_loss)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(torch.from_numpy(grad), ref_grads[name],
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def _attention_rank(rank: int, ranks: int, port: int, queue: Any) -> None:
    """q/k/v gradients of ring attention on cp=ranks, sharded like the inputs, for each case (non-causal too)."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=ranks)
        results = {}
        for balance, rotate, causal in [(b, r, True) for b, r in CASES] + [(False, "alltoall", False)]:
            config = RingConfig(group=dist.group.WORLD, balance=balance, rotate=rotate)  # type: ignore[arg-type]
            q, k, v, grad = _qkv()
            lq, lk, lv = (shard_sequence(t, 2, config).requires_grad_() for t in (q, k, v))
            with ring_attention(config):
                out = F.scaled_dot_product_attention(lq, lk, lv, is_causal=causal)
            out.backward(shard_sequence(grad, 2, config))
            results[(balance, rotate, causal)] = [out.detach().numpy()] + [_grad(t).numpy() for t in (lq, lk, lv)]
        dist.destroy_process_group()
        queue.put((rank, results, None))
    except Exception:
        queue.put((rank, None, traceback.format_exc(limit=4)))


def _qkv() -> list[torch.Tensor]:
    torch.manual_seed(3)
    return [torch.randn(2, 3, 32, 8) for _ in range(4)]


@pytest.mark.integration
def test_ring_attention_on_4_ranks_matches_sdpa_sharded_the_same_way() -> None:
    results = spawn_local(_attention_rank, 4, (), timeout_s=600, what="ring attention with cp=4")
    q, k, v, grad = _qkv()
    for (balance, rotate, causal), _ in results[0].items():
        fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(fq, fk, fv, is_causal=causal)
        out.backward(grad)
        expected = [out.detach()] + [_grad(t) for t in (fq, fk, fv)]
        for rank in range(4):
            order = _shard_order(32, 4, rank, balance)
            for got, want in zip(results[rank][(balance, rotate, causal)], expected):
                torch.testing.assert_close(torch.from_numpy(got), want.index_select(2, order))


def _shard_order(seq: int, cp: int, rank: int, balance: bool) -> torch.Tensor:
    """Token positions held by `rank` (head-tail chunks r and 2cp-1-r with balancing), written out independently."""
    if not balance:
        return torch.arange(seq).chunk(cp)[rank]
    chunks = torch.arange(seq).chunk(2 * cp)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]])


def test_sequence_must_split_into_2cp_chunks_with_load_balancing() -> None:
    check_sequence(16, 4, balance=True)
    check_sequence(12, 4, balance=False)
    with pytest.raises(ContextParallelError, match=r"^context parallelism needs seq % \(2\*cp\) == 0 \(seq 12, "
                                                   r"cp 4, causal load balancing\)$"):
        check_sequence(12, 4, balance=True)
    with pytest.raises(ContextParallelError, match=r"seq % \(cp\) == 0 \(seq 10, cp 4\)$"):
        check_sequence(10, 4, balance=False)


def _refusal(**overrides: Any) -> str:
    q, k, v = (torch.zeros(1, 4, 8, 2) for _ in range(3))
    call: dict[str, Any] = dict(q=q, k=k, v=v, attn_mask=None, dropout_p=0.0, is_causal=True, balance=True)
    call.update(overrides)
    with pytest.raises(ContextParallelError) as info:
        check_attention(**call)
    return str(info.value)


def test_sdpa_calls_ring_attention_cannot_compute_are_refused_in_one_line() -> None:
    check_attention(*(torch.zeros(1, 4, 8, 2) for _ in range(3)), attn_mask=None, dropout_p=0.0, is_causal=True,
                    balance=True)
    assert _refusal(q=torch.zeros(4, 8, 2)) == (
        "ring attention needs 4-D (batch, heads, seq, dim) q/k/v, got 3-D, 4-D, 4-D")
    assert _refusal(attn_mask=torch.ones(1, 1, 8, 8, dtype=torch.bool)) == (
        "ring attention takes no attn_mask (got (1, 1, 8, 8)); use is_causal=True and no padding mask")
    assert _refusal(dropout_p=0.1) == "ring attention needs dropout_p == 0 (got 0.1)"
    assert _refusal(is_causal=False) == "causal load balancing needs is_causal=True attention (got is_causal=False)"
    assert _refusal(k=torch.zeros(1, 4, 6, 2)) == "causal ring attention needs equal q and k/v lengths (q 8, k/v 6)"
    assert _refusal(k=torch.zeros(1, 3, 8, 2)) == "query heads must be a multiple of key/value heads (4 vs 3)"


@pytest.mark.parametrize("sdpa", [F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default],
                         ids=["functional", "aten-op"])
def test_both_spellings_of_sdpa_are_sent_to_the_ring(sdpa: Any) -> None:
    """The Python function (eager models) and the aten op (torch.export pieces, as the runner's stages call it): the
    refusal of a mask, raised before any communication, shows the call reached the ring."""
    q = torch.zeros(1, 4, 8, 2)
    mask = torch.ones(8, 8, dtype=torch.bool)
    never_used = cast(dist.ProcessGroup, None)  # the checks run before the group is read
    with ring_attention(RingConfig(group=never_used)), pytest.raises(ContextParallelError, match="no attn_mask"):
        sdpa(q, q, q, mask)
    torch.testing.assert_close(sdpa(q, q, q, mask), q)  # outside: plain SDPA again
