"""Counting pieces on fake tensors (FLOPs per phase, saved and peak bytes, nothing materialized), the analytic
profile, calibration from a profile, and the CLI's `profile --analytic` and `calibrate`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode

from autopp.cli import main
from autopp.costmodel.roofline import Calibration, Efficiency, OpCounts, load_calibration, phase_time
from autopp.data.catalog import load_device
from autopp.data.precision import RECIPES
from autopp.data.profile import Profile, load_profile
from autopp.measure.analytic import analytic_profile, count_model, unit_times
from autopp.measure.fitting import calibrate
from autopp.measure.counting import PieceCounts, count_piece
from autopp.measure.options import ProfileOptions
from autopp.measure.timing import Piece
from autopp.model.fake import fake_mode
from tests.conftest import EXAMPLES, MODELS, SHIPPED

B, IN, OUT = 8, 64, 32


def _count(module: nn.Module, *shapes: tuple[int, ...], first: bool = False, last: bool = False) -> PieceCounts:
    mode = fake_mode()
    with mode:
        args = tuple(mode.from_tensor(torch.empty(s, device="meta")) for s in shapes)
        finish = (lambda out: out.square().mean()) if last else (lambda out: out)
        return count_piece(Piece(module, args, finish, first, (not first,) * len(args)), mode)


def _meta_linear(bias: bool = True) -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(IN, OUT, bias=bias)


def test_linear_flops_per_phase() -> None:
    """F is 2 b in out; the input gradient and the weight gradient are each one matmul of that size."""
    c = _count(_meta_linear(bias=False), (B, IN))
    f = 2 * B * IN * OUT
    assert c.forward.total_flops == f
    assert c.backward_input.total_flops == f
    assert c.backward_weight.total_flops == f
    assert c.backward.total_flops == 2 * f


def test_the_last_piece_records_the_models_output_before_the_loss() -> None:
    """The last piece's output bytes are what its module returns (the model's output, which torch's last stage holds
    per in-flight microbatch until its backward), not its loss's; another piece's are its output's too."""
    assert _count(_meta_linear(), (B, IN), last=True).output_bytes == B * OUT * 4
    assert _count(_meta_linear(), (B, IN)).output_bytes == B * OUT * 4
    assert _count(_meta_linear(), (2 * B, IN), last=True).output_bytes == 2 * B * OUT * 4


def test_selective_recomputation_keeps_the_matmul_and_reruns_the_rest() -> None:
    """Under selective recomputation a Linear + GELU piece keeps the matmul's output (b x out floats) and reruns the
    GELU alone: no FLOPs of a matmul, the GELU's bytes (its input and its output)."""
    with torch.device("meta"):
        piece = nn.Sequential(nn.Linear(IN, OUT, bias=False), nn.GELU())
    c = _count(piece, (B, IN))
    assert c.selective_bytes == B * OUT * 4
    assert c.selective_recompute.total_flops == 0 and sum(c.selective_recompute.bytes) == 2 * B * OUT * 4
    assert c.forward.total_flops == 2 * B * IN * OUT and sum(c.forward.bytes) > sum(c.selective_recompute.bytes)


def test_first_piece_has_no_input_gradient_step() -> None:
    """Like torch's first stage, a piece without input gradients runs its whole backward as the weight step."""
    c = _count(_meta_linear(), (B, IN), first=True)
    assert c.backward_input.flops == () and c.backward_weight == c.backward


