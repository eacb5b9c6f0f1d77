"""Unit tests of the shared-parameter validation (autopp.run.steps), in one process: a pipelined run is imitated by
gradient accumulation over microbatches, which rounds as a pipeline does."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pytest
import torch

from autopp.data.layout import Layout
from autopp.measure.options import make_optimizer
from autopp.model.contract import ModelFile, load_model_file
from autopp.run.collect import StageTensors
from autopp.run.steps import MAX_LISTED_STEPS, UPDATE_RTOL, ReferenceModel, batch_norm_refusal, shard_name, \
    validate_steps
from autopp.run.validate import LOSS_RTOL

from .conftest import ROOT, pipeline_plan

MODELS = ROOT / "tests" / "models"
GNCNN = MODELS / "gncnn.py"


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """As every rank runs: the rounding these tests see does not depend on how many cores the machine lends."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _accumulated(mf: ModelFile, steps: int, lr: float, microbatches: int = 4, batch: int = 8,
                 optimizer_name: str = "sgd", skip: int | None = None
                 ) -> tuple[list[tuple[StageTensors, StageTensors]], list[float]]:
    """Per step, the parameters before it and its gradients (stage 0 holds all), and its loss, of the optimizer
    (SGD unless named; its step skipped after step `skip`, from 1) whose gradients are accumulated over
    `microbatches` (the mean of the microbatch losses, as scale_grads does); then, as the worker's last check file,
    the parameters after the last step without gradients."""
    model = mf.build(0)
    optimizer = make_optimizer(optimizer_name, list(model.parameters()), lr=lr)
    checks, losses = [], []
    size = batch // microbatches
    for k in range(steps):
        inputs, target = mf.sample_batch(batch, seed=k)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        total = 0.0
        for i in range(microbatches):
            part = slice(i * size, (i + 1) * size)
            loss = mf.loss_fn(model(*(x[part] for x in inputs)), target[part]) / microbatches
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        checks.append(({0: before}, {0: {n: p.grad.detach().clone() for n, p in model.named_parameters()}}))
        if k + 1 != skip:
            optimizer.step()
        optimizer.zero_grad()
    checks.append(({0: {n: p.detach().clone() for n, p in model.named_parameters()}}, {}))
    return checks, losses


