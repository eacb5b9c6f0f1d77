"""Vocabulary parallelism on the torch side: the sharded softmax cross-entropy against torch's, the layers found and
refused, the body model, and (integration) one step on 2 CPU ranks against one process (on 4 ranks:
tests/run/test_vocab_run.py's plan pinned to vocab-2, 1F1B and 4 microbatches, cut where this file's 4-rank case
was)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from autopp.data.vocab import VocabVariant
from autopp.errors import RunError
from autopp.model.contract import load_model_file
from autopp.run import vocab as vocab_module
from autopp.run.vocab import (VocabRuntime, VocabShard, body_model, check_cross_entropy, combine_stats,
                              find_vocab_modules, global_sums, hidden_states, local_stats, shard_loss_grad,
                              vocab_bounds)
from autopp.run.vocab_step import VocabJob, VocabResult, gradient_diffs, validate_vocab, vocab_diffs
from autopp.schedule import ScheduleName

from .conftest import ROOT

VOCAB_GPT = str(ROOT / "tests" / "models" / "vocabgpt.py")
TIED = str(ROOT / "tests" / "models" / "tiedlm.py")
LINRELU = str(ROOT / "tests" / "models" / "linrelu.py")
HF_LLAMA = str(ROOT / "examples" / "hf_llama.py")


def test_bounds_split_the_vocabulary_evenly() -> None:
    assert vocab_bounds(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    with pytest.raises(RunError, match=r"a vocabulary of 3 tokens cannot be split over 4 pipeline ranks"):
        vocab_bounds(3, 4)


@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_sharded_cross_entropy_matches_torch(ranks: int) -> None:
    torch.manual_seed(0)
    logits = torch.randn(12, 10, requires_grad=True) * 4
    target = torch.randint(0, 10, (12,))
    bounds = vocab_bounds(10, ranks)
    stats = torch.stack([local_stats(logits.detach()[:, lo:hi], target, lo, hi) for lo, hi in bounds])
    log_z, picked = combine_stats(stats)
    ref = F.cross_entropy(logits, target)
    (ref_grad,) = torch.autograd.grad(ref, logits)
    for lo, hi in bounds:
        loss, grad = shard_loss_grad(logits.detach()[:, lo:hi], target, lo, hi, log_z, picked)
        torch.testing.assert_close(loss, ref.detach())
        torch.testing.assert_close(grad, ref_grad[:, lo:hi])


@pytest.mark.parametrize("ranks", [1, 3, 4])
def test_vocab_1_s_two_collectives_give_torch_s_cross_entropy(ranks: int) -> None:
    """Vocab-1: the maximum over every rank's logits (the first all-reduce), then the sums relative to it (the
    second), the collectives done here by hand."""
    torch.manual_seed(1)
    logits = torch.randn(12, 10) * 4
    target = torch.randint(0, 10, (12,))
    bounds = vocab_bounds(10, ranks)
    peak = torch.stack([logits[:, lo:hi].max(dim=1).values for lo, hi in bounds]).max(dim=0).values
    sums = sum(global_sums(logits[:, lo:hi], target, lo, hi, peak) for lo, hi in bounds)
    assert isinstance(sums, torch.Tensor)
    loss, _ = shard_loss_grad(logits[:, :bounds[0][1]], target, 0, bounds[0][1], peak + torch.log(sums[:, 0]),
                              sums[:, 1])
    torch.testing.assert_close(loss, F.cross_entropy(logits, target))


@pytest.mark.parametrize("variant,calls", [(VocabVariant.VOCAB_1, ["all_reduce", "all_reduce"]),
                                           (VocabVariant.VOCAB_2, ["all_gather"])])
def test_the_runtime_runs_the_planned_variant_s_collectives(monkeypatch: pytest.MonkeyPatch, variant: VocabVariant,
                                                           calls: list[str]) -> None:
    """One rank holding the whole vocabulary, the collectives recorded (on one rank they change nothing): Vocab-1
    runs two all-reduces, Vocab-2 one all-gather, each giving torch's cross-entropy."""
    seen: list[str] = []

    def all_gather(out: list[torch.Tensor], t: torch.Tensor, group: object = None) -> None:
        seen.append("all_gather")
        out[0].copy_(t)
    monkeypatch.setattr(vocab_module.dist, "all_reduce", lambda *a, **k: seen.append("all_reduce"))
    monkeypatch.setattr(vocab_module.dist, "all_gather", all_gather)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    mods = find_vocab_modules(model, (torch.zeros(2, 3, dtype=torch.long),))
    runtime = VocabRuntime(VocabShard(model, mods, 0, 10), None, 0, 1, 1, 0, variant)  # type: ignore[arg-type]
    torch.manual_seed(2)
    logits, target = torch.randn(6, 10) * 4, torch.randint(0, 10, (6,))
    log_z, picked = runtime._normaliser(logits, target)
    assert seen == calls
    torch.testing.assert_close((log_z - picked).mean(), F.cross_entropy(logits, target))