def test_flops_equal_flop_counter_mode() -> None:
    """The counter reuses torch's formulas: a transformer layer's forward FLOPs equal FlopCounterMode's."""
    with torch.device("meta"):
        layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    c = _count(layer, (2, 16, 32))
    mode = fake_mode()
    with mode, FlopCounterMode(display=False) as counter:
        layer(mode.from_tensor(torch.empty(2, 16, 32, device="meta")).requires_grad_())
    assert c.forward.total_flops == counter.get_total_flops() > 0


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_cpu_attention_kernel_is_counted() -> None:
    """On fake CPU tensors torch picks its fused CPU attention kernel, which torch.utils.flop_counter has no formula
    for: it is counted with the GPU kernel's formula, the FLOPs of the math path on meta, and saves no attention
    matrix (that path saves b h s s floats)."""
    shape = (2, 4, 64, 16)
    on_meta = _count(_Attention(), shape)
    mode = fake_mode()
    with mode:
        convert = mode.fake_tensor_converter.from_meta_and_device
        q = convert(mode, torch.empty(shape, device="meta"), torch.device("cpu"))
        on_cpu = count_piece(Piece(_Attention(), (q,), lambda out: out, False, (True,)), mode)
    assert on_cpu.forward.total_flops == on_meta.forward.total_flops == 4 * 2 * 4 * 64 * 64 * 16
    assert on_cpu.backward.total_flops > 0
    assert on_meta.activation_bytes - on_cpu.activation_bytes >= 2 * 4 * 64 * 64 * 4


def test_saved_and_peak_bytes_match_mem_tracker() -> None:
    """Saved bytes of Linear-ReLU-Linear: its input and the ReLU output. The peak of live bytes during forward and
    backward equals torch's MemTracker's (torch.distributed._tools.mem_tracker, which also works under
    FakeTensorMode) less the parameters and the input it counts as well."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(IN, 4 * IN), nn.ReLU(), nn.Linear(4 * IN, OUT))
    c = _count(model, (B, IN))
    assert c.activation_bytes == 4 * (B * IN + B * 4 * IN)
    mode = fake_mode()
    with mode:
        for m in model.modules():  # MemTracker attributes fake conversions of meta parameters as activations
            for name, p in list(m._parameters.items()):
                m._parameters[name] = nn.Parameter(mode.from_tensor(p))
        x = mode.from_tensor(torch.empty(B, IN, device="meta")).requires_grad_()
        tracker = MemTracker()
        tracker.track_external(model, x)
        with tracker:
            y = model(x)
            y.backward(torch.ones_like(y))
        peak = tracker.get_tracker_snapshot("peak")[torch.device("meta")]["Total"]
    params = sum(p.numel() * 4 for p in model.parameters())
    assert c.peak_bytes == peak - params - B * IN * 4


def test_nothing_is_materialized() -> None:
    """A 40 GB layer on meta is counted in an instant: no parameter, input or activation is ever allocated."""
    with torch.device("meta"):
        huge = nn.Linear(100_000, 100_000)
    c = _count(huge, (2, 100_000), last=True)
    assert c.forward.total_flops >= 2 * 2 * 100_000 ** 2
    assert all(p.device.type == "meta" and p.grad is None for p in huge.parameters())


STACK = """
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(8, 16), *[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(3)],
                         nn.Linear(16, 4))

