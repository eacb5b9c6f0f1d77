"""Elementwise kernel fusion in the count (autopp.measure.fusion): chains of elementwise ops become one kernel that
reads the chain's inputs and writes what leaves it; what the backward needs, a matmul between, and what outlives the
pass stay in memory; a model's counts keep their FLOPs, and lose bytes, kernels and what the backward must keep."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from autopp.cli import main
from autopp.cli.common import profile_dir_name
from autopp.cli.profile import _current
from autopp.costmodel.roofline import OpCounts, default_efficiency
from autopp.data.catalog import load_device
from autopp.data.precision import recipe
from autopp.measure.analytic import analytic_profile, count_model, unit_times
from autopp.measure.counting import OpCounter, count_piece
from autopp.measure.fusion import OpTouches, fuse_elementwise, fusible, kept_bytes
from autopp.measure.options import ProfileOptions
from autopp.measure.timing import Piece
from autopp.model.fake import fake_mode, faking
from tests.conftest import EXAMPLES

N = 1024
FLOAT = N * 4


def _counted(run: object, fuse: bool) -> OpCounts:
    """`run(x, w)` counted; what it returns outlives the pass, as a forward's output does."""
    mode = fake_mode()
    with faking(mode):
        x = torch.randn(N)
        w = torch.randn(N, N)
        with OpCounter(fuse=fuse) as counter:
            kept = run(x, w)  # type: ignore[operator]  # noqa: F841
    return counter.counts()