def test_finds_the_embedding_and_head_and_sees_ties() -> None:
    mf = load_model_file(VOCAB_GPT)
    model = mf.build()
    mods = find_vocab_modules(model, mf.sample_batch(2)[0])
    assert (mods.embedding, mods.head, mods.vocab, mods.hidden, mods.tied) == ("tok_emb", "head", 256, 16, False)
    tied = load_model_file(TIED)
    assert find_vocab_modules(tied.build(), tied.sample_batch(2)[0]).tied


def test_refuses_a_model_without_an_embedding_first() -> None:
    mf = load_model_file(LINRELU)
    with pytest.raises(RunError, match=r"needs an nn.Embedding as the model's first call, got '0' \(Linear\)"):
        find_vocab_modules(mf.build(), mf.sample_batch(2)[0])


def test_refuses_a_head_with_a_bias() -> None:
    model = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 8))
    with pytest.raises(RunError, match=r"bias-free nn.Linear onto the 8-token vocabulary .* got '1' \(Linear\)"):
        find_vocab_modules(model, (torch.zeros(2, 3, dtype=torch.long),))


def test_shards_and_body_rebuild_the_model() -> None:
    mf = load_model_file(VOCAB_GPT)
    model = mf.build()
    (tokens,), _ = mf.sample_batch(2)
    mods = find_vocab_modules(model, (tokens,))
    with torch.no_grad():
        full = model(tokens)
        shards = [VocabShard(model, mods, lo, hi) for lo, hi in vocab_bounds(mods.vocab, 3)]
        embedded = sum(s.embed(tokens) for s in shards)
        torch.testing.assert_close(embedded, model.tok_emb(tokens))
        hidden = body_model(model, mods)(embedded)
        logits = torch.cat([hidden @ s.head.t() for s in shards], dim=-1)
    torch.testing.assert_close(logits, full)


def test_refuses_a_loss_other_than_the_mean_cross_entropy() -> None:
    mf = load_model_file(VOCAB_GPT)
    model = mf.build()
    (tokens,), target = mf.sample_batch(2)
    mods = find_vocab_modules(model, (tokens,))
    check_cross_entropy(mf.loss_fn, model, mods, tokens, target)

    def summed(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, 256), t.reshape(-1), reduction="sum")
    with pytest.raises(RunError, match=r"computes the mean cross-entropy of the head's logits \(5\.\d+ on an example "
                                       r"batch\), but the model file's loss_fn gives \d+"):
        check_cross_entropy(summed, model, mods, tokens, target)


def test_hidden_states_are_the_one_float_tensor_of_the_output() -> None:
    h = torch.ones(2, 3)
    assert hidden_states(h) is h and hidden_states({"logits": h, "ids": torch.zeros(2, dtype=torch.long)}) is h
    with pytest.raises(RunError, match=r"returns 2 floating-point tensors, expected its hidden states alone"):
        hidden_states((h, h))


def test_the_padding_row_keeps_a_zero_gradient_in_its_shard() -> None:
    model = nn.Sequential(nn.Embedding(8, 4, padding_idx=5), nn.Linear(4, 8, bias=False))
    tokens = torch.tensor([[5, 1, 6, 5]])
    mods = find_vocab_modules(model, (tokens,))
    shards = [VocabShard(model, mods, lo, hi) for lo, hi in vocab_bounds(8, 2)]
    sum(s.embed(tokens) for s in shards).sum().backward()
    model[0](tokens).sum().backward()
    torch.testing.assert_close(torch.cat([s.embedding.grad for s in shards]), model[0].weight.grad)
    assert shards[1].padding_idx == 1 and shards[0].padding_idx is None