def sample_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 4)
"""


def test_repeated_units_are_counted_once(tmp_path: Path) -> None:
    """Units 2 and 3 have unit 1's structure and input shapes: their counts are unit 1's, not counted again."""
    (tmp_path / "stack.py").write_text(STACK)
    counts = count_model(tmp_path / "stack.py", ProfileOptions(microbatch_sizes=(2,)))
    assert [r.same_as for r in counts.rows] == [None, None, 1, 1, None]
    assert counts.rows[2].counts is counts.rows[1].counts


def _with_calibration(tmp_path: Path, eff: Efficiency) -> Path:
    path = tmp_path / "cal.json"
    Calibration(device="cpu", dtype="float32", efficiency=eff).save(path)
    return path


def test_calibration_recovers_the_efficiencies_of_a_profile(tmp_path: Path) -> None:
    """An analytic profile made with known efficiencies, read as if measured, calibrates back to them, with 0 error."""
    eff = Efficiency(compute=0.3, memory=0.6, op_overhead_s=4e-6, call_overhead_s=5e-5)
    options = ProfileOptions(microbatch_sizes=(2, 4))
    counts = count_model(MODELS / "linrelu.py", options)
    profile = analytic_profile(MODELS / "linrelu.py", "cpu", options, calibration=Calibration("cpu", "float32", eff),
                               counts=counts)
    cal = calibrate(profile, "cpu", counts=counts)
    assert cal.efficiency.memory == pytest.approx(eff.memory, rel=1e-6)
    assert cal.efficiency.op_overhead_s == pytest.approx(eff.op_overhead_s, rel=1e-6)
    assert cal.efficiency.call_overhead_s == pytest.approx(eff.call_overhead_s, rel=1e-6)
    assert cal.worst_error == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match=r"counts were made for .*\(2, 4\).*, not for .*\(4,\)"):
        analytic_profile(MODELS / "linrelu.py", "cpu", ProfileOptions(microbatch_sizes=(4,)), counts=counts)
    assert len(cal.units) == len(counts.rows)
    assert not any(c.startswith("expert_") and c != "expert_param_bytes" for c in profile.units.columns)  # dense


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_cli_analytic_profile_then_calibrate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cal = _with_calibration(tmp_path, Efficiency(compute=0.25, memory=0.5, op_overhead_s=2e-6))
    out = tmp_path / "linrelu-cpu"
    assert main(["profile", str(MODELS / "linrelu.py"), "--analytic", "cpu", "--calibration", str(cal),
                 "--microbatch-sizes", "2", "-o", str(out)]) == 0
    profile = load_profile(out)
    assert set(profile.units["source"]) == {"analytic"}
    assert profile.meta.extra["analytic_device"] == "cpu"
    assert profile.meta.extra["analytic"]["memory_efficiency"] == 0.5
    assert main(["calibrate", str(out)]) == 2  # an analytic profile is no measurement
    assert "is an analytic profile" in capsys.readouterr().err
    meta = json.loads((out / "meta.json").read_text())
    meta["extra"].pop("analytic_device")
    (out / "meta.json").write_text(json.dumps(meta))
    assert main(["calibrate", str(out), "-o", str(tmp_path / "back.json")]) == 0
    assert "median 0.0%" in capsys.readouterr().out
    assert load_calibration(tmp_path / "back.json", "cpu").efficiency.memory == pytest.approx(0.5, rel=1e-6)
    (out / "meta.json").write_text(json.dumps({**meta, "fingerprint": "0000000000000000"}))
    assert main(["calibrate", str(out), "-o", str(tmp_path / "again.json")]) == 2
    assert "does not match the model" in capsys.readouterr().err
    assert not (tmp_path / "again.json").exists()


def test_cli_calibrate_refuses_another_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A profile measured on the CPU calibrates the cpu entry only, refused before any counting."""
    out = tmp_path / "cal.json"
    assert main(["calibrate", str(SHIPPED / "mlp"), "--device", "h100-sxm", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "measured on 'cpu (x86_64)' (catalog device cpu), not h100-sxm" in err and "\n" not in err.strip()
    assert not out.exists()


def test_cli_calibrate_names_profile_and_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "mlp"
    load_profile(SHIPPED / "mlp").save(profile)
    meta = json.loads((profile / "meta.json").read_text())
    (profile / "meta.json").write_text(json.dumps({**meta, "model_path": str(tmp_path / "gone.json")}))
    assert main(["calibrate", str(profile), "-o", str(tmp_path / "cal.json")]) == 2
    assert f"{profile}: its model {tmp_path / 'gone.json'} no longer exists" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--calibration", "x.json"], "--calibration goes with --analytic"),
    (["--analytic", "nonesuch"], "unknown device 'nonesuch'"),
    (["--analytic", "h100-sxm", "--calibration", "CAL"], "calibrated for device 'cpu', not 'h100-sxm'"),
])
def test_cli_analytic_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                               message: str) -> None:
    cal = _with_calibration(tmp_path, Efficiency(compute=0.5, memory=0.5, op_overhead_s=0.0))
    argv = [str(cal) if a == "CAL" else a for a in argv]
    assert main(["profile", str(MODELS / "linrelu.py"), "-o", str(tmp_path / "p"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


@pytest.mark.integration
def test_analytic_gpt_profile_plans(tmp_path: Path, shipped_gpt: Profile) -> None:
    """The planner runs unchanged on an analytic profile of examples/gpt.py for an H100; its bytes are those the
    shipped measured profile found (saved activations included: the fused CPU attention kernel saves no attention
    matrix, which counting on meta, through the math path, would add)."""
    from autopp.data.cluster import Cluster
    from autopp.solve.assemble.make import make_plan
    from autopp.solve.search.request import PlanRequest
    profile = analytic_profile(EXAMPLES / "gpt.py", "h100-sxm", ProfileOptions(microbatch_sizes=(1, 4)))
    assert profile.meta.fingerprint == shipped_gpt.meta.fingerprint
    columns = ["param_bytes", "grad_bytes", "output_bytes"]
    head = profile.units.unit == profile.num_units - 1  # the shipped profile predates the model's output (0 there)
    assert profile.units[~head][columns].equals(shipped_gpt.units[~head][columns])
    assert (profile.units[head].output_bytes == profile.units[head].microbatch_size * 64 * 8192 * 4).all()  # logits
    # Units 0 and 7 save the token ids and targets: slices of sample_batch's (b, 65) tensor when measured (8 b bytes
    # more), tensors of their own here. The blocks:
    blocks = profile.units.unit.between(1, 6)
    assert profile.units[blocks].activation_bytes.equals(shipped_gpt.units[blocks].activation_bytes)
    profile.save(tmp_path / "gpt")
    plan = make_plan(load_profile(tmp_path / "gpt"), PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**34),
                                                                 global_batch=8))
    assert len(plan.stages) == 2 and plan.predicted.step_time_s > 0


# Review of issue 16: fingerprint before the dtype cast, counting failures as one line, dtype of a calibration,
# measuring flags refused, copies (same_as) on analytic rows, fits over measured rows, the calibrated ridge point.


@pytest.mark.integration  # over 2 s: two counts of a model / transformers' MoE import
def test_bfloat16_counts_have_the_measured_fingerprint() -> None:
    """The fingerprint is taken before the cast to --dtype, as the profiler does: a bfloat16 analytic profile of
    mlp.py is current for the shipped measured profile (and `autopp calibrate` accepts it)."""
    measured = load_profile(SHIPPED / "mlp").meta.fingerprint
    assert count_model(EXAMPLES / "mlp.py",
                       ProfileOptions(microbatch_sizes=(1,), dtype="bfloat16")).fingerprint == measured
    assert count_model(EXAMPLES / "mlp.py",
                       ProfileOptions(microbatch_sizes=(1,), dtype="float32")).fingerprint == measured


FAILS_AT_4 = STACK + """
def loss_fn(output, target):
    if target.shape[0] == 4:
        raise RuntimeError("not on this size")
    return torch.nn.functional.mse_loss(output, target)
"""


def test_counting_failure_is_one_line_naming_file_and_unit(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "fails.py").write_text(FAILS_AT_4)
    assert main(["profile", str(tmp_path / "fails.py"), "--analytic", "cpu", "--microbatch-sizes", "2,4",
                 "-o", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "fails.py: unit 4 (4) at microbatch 4: counting on the meta device raised RuntimeError: not on this size" \
        in err


def test_analytic_copies_are_same_as(tmp_path: Path) -> None:
    """Units counted once are written as `same_as` of the analytic rows (one home), and read back."""
    (tmp_path / "stack.py").write_text(STACK)
    analytic_profile(tmp_path / "stack.py", "cpu", ProfileOptions(microbatch_sizes=(2,))).save(tmp_path / "p")
    profile = load_profile(tmp_path / "p")
    assert list(profile.units.same_as) == [-1, -1, 1, 1, -1]
    assert "same_as" not in profile.meta.extra["analytic"]


def test_calibration_fits_measured_rows_only(tmp_path: Path) -> None:
    """Rows copied from another unit (`shared`) are left out of the fit and its errors: scaling their times changes
    nothing."""
    (tmp_path / "stack.py").write_text(STACK)
    eff = Efficiency(compute=0.3, memory=0.6, op_overhead_s=4e-6, call_overhead_s=5e-5)
    options = ProfileOptions(microbatch_sizes=(2,))
    counts = count_model(tmp_path / "stack.py", options)
    profile = analytic_profile(tmp_path / "stack.py", "cpu", options, calibration=Calibration("cpu", "float32", eff),
                               counts=counts)
    units = profile.units.copy()
    copies = units.same_as != -1
    units.loc[copies, "source"] = "shared"
    for column in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s"):
        units.loc[copies, column] *= 10
    cal = calibrate(replace(profile, units=units), "cpu", counts=counts)
    assert [u.unit for u in cal.units] == [0, 1, 4]
    assert cal.worst_error == pytest.approx(0.0, abs=1e-9)


def test_unit_times_split_ops_at_the_calibrated_ridge() -> None:
    """Each op costs the slower of its FLOPs at peak * e_c and its bytes at bandwidth * e_m: ops are split at the
    efficiencies' ridge point, not the datasheet's."""
    spec = load_device("cpu")
    eff = Efficiency(compute=0.05, memory=1.0, op_overhead_s=0.0)
    counts = count_model(MODELS / "linrelu.py", ProfileOptions(microbatch_sizes=(4,))).rows[0].counts.forward
    peak, bw = spec.peak("float32"), spec.memory_bandwidth_bytes_per_s
    expected = sum(max(f / (peak * eff.compute), b / (bw * eff.memory)) for f, b in zip(counts.flops, counts.bytes))
    assert any(peak / bw * b > f > eff.ridge(peak, bw) * b for f, b in zip(counts.flops, counts.bytes))
    assert phase_time(counts.load(eff.ridge(peak, bw)), peak, bw, eff) == pytest.approx(expected, rel=1e-12)
    assert unit_times(PieceCounts(counts, counts, counts, counts, 0, 0, 0), spec, RECIPES["fp32"], eff)["forward_s"] \
        == pytest.approx(expected, rel=1e-12)


def test_fp8_times_the_linear_matmuls_at_the_fp8_peak() -> None:
    """Under the fp8 recipe a linear layer's matmul takes its FLOPs at the float8 peak, another compute-bound op (an
    attention kernel) at the bfloat16 one, a memory-bound op its bytes; bf16 takes both matmuls at bfloat16."""
    spec, eff = load_device("h100-sxm"), Efficiency(compute=0.5, memory=0.8, op_overhead_s=0.0)
    ops = OpCounts(flops=(10**12, 10**12, 10**6), bytes=(10**6, 10**6, 10**6), linear=(True, False, False))
    times = {r: unit_times(PieceCounts(ops, ops, ops, ops, 0, 0, 0), spec, RECIPES[r], eff)["forward_s"]
             for r in ("bf16", "fp8")}
    bf16, fp8, memory = spec.peak("bfloat16") * 0.5, spec.peak("float8") * 0.5, 10**6 / (3.35e12 * 0.8)
    assert times["bf16"] == pytest.approx(2e12 / bf16 + memory, rel=1e-12)
    assert times["fp8"] == pytest.approx(1e12 / fp8 + 1e12 / bf16 + memory, rel=1e-12)


@pytest.mark.parametrize("argv, message", [
    (["--analytic", "cpu", "--calibration", "CAL", "--dtype", "bfloat16"],
     "calibrated for dtype float32, not bfloat16"),
    (["--analytic", "cpu", "--repeats", "3", "--co-runners", "1"], "--repeats, --co-runners apply to measuring only"),
    (["--analytic", "cpu", "--measure-every-unit"], "--measure-every-unit applies to measuring only"),
])
def test_cli_analytic_refuses_other_dtype_and_measuring_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             argv: list[str], message: str) -> None:
    cal = _with_calibration(tmp_path, Efficiency(compute=0.5, memory=0.5, op_overhead_s=0.0))
    argv = [str(cal) if a == "CAL" else a for a in argv]
    assert main(["profile", str(MODELS / "linrelu.py"), "-o", str(tmp_path / "p"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


TINY_MIXTRAL = {"model_type": "mixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 2, "num_key_value_heads": 1, "num_local_experts": 2, "num_experts_per_tok": 1,
                "vocab_size": 64, "max_position_embeddings": 32}


@pytest.mark.integration  # over 2 s: transformers' MoE import and a count
def test_moe_config_profiles_analytically_in_float32(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 30: a tiny Mixtral config printed 22 lines of fake_tensor.py traceback and then `forward() on
    sample_batch(2) raised RuntimeError: Expected inputs of BF16 type` (torch's meta _grouped_mm takes bfloat16 only);
    now it profiles, quietly."""
    config = tmp_path / "tiny-mixtral.json"
    config.write_text(json.dumps(TINY_MIXTRAL))
    assert main(["profile", "--hf-config", str(config), "--analytic", "cpu", "--microbatch-size", "1",
                 "-o", str(tmp_path / "p")]) == 0
    assert "Traceback" not in capsys.readouterr().err
    units = load_profile(tmp_path / "p").units
    assert list(units.name) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]
    assert (units.forward_s > 0).all() and (units.param_bytes > 0).all()


@pytest.mark.integration  # over 2 s: two counts of an HF MoE model
def test_moe_expert_flops_follow_top_k_from_the_config(tmp_path: Path) -> None:
    """Every routed (token, expert) pair is computed: one more expert per token adds, per block, 2 x tokens x
    (hidden x 2 intermediate + intermediate x hidden) FLOPs forward (gate-up and down projections), twice that
    backward, and nothing else (the router's logits are computed for every expert either way)."""
    from autopp.model.hf import hf_model_file

    counts = []
    for k in (1, 2):
        config = tmp_path / f"top{k}.json"
        config.write_text(json.dumps({**TINY_MIXTRAL, "num_experts_per_tok": k}))
        block = count_model(hf_model_file(config, seq_len=8), ProfileOptions(microbatch_sizes=(1,))).rows[1].counts
        counts.append((sum(block.forward.flops), sum(block.backward.flops)))
    h, i, tokens = TINY_MIXTRAL["hidden_size"], TINY_MIXTRAL["intermediate_size"], 8
    per_pair = 2 * (h * 2 * i + i * h)
    assert counts[1][0] - counts[0][0] == tokens * per_pair
    assert counts[1][1] - counts[0][1] == 2 * tokens * per_pair


@pytest.mark.integration  # over 2 s: transformers' MoE import and a count
def test_moe_expert_gemms_are_timed_apart_per_pass(tmp_path: Path) -> None:
    """Issue 30 (expert GEMMs under ep): a MoE's analytic profile times each unit's expert GEMMs apart, per pass:
    at 8 tokens x top-2 (16 rows, 4 experts: every expert read) a block's forward does 2 x 16 x (16 x 64 + 32 x 16)
    FLOPs and reads the 4 experts' bf16 weights; the input gradient reads them again, the weight gradient writes
    their gradients (bf16, as the parameters); selective recomputation reruns the forward's (grouped GEMMs are not
    among the ops it saves); the embedding and the head have none. The columns survive saving."""
    from autopp.data.profile import EXPERT_COLUMNS, expert_column
    from autopp.model.hf import hf_model_file
    config = tmp_path / "tiny-mixtral.json"
    config.write_text(json.dumps({**TINY_MIXTRAL, "num_local_experts": 4, "num_experts_per_tok": 2}))
    spec = load_device("h100-sxm")
    profile = analytic_profile(hf_model_file(config, seq_len=8), spec,
                               ProfileOptions(microbatch_sizes=(1,), dtype="bfloat16"))
    profile.save(tmp_path / "p")
    units = load_profile(tmp_path / "p").units
    assert set(EXPERT_COLUMNS) <= set(units.columns) and not load_profile(tmp_path / "p").experts_untimed
    peak, bw = spec.peak("bfloat16") * 0.6, spec.memory_bandwidth_bytes_per_s * 0.8  # the GPU defaults
    h, i = TINY_MIXTRAL["hidden_size"], TINY_MIXTRAL["intermediate_size"]
    flops, weights = 2 * 8 * 2 * (h * 2 * i + i * h), 4 * (h * 2 * i + i * h) * 2
    block = units.iloc[1]
    assert block[expert_column("forward", "flop")] == pytest.approx(flops / peak)
    for phase, reads in (("forward", 1), ("backward", 2), ("backward_input", 1), ("backward_weight", 1),
                         ("selective_recompute", 1)):
        assert block[expert_column(phase, "weights")] == pytest.approx(reads * weights / bw), phase
        assert block[expert_column(phase, "other")] > 0, phase
    assert block[expert_column("backward", "flop")] == pytest.approx(2 * flops / peak)
    assert block.forward_s >= max(block[expert_column("forward", "flop")],
                                  block[expert_column("forward", "weights")] + block[expert_column("forward", "other")])
    assert (units.iloc[[0, 3]][list(EXPERT_COLUMNS)] == 0).all().all()


@pytest.mark.integration  # over 2 s: transformers' MoE import
def test_moe_routing_by_value_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/models.md: a mixture of experts whose experts loop over the tokens each one is given (DBRX in
    transformers 5: `nonzero` of the routing mask) cannot run on fake tensors; the one line says so and what works."""
    config = tmp_path / "tiny-dbrx.json"
    config.write_text(json.dumps({"model_type": "dbrx", "d_model": 16, "n_heads": 2, "n_layers": 2,
                                  "max_seq_len": 32, "vocab_size": 64,
                                  "attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8},
                                  "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 2, "moe_top_k": 1}}))
    assert main(["profile", "--hf-config", str(config), "--analytic", "cpu", "--microbatch-size", "1",
                 "-o", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"autopp: error: {config}: forward() on sample_batch(2) raised "
                                               "DynamicOutputShapeException: aten.nonzero.default")
    assert "this mixture of experts picks each expert's tokens by value" in err[0]
    assert "Mixtral, Qwen2-MoE, Qwen3-MoE" in err[0]


#: The shipped MoE configs made tiny, every structural key kept (DeepSeek-V3: 1 dense layer before the MoE ones,
#: group-limited sigmoid routing, MLA, yarn rope; Qwen3-30B-A3B: renormalised top-k, q/k norms).
TINY_MOE = {
    "deepseek-v3": {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": 8,
                    "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2, "num_attention_heads": 4,
                    "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 16, "num_hidden_layers": 3, "first_k_dense_replace": 1,
                    "vocab_size": 256},
    "qwen3-30b-a3b": {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
                      "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                      "num_hidden_layers": 3, "max_window_layers": 3, "vocab_size": 256},
}


@pytest.mark.integration  # over 2 s: transformers' MoE models, counted
@pytest.mark.parametrize("name", sorted(TINY_MOE))
def test_shipped_moe_configs_profile_analytically_when_tiny(name: str, tmp_path: Path) -> None:
    """examples/configs' DeepSeek-V3 and Qwen3-30B-A3B with small sizes (the full ones: docs/models.md) profile for
    an H100 in bfloat16: the MoE blocks are counted once and copied, DeepSeek-V3's dense first block apart."""
    config = tmp_path / f"tiny-{name}.json"
    config.write_text(json.dumps({**json.loads((EXAMPLES / "configs" / f"{name}.json").read_text()),
                                  **TINY_MOE[name]}))
    assert main(["profile", "--hf-config", str(config), "--seq-len", "16", "--analytic", "h100-sxm", "--dtype",
                 "bfloat16", "--microbatch-size", "1", "-o", str(tmp_path / "p")]) == 0
    units = load_profile(tmp_path / "p").units
    assert list(units.name) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2",
                                "model.norm"]
    assert (units.forward_s > 0).all()
    dense_first = name == "deepseek-v3"
    assert list(units.same_as) == [-1, -1, -1 if dense_first else 1, 2 if dense_first else 1, -1]