def _free_running(mf: ModelFile, steps: int, lr: float, batch: int = 8) -> list[float]:
    """The old reference: its own SGD on the whole batch from the same seed."""
    model = mf.build(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for k in range(steps):
        inputs, target = mf.sample_batch(batch, seed=k)
        loss = mf.loss_fn(model(*inputs), target)
        loss.backward()
        losses.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    return losses


# Issue 26, point 11: a GroupNorm CNN failed at step 7 of 30 ("losses differ ... by 1.44e-04 relative ... above the
# tolerance 1e-05") while its gradients agreed to 3.7e-6: the free-running reference drifts by rounding alone.
@pytest.mark.integration  # about half a second: the unit tier stays under a minute
def test_a_long_correct_run_passes_where_a_free_running_reference_drifts() -> None:
    mf = load_model_file(GNCNN)
    checks, losses = _accumulated(mf, 30, lr=2.0)
    drift = max(abs(a - b) / abs(b) for a, b in zip(losses, _free_running(mf, 30, lr=2.0)))
    assert drift > 10 * LOSS_RTOL  # the case is one that drifts: the old comparison would fail it
    verdict = validate_steps(ReferenceModel(mf, 0, 8), lambda k: checks[k], losses)
    assert verdict.error is None and verdict.failed_steps == ()
    assert len(verdict.reference_losses) == 30 and max(d.max_rel for d in verdict.grad_diffs) < 1e-4


def test_a_wrong_step_fails_on_that_step_naming_it_and_bounding_the_rest() -> None:
    mf = load_model_file(GNCNN)
    checks, losses = _accumulated(mf, 12, lr=0.01)
    for k in range(4, 12):  # from step 5 on, one microbatch's share of a gradient is missed
        params, grads = checks[k]
        grads[0]["head.weight"] *= 0.75
    verdict = validate_steps(ReferenceModel(mf, 0, 8), lambda k: checks[k], losses)
    assert verdict.failed_steps == tuple(range(5, 13))
    assert verdict.error is not None and verdict.error.startswith(
        "step 5 of 12: gradient of head.weight (stage 0) differs from the single-process reference by 2.50e-01")
    assert verdict.error.endswith(f"(also steps 6, 7, 8, 9, 10 and {8 - 1 - MAX_LISTED_STEPS} more)")
    assert len(verdict.error) < 300
    worst = next(d for d in verdict.grad_diffs if d.name == "head.weight")
    assert worst.step >= 5 and worst.max_rel == pytest.approx(0.25, rel=1e-3)


def test_a_loss_that_differs_names_both_values_of_its_step() -> None:
    mf = load_model_file(GNCNN)
    checks, losses = _accumulated(mf, 3, lr=0.01)
    losses[1] *= 1.001
    verdict = validate_steps(ReferenceModel(mf, 0, 8), lambda k: checks[k], losses)
    assert verdict.failed_steps == (2,)
    assert verdict.error is not None and verdict.error.startswith(
        "step 2 of 3: loss differs from the single-process reference by 1.00e-03 relative")
    assert f"pipelined {losses[1]:.7g}, reference {verdict.reference_losses[1]:.7g}" in verdict.error


def test_the_reference_starts_each_step_from_the_parameters_given_and_does_not_step() -> None:
    mf = load_model_file(GNCNN)
    ref = ReferenceModel(mf, 0, 8)
    first, again = ref.step(0), ref.step(0)
    assert first.losses == again.losses and first.first_step == 1
    assert all(torch.equal(first.grads[n], again.grads[n]) for n in first.grads)
    moved = {0: {n: p + 0.01 for n, p in ref.model.named_parameters()}}
    other = ref.step(3, moved)
    assert other.first_step == 4 and other.losses != first.losses
    assert all(torch.equal(p, moved[0][n]) for n, p in ref.model.named_parameters())


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_reference_with_the_optimizer_checks_each_update_and_passes_a_correct_run(optimizer: str) -> None:
    mf = load_model_file(GNCNN)
    checks, losses = _accumulated(mf, 4, lr=0.01, optimizer_name=optimizer)
    verdict = validate_steps(ReferenceModel(mf, 0, 8, optimizer=optimizer, lr=0.01), lambda k: checks[k], losses)
    assert verdict.error is None and verdict.failed_steps == ()


def test_an_optimizer_step_skipped_by_the_ranks_fails_on_that_step() -> None:
    mf = load_model_file(GNCNN)
    checks, losses = _accumulated(mf, 4, lr=0.01, skip=2)  # the ranks skip step 2's update
    # gradients from shared parameters alone do not see it; the reference stepping its optimizer does
    blind = validate_steps(ReferenceModel(mf, 0, 8), lambda k: checks[k], losses)
    seeing = validate_steps(ReferenceModel(mf, 0, 8, optimizer="sgd", lr=0.01), lambda k: checks[k], losses)
    assert blind.failed_steps == ()
    assert seeing.failed_steps == (2,) and seeing.error is not None
    assert seeing.error.startswith("step 2 of 4: parameters of ")
    assert "after the optimizer step differ from one process's sgd step by" in seeing.error
    assert seeing.error.endswith(f"(tolerance {UPDATE_RTOL:g} of the update)")


def test_an_optimizer_step_skipped_by_the_reference_fails() -> None:
    """lr 0 on the reference's side: it does not move where the ranks did."""
    mf = load_model_file(GNCNN)
    checks, losses = _accumulated(mf, 2, lr=0.01)
    verdict = validate_steps(ReferenceModel(mf, 0, 8, optimizer="sgd", lr=0.0), lambda k: checks[k], losses)
    assert verdict.failed_steps == (1, 2)  # the last step's update too, against the parameters after it
    assert verdict.error is not None and "after the optimizer step differ from one process's sgd step by" in \
        verdict.error


def test_the_last_steps_update_is_checked_so_one_step_checks_one() -> None:
    """Review: the update was compared only with the next step's parameters, so `--steps 1` (and the last step of
    any run) checked none; the ranks' parameters after the last step (the worker's last check file) are compared
    with the reference's update as every other step's are."""
    mf = load_model_file(GNCNN)
    for steps in (1, 3):
        checks, losses = _accumulated(mf, steps, lr=0.01, skip=steps)  # the ranks skip the last step's update
        verdict = validate_steps(ReferenceModel(mf, 0, 8, optimizer="sgd", lr=0.01), lambda k: checks[k], losses)
        assert verdict.failed_steps == (steps,) and verdict.error is not None
        assert verdict.error.startswith(f"step {steps} of {steps}: parameters of ")
    checks, losses = _accumulated(mf, 1, lr=0.01)
    verdict = validate_steps(ReferenceModel(mf, 0, 8, optimizer="sgd", lr=0.01), lambda k: checks[k], losses)
    assert verdict.error is None and verdict.failed_steps == ()


def _sharded(checks: list[tuple[StageTensors, StageTensors]], name: str, rows: list[tuple[int, int]]
             ) -> list[tuple[StageTensors, StageTensors]]:
    """`checks` with parameter `name` held by stages 1, 2, ... in row shards `rows` (as vocabulary parallelism)."""
    def split(tensors: StageTensors) -> StageTensors:
        whole = dict(tensors[0])
        value = whole.pop(name)
        return {0: whole, **{i + 1: {shard_name(name, lo, hi): value[lo:hi]} for i, (lo, hi) in enumerate(rows)}}
    return [(split(p), split(g) if g else g) for p, g in checks]


@pytest.mark.parametrize("model,name", [(GNCNN, "head.weight"), (MODELS / "tiedlm.py", "embed.weight")])
def test_a_parameter_in_row_shards_is_compared_and_updated_shard_by_shard(model: Path, name: str) -> None:
    """As vocabulary parallelism holds the head (tiedlm: the embedding tied to the head, one shard serving both)."""
    mf = load_model_file(model)
    checks, losses = _accumulated(mf, 3, lr=0.01, optimizer_name="adam")
    rows = [(0, 3), (3, mf.build(0).get_parameter(name).shape[0])]
    sharded = _sharded(checks, name, rows)
    ref = ReferenceModel(mf, 0, 8, optimizer="adam", lr=0.01, shards={name: rows})
    assert [n for n in ref.names if n.startswith(name)] == [shard_name(name, lo, hi) for lo, hi in rows]
    verdict = validate_steps(ref, lambda k: sharded[k], losses)
    assert verdict.error is None
    assert {(d.name, d.stage) for d in verdict.grad_diffs if d.name.startswith(name)} == {
        (shard_name(name, lo, hi), i + 1) for i, (lo, hi) in enumerate(rows)}
    sharded[1][1][2][shard_name(name, *rows[1])] *= 0.5  # the second shard's gradient of step 2 halved
    bad = validate_steps(ReferenceModel(mf, 0, 8, optimizer="adam", lr=0.01, shards={name: rows}),
                         lambda k: sharded[k], losses)
    assert bad.failed_steps[0] == 2 and bad.error is not None and bad.error.startswith(
        f"step 2 of 3: gradient of {shard_name(name, *rows[1])} (stage 2) differs")


def test_batch_norm_is_refused_over_microbatches_and_named() -> None:
    plan = pipeline_plan(MODELS / "bncnn.py", ["blocks.2"], num_microbatches=4, microbatch_size=2)
    model = load_model_file(MODELS / "bncnn.py").build(0)
    why = batch_norm_refusal(model, plan)
    assert why == ("the model normalizes with BatchNorm (stem.1 and 8 more), whose statistics are per microbatch "
                   "(2 samples, not the global batch of 8), so a pipelined step cannot equal the single-process "
                   "one: use GroupNorm or LayerNorm to validate, or run with validation off (`autopp run "
                   "--no-validate`) to measure only")
    assert batch_norm_refusal(load_model_file(GNCNN).build(0), plan) is None
    whole = replace(plan, layout=Layout(pp=1), num_microbatches=1, microbatch_size=8,
                    stages=(replace(plan.stages[0], units=(0, plan.stages[1].units[1]),
                                    unit_names=plan.stages[0].unit_names + plan.stages[1].unit_names),),
                    predicted=replace(plan.predicted, peak_memory_bytes=(1000,)))
    assert batch_norm_refusal(model, whole) is None  # one microbatch of the whole batch: the same statistics