def _check(job: VocabJob) -> None:
    diffs = validate_vocab(job, timeout_s=900)
    shards = [n for n in diffs if "[" in n]
    assert len(shards) == (1 if "tied" in job.model_path else 2) * job.pp  # every rank's rows were compared
    assert max(diffs.values()) < 1e-4


@pytest.mark.integration
@pytest.mark.parametrize("pp,schedule,points", [(2, "1F1B", ("h.2",)), (2, "GPipe", ("h.2",))])
def test_matches_one_process(pp: int, schedule: str, points: tuple[str, ...]) -> None:
    _check(VocabJob(VOCAB_GPT, points, ScheduleName(schedule), pp, num_microbatches=4, microbatch_size=2))


@pytest.mark.integration
def test_vocab_1_matches_one_process() -> None:
    """A Vocab-1 job runs its two collectives (not Vocab-2's one, as before 2026-12-05) and matches one process."""
    _check(VocabJob(VOCAB_GPT, ("h.2",), ScheduleName.ONE_F_ONE_B, 2, num_microbatches=4, microbatch_size=2,
                    variant=VocabVariant.VOCAB_1))


@pytest.mark.integration
def test_matches_one_process_on_a_hugging_face_llama() -> None:
    _check(VocabJob(HF_LLAMA, ("model.layers.2",), ScheduleName.ONE_F_ONE_B, 2, num_microbatches=4,
                    microbatch_size=2))


@pytest.mark.integration
def test_matches_one_process_with_tied_weights() -> None:
    _check(VocabJob(TIED, ("blocks.1",), ScheduleName.ONE_F_ONE_B, 2, num_microbatches=4, microbatch_size=2))


@pytest.mark.integration
@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "ZBVZeroBubble"])
def test_matches_one_process_with_two_stages_per_rank(schedule: str) -> None:
    _check(VocabJob(VOCAB_GPT, ("h.1", "h.2", "h.3"), ScheduleName(schedule), 2, num_microbatches=4,
                    microbatch_size=2, v=2))


def test_a_gradient_zero_in_exact_arithmetic_is_judged_at_the_house_floor() -> None:
    """gradient_diffs divides by max(max |ref|, eps(float32) x G / rtol) as autopp.run.validate does: rounding noise
    on a gradient that is zero in exact arithmetic (2.2e-10 at G = 1, a ViT's key bias) passes, a real error of
    1e-3 G does not."""
    ref = {"w": torch.tensor([1.0, -0.5]), "k_bias": torch.zeros(2)}
    noisy = VocabResult([], {"w": ref["w"].clone(), "k_bias": torch.tensor([2.2e-10, 0.0])})
    assert gradient_diffs({0: noisy}, ref)["k_bias"][2] < 1e-4
    wrong = VocabResult([], {"w": ref["w"].clone(), "k_bias": torch.tensor([1e-3, 0.0])})
    assert gradient_diffs({0: wrong}, ref)["k_bias"][2] > 0.5


def test_disagreeing_losses_name_the_rank_the_microbatch_and_both_values() -> None:
    ref = {"w": torch.ones(2)}
    same = {r: VocabResult([0.5, 0.25], {"w": torch.ones(2)}) for r in range(3)}
    assert vocab_diffs(same, 0.375, ref)["loss"] == 0.0
    same[2] = VocabResult([0.5, 0.75], {"w": torch.ones(2)})
    with pytest.raises(RunError, match=r"^vocabulary parallelism: rank 2 disagrees with rank 0 on the loss of "
                                       r"microbatch 1: 0\.75 against 0\.25 \(2 and 2 losses\)$"):
        vocab_diffs(same, 0.375, ref)
    same[2] = VocabResult([0.5], {"w": torch.ones(2)})
    with pytest.raises(RunError, match=r"rank 2 disagrees with rank 0 on the loss of microbatch 1: none against 0\.25"):
        vocab_diffs(same, 0.375, ref)