def test_an_elementwise_chain_is_one_kernel_reading_its_input_and_writing_its_output() -> None:
    def chain(x: torch.Tensor, _w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.sin(x * 2) + 1
    eager, fused = _counted(chain, False), _counted(chain, True)
    assert eager.bytes == (2 * FLOAT,) * 3  # each op reads and writes the vector
    assert fused.bytes == (2 * FLOAT,) and fused.names == ("aten::mul.Tensor+aten::sin+aten::add.Tensor",)


def test_a_matmul_between_splits_the_chain() -> None:
    def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.relu((x * 2).unsqueeze(0) @ w) + 1
    fused = _counted(chain, True)
    assert fused.names == ("aten::mul.Tensor", "aten::mm", "aten::relu+aten::add.Tensor")
    assert fused.bytes[0] == 2 * FLOAT and fused.bytes[2] == 2 * FLOAT  # the matmul's output read once


def test_a_value_live_across_a_matmul_is_written_and_read_back() -> None:
    """`a` is used before and after a matmul: a kernel boundary lies between, so it is written and read again; `b`,
    read by the matmul, is written by its kernel; the final add reads the matmul's output and `a`."""
    def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            a = x * 2
            c = a.exp().unsqueeze(0) @ w
            return a + c
    fused = _counted(chain, True)
    assert fused.names == ("aten::mul.Tensor", "aten::exp", "aten::mm", "aten::add.Tensor")
    assert fused == _counted(chain, False)


def test_what_the_backward_saves_stays_in_memory() -> None:
    """sin saves its input for the backward: x * 2 outlives the forward, so it is written and read as eager does."""
    def chain(x: torch.Tensor, _w: torch.Tensor) -> torch.Tensor:
        return torch.sin(x.requires_grad_() * 2)
    eager, fused = _counted(chain, False), _counted(chain, True)
    assert fused == eager


def test_fuse_elementwise_joins_ops_through_intermediates_only() -> None:
    """Op 1 makes storage 11, read by op 2 only, freed: on chip. Op 2's output 12 outlives the pass: kept. Op 0 is a
    matmul: its output 10 is read by op 1 but op 0 is not fusible, so 10 stays in memory."""
    counts = OpCounts((100, 0, 0), (30, 20, 20), (True, False, False), (0, 0, 0), ("mm", "a", "b"))
    touches = OpTouches(storages=(((1, 10), (2, 10), (10, 10)), ((10, 10), (11, 10)), ((11, 10), (12, 10))),
                        fusible=(False, True, True), made={10: 0, 11: 1, 12: 2}, alive=frozenset({1, 2, 12}))
    fused = fuse_elementwise(counts, touches)
    assert fused == OpCounts((100, 0), (30, 20), (True, False), (0, 0), ("mm", "a+b"))
    with pytest.raises(ValueError, match="2 ops touched storages, 0 flagged, 3 were counted"):
        fuse_elementwise(counts, OpTouches(touches.storages[:2], (False, True), {}, frozenset()))


def test_kept_bytes_is_the_least_from_which_the_backward_recomputes_what_it_needs() -> None:
    """x (1, 100 bytes) is the pass's input, w (2) a parameter. Op 0 (fusible) makes a (10, 400 bytes) from x and w;
    op 1 (fusible) makes b (11, 10 bytes) from a; op 2, a matmul, makes c (12, 50 bytes) from a and w."""
    touches = OpTouches(storages=(((1, 100), (2, 4), (10, 400)), ((10, 400), (11, 10)), ((10, 400), (2, 4), (12, 50))),
                        fusible=(True, True, False), made={10: 0, 11: 1, 12: 2}, alive=frozenset({1, 2, 10, 11, 12}),
                        sizes={1: 100, 2: 4, 10: 400, 11: 10, 12: 50})
    assert kept_bytes(touches, {10}, {2}) == {1}  # a recomputed from x (and the free parameter)
    assert kept_bytes(touches, {11}, {2}) == {11}  # b is smaller than what it is recomputed from
    assert kept_bytes(touches, {10, 11}, {2}) == {1}  # both from x
    assert kept_bytes(touches, {12}, {2}) == {12}  # a matmul's output is kept: nothing cheap recomputes it
    assert kept_bytes(touches, {10}, set()) == {1, 2}  # a parameter not free is kept beside x
    assert kept_bytes(touches, set(), {2}) == set()
    # op 3 writes the matmul's output c into a in place (a fusible add_): a depends on c too, so recomputing a takes
    # x and c; a non-fusible write (an index_put_) leaves nothing to recompute a from
    inplace = replace(touches, storages=(*touches.storages, ((10, 400), (12, 50))), fusible=(True, True, False, True),
                      rewritten={10: (3,)})
    assert kept_bytes(inplace, {10}, {2}) == {1, 12}
    assert kept_bytes(replace(inplace, fusible=(True, True, False, False)), {10}, {2}) == {10}
    # b (now 1,000 bytes) was made from a (50 bytes), which a non-fusible op 3 then overwrote: b cannot be
    # recomputed from a, so it is kept whole
    over = replace(touches, storages=(*touches.storages, ((10, 50),)), fusible=(True, True, False, False),
                   sizes={**touches.sizes, 10: 50, 11: 1000}, rewritten={10: (3,)})
    assert kept_bytes(over, {11}, {2}) == {11}


class _EarlyPeak(nn.Module):
    """A temporary 256 times the input, made and freed first (a non-fusible `repeat`), then a chain of `sin`s, each
    saving its input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = x.detach().repeat(1, 256).sum()
        for _ in range(8):
            x = x.sin()
        return x + big


def test_the_fused_forwards_peak_keeps_what_was_live_at_it() -> None:
    """Fused, the sins keep only the input (recomputed from it); the forward's peak came at the temporary, before
    any of them was saved: the fused peak stays the temporary's, not eager's less every byte no longer saved."""
    mode = fake_mode()
    with mode:
        x = mode.from_tensor(torch.empty(8, 64, device="meta"))
        eager, fused = (count_piece(Piece(_EarlyPeak(), (x,), lambda out: out, False, (True,)), mode, fuse=f)
                        for f in (False, True))
    assert eager.activation_bytes == 8 * 8 * 64 * 4 and fused.activation_bytes == 8 * 64 * 4
    assert fused.peak_bytes >= 8 * 64 * 256 * 4 and fused.peak_bytes <= eager.peak_bytes


def test_fusible_ops_are_pointwise_casts_and_reductions_not_matmuls_or_indexing() -> None:
    aten = torch.ops.aten
    assert all(fusible(op) for op in (aten.mul.Tensor, aten._to_copy.default, aten.mean.dim, aten.rsqrt.default,
                                      aten._softmax.default, aten.silu_backward.default))
    assert not any(fusible(op) for op in (aten.mm.default, aten.index.Tensor, aten.cat.default,
                                          aten.embedding.default))


class _NormMlp(nn.Module):
    """Hugging Face's Llama RMSNorm and gated MLP, as eager PyTorch runs them."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(64))
        self.gate, self.up, self.down = nn.Linear(64, 256), nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = self.weight * h.to(x.dtype)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def test_a_norm_and_mlp_piece_loses_bytes_kernels_and_saved_bytes_and_keeps_flops() -> None:
    with torch.device("meta"):
        piece = _NormMlp()

    def count(fuse: bool):  # type: ignore[no-untyped-def]
        mode = fake_mode()
        with mode:
            x = mode.from_tensor(torch.empty(8, 64, device="meta"))
            return count_piece(Piece(piece, (x,), lambda out: out, False, (True,)), mode, fuse=fuse)
    eager, fused = count(False), count(True)
    for name, ops in eager.passes().items():
        assert fused.passes()[name].total_flops == ops.total_flops, name
        assert sum(fused.passes()[name].bytes) <= sum(ops.bytes), name
    assert sum(fused.backward.bytes) < sum(eager.backward.bytes)
    assert len(fused.backward.flops) < len(eager.backward.flops)
    # eager saves x, the norm's rsqrt, normalised x and output, gate, up, silu and their product (8 x 64 and 8 x 256
    # floats); fused keeps x and the two projections' outputs and recomputes the rest from them
    assert eager.activation_bytes == 3 * 8 * 64 * 4 + 8 * 4 + 4 * 8 * 256 * 4
    assert fused.activation_bytes == 8 * 64 * 4 + 2 * 8 * 256 * 4
    # the peak falls in the backward, where eager has freed some of what it saved: by less than the saved bytes fall
    assert eager.peak_bytes - (eager.activation_bytes - fused.activation_bytes) < fused.peak_bytes < eager.peak_bytes
    assert fused.output_bytes == eager.output_bytes
    # selective recomputation's rerun: the forward's kernels less the kept matmuls', what the backward reads written
    # (the norm's output, which the gate and up projections saved), not left on chip as a no-grad rerun would have it
    rerun = [(n, b) for n, b in zip(fused.forward.names, fused.forward.bytes) if n != "aten::addmm"]
    assert list(zip(fused.selective_recompute.names, fused.selective_recompute.bytes)) == rerun
    assert ("aten::mul.Tensor", 256 + 2 * 8 * 64 * 4) in rerun  # the norm's output h written, its weight read


@pytest.mark.integration  # counts a model and its TP rows three times: seconds, more under load
def test_a_llama_block_is_faster_fused_and_the_profile_says_so() -> None:
    """tiny-llama's config counted both ways for the H100: every unit's passes no slower fused, a block's backward
    faster; the profile records its kernels, and a plan that needs the other kind calls it not current."""
    from autopp.data.hf_config import hf_source
    from autopp.model.hf import load_model
    source = hf_source(EXAMPLES / "configs" / "tiny-llama.json", 32, "causal-lm")
    mf = load_model(source.config_path, source.to_json())
    options = ProfileOptions(microbatch_sizes=(2,), dtype="bfloat16", optimizer="adamw")
    spec, eff = load_device("h100-sxm"), default_efficiency("h100-sxm")
    counts = {k: count_model(mf, options, fused_attention=True, kernels=k) for k in ("eager", "fused")}
    times = {k: [unit_times(r.counts, spec, recipe("bf16"), eff) for r in c.rows] for k, c in counts.items()}
    for eager, fused in zip(times["eager"], times["fused"]):
        assert all(fused[col] <= eager[col] for col in ("forward_s", "backward_s", "selective_recompute_s"))
    assert times["fused"][1]["backward_s"] < 0.95 * times["eager"][1]["backward_s"]
    profile = analytic_profile(mf, spec, options, counts=counts["fused"], kernels="fused")
    assert profile.meta.extra["analytic"]["kernels"] == "fused"
    why = _current(profile, profile.meta.fingerprint, None, "h100-sxm", (), "bf16")
    assert why == "it counted fused kernels, the plan needs eager"
    with pytest.raises(ValueError, match="counts were made with fused kernels, not eager"):
        analytic_profile(mf, spec, options, counts=counts["fused"])
    block = {}
    for k in ("eager", "fused"):  # a TP rank's shard is counted with the same kernels
        rows = analytic_profile(mf, spec, replace(options, tp_degrees=(2,)), counts=counts[k], kernels=k).tp_units
        assert rows is not None
        block[k] = rows[(rows.unit == 1) & (rows.tp == 2)].iloc[0]
    assert block["fused"].backward_s < 0.95 * block["eager"].backward_s


def test_fused_profiles_have_a_directory_of_their_own() -> None:
    import argparse
    args = argparse.Namespace(model="m.py", hf_config=None, kernels="fused")
    assert profile_dir_name(args, "h100-sxm", True) == "m-h100-sxm-fused"
    assert profile_dir_name(argparse.Namespace(model="m.py", hf_config=None, kernels=None), "h100-sxm", True) == \
        "m-h100-sxm"


def test_cli_analytic_profile_with_fused_kernels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p"
    assert main(["profile", str(EXAMPLES / "mlp.py"), "--analytic", "h100-sxm", "--kernels", "fused",
                 "--microbatch-size", "2", "-o", str(out)]) == 0
    from autopp.data.profile import load_profile
    assert load_profile(out).meta.extra["analytic"]["kernels"] == "fused"
    capsys.readouterr()
    assert main(["plan", "--profile", str(out), "--devices", "2", "--memory", "80GiB", "--global-batch", "8",
                 "-o", str(tmp_path / "plan.json")]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "the profile counts fused elementwise kernels (`--kernels fused`" in said
    assert "keeps more activation memory than predicted" in said
    from autopp.cli.show import _plan_title
    from autopp.data.plan import load_plan
    assert _plan_title(load_plan(tmp_path / "plan.json")).endswith(", fused kernels (simulated)")  # the picture too
    # --for a trainer that runs the model's own kernels (an MLP: no transformer layers for the others to count)
    assert main(["plan", "--profile", str(out), "--devices", "2", "--memory", "80GiB", "--global-batch", "8",
                 "--for", "deepspeed", "-o", str(tmp_path / "deepspeed.json")]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "kernels: the plan counted fused elementwise kernels" in said and "takes longer and its activations" in said
    assert main(["plan", "--profile", str(out), "--devices", "2", "--memory", "80GiB", "--global-batch", "8",
                 "--kernels", "fused", "-o", str(tmp_path / "same.json")]) == 0  # the profile's own: not refused
