"""autopp.measure.tp_rows: which degrees a profile gets rows of, the rows measured exactly on a fake clock
(tests/models/tpticks.py: a block's time is proportional to its shard), and counted by the analytic profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.cli import main
from autopp.data.profile import TP_COLUMNS, load_profile
from autopp.data.profile_tp import SP_COLUMNS
from autopp.errors import TpPlanError
from autopp.measure import MeasureOptions, ProfileOptions, profile_model
from autopp.measure.analytic import analytic_profile
from autopp.measure.tp_rows import tp_setup
from autopp.model.contract import load_model_file

from ..conftest import EXAMPLES, MODELS
from ..models.fakeclock import CLOCK

TPTICKS = MODELS / "tpticks.py"
#: Each block of tpticks.py: fc1 8 -> 32 (colwise), fc2 32 -> 8 (rowwise), float32; fc2's bias stays whole.
BLOCK_BYTES = {1: (8 * 32 + 32 + 32 * 8 + 8) * 4, 2: (8 * 16 + 16 + 16 * 8 + 8) * 4}


def test_degrees_asked_default_and_refused() -> None:
    mf = load_model_file(TPTICKS)
    model = mf.build()
    assert tp_setup(mf, model, (1, 4, 2)).degrees == (2, 4)
    assert tp_setup(mf, model, None, limit=8).degrees == (2, 4, 8)  # every divisor of 32 up to the limit
    assert tp_setup(mf, model, (1,)).plan is None  # no degree >= 2: the plan is not looked at
    with pytest.raises(TpPlanError, match=r"degree 3 does not divide blocks.0.fc1.out_features \(32\)"):
        tp_setup(mf, model, (3,))
    mlp = load_model_file(EXAMPLES / "mlp.py")
    assert tp_setup(mlp, mlp.build(), None).degrees == ()
    with pytest.raises(TpPlanError, match=r"mlp.py: tensor parallelism \(tp 2\) needs a TP plan, and the model has "
                                          r"none .*; define TP_PLAN \(README.md\) or leave out --tp$"):
        tp_setup(mlp, mlp.build(), (2,))


def test_cli_refuses_tp_without_a_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", str(EXAMPLES / "mlp.py"), "--tp", "2", "-o", str(tmp_path / "p")]) == 2
    assert "needs a TP plan" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


@pytest.mark.integration
def test_measured_tp_rows_are_the_shards_times_and_bytes(tmp_path: Path) -> None:
    profile = profile_model(TPTICKS, ProfileOptions(microbatch_sizes=(2,), tp_degrees=(2,)),
                            MeasureOptions(warmup=0, repeats=1, compare_whole=False, clock=CLOCK))
    assert profile.meta.tp_degrees == (2,) and profile.meta.tp_plan_source == f"TP_PLAN in {TPTICKS}"
    rows = profile.tp_units
    assert rows is not None and list(rows.columns) == [*TP_COLUMNS, *SP_COLUMNS] and len(rows) == 5
    blocks = rows[rows.unit.between(1, 3)]
    assert list(blocks.forward_s) == pytest.approx([0.006] * 3)
    assert list(blocks.backward_s) == pytest.approx([0.004] * 3)
    assert list(blocks.param_bytes) == [BLOCK_BYTES[2]] * 3
    units = profile.units[profile.units.unit.between(1, 3)]
    assert list(units.param_bytes) == [BLOCK_BYTES[1]] * 3 and list(units.source) == ["measured", "shared", "shared"]
    # fc2's output all-reduced in F, fc1's input gradient in B: 2 x 8 floats each
    assert set(blocks.tp_forward_allreduce_bytes) == set(blocks.tp_backward_allreduce_bytes) == {2 * 8 * 4}
    assert set(blocks.tp_forward_collectives) == set(blocks.tp_backward_collectives) == {1}
    assert set(rows[~rows.unit.between(1, 3)].tp_forward_collectives) == {0}
    back = load_profile(profile.save(tmp_path / "p"))
    assert back.tp_units is not None and back.tp_units.equals(profile.tp_units)


@pytest.mark.integration
def test_analytic_tp_rows_halve_the_block_and_keep_the_collectives() -> None:
    profile = analytic_profile(TPTICKS, "h100-sxm", ProfileOptions(microbatch_sizes=(4,), tp_degrees=None))
    assert profile.meta.tp_degrees == (2, 4, 8)  # h100-sxm: 8 devices per node
    rows = profile.tp_units
    assert rows is not None and len(rows) == 5 * 3
    for t in (2, 4, 8):
        block = rows[(rows.tp == t) & (rows.unit == 1)].iloc[0]
        assert block.param_bytes == (8 * 32 // t + 32 // t + 32 // t * 8 + 8) * 4
        assert (block.tp_forward_allreduce_bytes, block.tp_backward_allreduce_bytes) == (4 * 8 * 4, 4 * 8 * 4)
    full = profile.units[profile.units.unit == 1].iloc[0]
    assert rows[(rows.tp == 2) & (rows.unit == 1)].iloc[0].forward_s < full.forward_s
    assert (rows.sp_sequence_bytes == 0).all()  # the column SP reads: no norm in this model
    assert analytic_profile(TPTICKS, "h100-sxm", ProfileOptions(microbatch_sizes=(4,), tp_degrees=())).tp_units is None


@pytest.mark.integration
def test_a_failing_plan_leaves_the_default_analytic_rows_out(tmp_path: Path) -> None:
    """Degrees not asked for: the analytic profile is made without TP rows, and says why; asked for: refused."""
    path = tmp_path / "badplan.py"
    path.write_text("from tests.models.tpticks import build_model, sample_batch\n"
                    "TP_PLAN = {'blocks.*.fc9': 'colwise'}\n")
    profile = analytic_profile(path, "h100-sxm", ProfileOptions(microbatch_sizes=(1,), tp_degrees=None))
    assert profile.tp_units is None and profile.meta.tp_degrees == ()
    assert "pattern 'blocks.*.fc9' matches no module of Model" in profile.meta.extra["tp_skipped"]
    with pytest.raises(TpPlanError, match="matches no module"):
        analytic_profile(path, "h100-sxm", ProfileOptions(microbatch_sizes=(1,), tp_degrees=(2,)))


def test_sp_times_are_kept_only_when_every_row_has_them() -> None:
    """A degree whose shard under SP could not be counted leaves the SP time columns out of every row (a plan with SP
    then keeps the plain times), and a shard under SP that torch fails on is logged, not raised."""
    from autopp.data.profile_tp import SP_TIME_COLUMNS
    from autopp.errors import ProfileError
    from autopp.measure.tp_rows import TpSetup, sp_counted, tp_table
    base = {c: 1 for c in (*TP_COLUMNS, *SP_COLUMNS)}
    timed = {**base, **{c: 0.5 for c in SP_TIME_COLUMNS}}
    assert list(tp_table([timed, {**timed, "tp": 4}]).columns) == [*TP_COLUMNS, *SP_COLUMNS, *SP_TIME_COLUMNS]
    assert list(tp_table([timed, {**base, "tp": 4}]).columns) == [*TP_COLUMNS, *SP_COLUMNS]
    mf = load_model_file(TPTICKS)
    setup = tp_setup(mf, mf.build(), (2,))
    assert sp_counted(lambda f, tag: tag, mf, setup, 2) is None  # tpticks has no norm: nothing to count

    def fails(_mf: object, tag: str) -> str:
        raise ProfileError(f"torch failed{tag}")
    with_norms = TpSetup(setup.plan, setup.resolved, setup.degrees, ("blocks.0",))
    assert sp_counted(lambda f, tag: tag, mf, with_norms, 2) == " (tp 2, sp)"
    assert sp_counted(fails, mf, with_norms, 2) is None


@pytest.mark.integration
def test_qwen3_moe_gets_tp_rows_with_its_norms_gradient_allreduce(tmp_path: Path) -> None:
    """The tester's report: `profile --hf-config qwen3-30b-a3b.json --analytic h100-sxm` wrote no TP rows ("style
    'replicated_with_grad_allreduce' is not supported", HF's style for Qwen3's q_norm/k_norm). A tiny Qwen3-MoE gets
    its rows, and each block's backward all-reduces the two norms' weight gradients (head_dim floats each) besides
    q/k/v's input gradient; the plan's dense-MLP patterns, which no layer with routed experts has, are left unused."""
    pytest.importorskip("transformers")
    import json

    from autopp.model.hf import hf_model_file

    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 8, "hidden_size": 32,
              "intermediate_size": 64, "moe_intermediate_size": 16, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
              "vocab_size": 256, "max_position_embeddings": 16, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    mf = hf_model_file(tmp_path / "config.json", seq_len=16)
    profile = analytic_profile(mf, "h100-sxm", ProfileOptions(microbatch_sizes=(1,), tp_degrees=(2,)))
    assert profile.meta.tp_degrees == (2,)
    assert profile.meta.tp_plan["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    rows = profile.tp_units
    assert rows is not None
    blocks = rows[rows.unit.between(1, 2)]  # the two decoder layers
    assert set(blocks.tp_forward_collectives) == {1}  # o_proj (the routed experts are not in HF's TP plan)
    dense = 16 * 32 * 4  # q/k/v's one input gradient: sequence x hidden floats
    norms = 2 * 8 * 4  # q_norm and k_norm: head_dim floats each, one all-reduce each
    assert set(blocks.tp_backward_collectives) == {1 + 2}
    assert set(blocks.tp_backward_allreduce_bytes) == {dense + norms}
