"""The profile `autopp plan` makes for itself (cli/profile.py `profile_for`): analytic for a target device this machine
is not, in bfloat16, with the tensor-parallel rows the request pins; and `autopp profile`'s dtype default."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from autopp.cli import main
from autopp.cli.profile import analytic_target, default_dtype
from autopp.data.profile import Profile, load_profile
from autopp.measure.counting import GPU_TILES

GPU_RECORD = json.loads(json.dumps(asdict(GPU_TILES)))  # as an analytic profile's meta.json holds them

from .conftest import ONE_PIPELINE, ROOT

TINY = ROOT / "examples" / "configs" / "tiny-llama.json"
MODELS = ROOT / "tests" / "models"



def _counted(units):  # type: ignore[no-untyped-def]
    """The measured profile's units as a current count records them: the last unit's output (the model's) counted
    (profiles/mlp, measured before it was recorded, has 0 there)."""
    return units.assign(output_bytes=units.output_bytes.where(units.unit < units.unit.max(), 4))


def test_analytic_target_is_every_catalog_device_but_this_machine() -> None:
    assert analytic_target("h100-sxm") == "h100-sxm"
    assert analytic_target("cpu") is None
    assert analytic_target(None) is None
    assert (default_dtype(True), default_dtype(False)) == ("bfloat16", "float32")


@pytest.mark.integration
def test_plan_for_a_gpu_counts_analytically_with_its_tp_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """`autopp plan --hf-config C --device h100-sxm --tp 2` says before any work that it counts for the H100 (this
    machine is not one), writes profiles/C-h100-sxm/ in bfloat16 with rows of tp 2, plans from it and reuses it; a
    profile measured here in profiles/C/ is not taken for it."""
    monkeypatch.chdir(tmp_path)
    plan = ["plan", "--hf-config", str(TINY), "--device", "h100-sxm", "--devices", "8", "--global-batch", "16",
            *ONE_PIPELINE]
    assert main([*plan, "--tp", "2"]) == 0
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith(f"profiling --hf-config {TINY} analytically for h100-sxm (bf16 mixed precision")
    assert f"`autopp profile --hf-config {TINY} --analytic h100-sxm --tp 2`" in first
    profile = load_profile(tmp_path / "profiles" / "tiny-llama-h100-sxm")
    assert profile.meta.dtype == "bfloat16" and profile.meta.extra["analytic_device"] == "h100-sxm"
    assert 2 in profile.meta.tp_degrees
    peaks = profile.meta.extra["tp_peak_bytes"]["2"]  # a TP rank's working memory, counted on its shard
    assert len(peaks) == profile.num_units and all(0 < peaks[u]["1"] for u in peaks)
    assert profile.meta.extra["analytic"]["attention_tiles"] == GPU_RECORD
    assert json.loads((tmp_path / "tiny-llama-h100-sxm.plan.json").read_text())["tp"] == 2
    assert not (tmp_path / "profiles" / "tiny-llama").exists()
    assert main([*plan, "--tp", "2", "--pp", "4"]) == 0
    assert "using profile profiles/tiny-llama-h100-sxm/" in capsys.readouterr().err
    assert profile.meta.optimizer == "adamw" and "; optimizer adamw;" in first  # a GPU's default, said
    assert main([*plan, "--tp", "2", "--kernels", "fused"]) == 0  # fused kernels: a directory of its own
    err = capsys.readouterr().err
    assert "profile profiles/tiny-llama-h100-sxm/" not in err and "--analytic h100-sxm --tp 2 --kernels fused`" in err
    fused = load_profile(tmp_path / "profiles" / "tiny-llama-h100-sxm-fused")
    assert fused.meta.extra["analytic"]["kernels"] == "fused"
    assert load_profile(tmp_path / "profiles" / "tiny-llama-h100-sxm").meta.extra["analytic"]["kernels"] == "eager"
    # another --optimizer makes the cached profile not current: test_a_profile_without_the_pinned_rows_is_not_current


def test_a_profile_without_the_pinned_rows_is_not_current(tmp_path: Path) -> None:
    """A profile lacking the tensor-parallel degree the request pins, or made for another device, is profiled again,
    and the line says why."""
    from autopp.cli.profile import _current
    profile = load_profile(ROOT / "profiles" / "mlp")
    fp = profile.meta.fingerprint
    assert _current(profile, fp, None, None, (), "fp32") is None
    assert _current(profile, fp, None, None, (), "fp32", optimizer=profile.meta.optimizer) is None
    assert _current(profile, fp, None, None, (), "fp32", optimizer="adamw") == \
        f"it counts optimizer {profile.meta.optimizer}'s state, the plan needs adamw's"
    assert _current(profile, fp, None, None, (2,), "fp32") == "it has no tensor-parallel rows of degree 2"
    assert _current(profile, fp, None, "h100-sxm", (), "fp32") == \
        "it is measured, the plan needs one analytic for h100-sxm"
    assert _current(profile, "other", None, None, (), "fp32") == "the model changed"
    assert _current(profile, fp, None, None, (), "fp8") == "it was counted for precision fp32, the plan needs fp8"


def test_an_analytic_moe_profile_without_the_expert_columns_is_not_current() -> None:
    """Issue 30 (expert GEMMs under ep): `autopp plan` counts again a cached analytic profile of a mixture of experts
    that does not time its expert GEMMs apart; a measured one (which cannot) and a dense one stay current."""
    from autopp.cli.profile import _current
    measured = load_profile(ROOT / "profiles" / "mlp")
    routed = replace(measured.meta, extra={**measured.meta.extra, "moe": {"num_experts": 4, "top_k": 2}})
    moe = Profile(routed, measured.units.assign(moe_layers=1), measured.edges)
    fp = moe.meta.fingerprint
    assert _current(moe, fp, None, None, (), "fp32") is None
    analytic = replace(moe.meta, extra={**moe.meta.extra, "analytic_device": "h100-sxm",
                                        "analytic": {"attention_tiles": GPU_RECORD}})
    assert _current(Profile(analytic, moe.units, moe.edges), fp, None, "h100-sxm", (), "fp32") == \
        "it was counted before the expert GEMMs' columns"
    assert _current(Profile(analytic, _counted(measured.units), measured.edges), fp, None, "h100-sxm", (), "fp32") \
        is None


def test_an_analytic_profile_without_the_models_output_bytes_is_not_current() -> None:
    """An analytic profile counted before the model's output was recorded (its last unit's `output_bytes` 0) is
    counted again, so that its plans charge what torch's last stage holds; a measured one stays current (its plans
    say what they lack: autopp.solve.assemble.profile_notes)."""
    from autopp.cli.profile import _current
    shipped = load_profile(ROOT / "profiles" / "llama-3-8b-h100-sxm")
    last = shipped.units.unit == shipped.num_units - 1
    assert (shipped.units[last].output_bytes > 0).all()
    old = Profile(shipped.meta, shipped.units.assign(output_bytes=shipped.units.output_bytes.where(~last, 0)),
                  shipped.edges, shipped.tp_units)
    fp = shipped.meta.fingerprint
    why = "it was counted before the model's output bytes (what the last stage holds for the loss)"
    args = (fp, shipped.meta.extra.get("hf_config"), "h100-sxm", shipped.meta.tp_degrees, "bf16")
    assert _current(shipped, *args) is None and _current(old, *args) == why
    measured = load_profile(ROOT / "profiles" / "mlp")
    assert _current(measured, measured.meta.fingerprint, None, None, (), "fp32") is None


def test_a_fused_profile_that_kept_eagers_saved_bytes_is_not_current() -> None:
    """A fused analytic profile counted before fused kernels' saved bytes (no `analytic.fused_saved`: it charged
    eager's) is counted again; an eager one needs no such record."""
    from autopp.cli.profile import _current
    from autopp.measure.analytic import FUSED_SAVED
    shipped = load_profile(ROOT / "profiles" / "llama-3-8b-h100-sxm")
    fp, recorded = shipped.meta.fingerprint, shipped.meta.extra.get("hf_config")
    analytic = shipped.meta.extra["analytic"]
    assert "fused_saved" not in analytic and _current(shipped, fp, recorded, "h100-sxm", shipped.meta.tp_degrees,
                                                      "bf16") is None

    def fused(**more: str) -> Profile:
        meta = replace(shipped.meta, extra={**shipped.meta.extra, "analytic": {**analytic, "kernels": "fused", **more}})
        return Profile(meta, shipped.units, shipped.edges, shipped.tp_units)
    args = (fp, recorded, "h100-sxm", shipped.meta.tp_degrees, "bf16", None, None, None, "fused")
    assert _current(fused(), *args) == \
        "its fused kernels kept eager's saved bytes, before the count kept what fused kernels keep"
    assert _current(fused(fused_saved=FUSED_SAVED), *args) is None


def test_an_analytic_profile_that_counted_causal_attention_whole_is_not_current() -> None:
    """An analytic profile counted before causal attention's skipped blocks (no `analytic.attention_tiles`: it
    charged every query-key pair), or with blocks no kernel is counted with now, is counted again; a measured
    one (timed, nothing counted) stays current."""
    from autopp.cli.profile import _current
    measured = load_profile(ROOT / "profiles" / "mlp")
    fp = measured.meta.fingerprint
    old = replace(measured.meta, extra={**measured.meta.extra, "analytic_device": "h100-sxm", "analytic": {}})
    assert _current(Profile(old, measured.units, measured.edges), fp, None, "h100-sxm", (), "fp32") == \
        "it counted causal attention whole, before its kernel's skipped blocks"
    new = replace(old, extra={**old.extra, "analytic": {"attention_tiles": GPU_RECORD}})
    assert _current(Profile(new, _counted(measured.units), measured.edges), fp, None, "h100-sxm", (), "fp32") is None
    other = replace(old, extra={**old.extra, "analytic": {"attention_tiles": {"key": 64, "query_blocks": []}}})
    assert _current(Profile(other, measured.units, measured.edges), fp, None, "h100-sxm", (), "fp32") == \
        "it counted causal attention whole, before its kernel's skipped blocks"  # blocks no kernel counts with now
    assert _current(measured, fp, None, None, (), "fp32") is None


@pytest.mark.integration
def test_profile_dtype_defaults_to_bfloat16_for_a_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`autopp profile --analytic h100-sxm` without --dtype counts bfloat16 mixed precision and says so; for the
    CPU it stays float32, silently."""
    assert main(["profile", str(MODELS / "linrelu.py"), "--analytic", "h100-sxm", "-o", str(tmp_path / "g")]) == 0
    assert "dtype bfloat16 (mixed precision, the default for a GPU" in capsys.readouterr().err
    assert load_profile(tmp_path / "g").meta.dtype == "bfloat16"
    assert main(["profile", str(MODELS / "linrelu.py"), "--analytic", "cpu", "-o", str(tmp_path / "c")]) == 0
    assert "dtype" not in capsys.readouterr().err
    assert load_profile(tmp_path / "c").meta.dtype == "float32"


def test_a_moe_profile_without_the_models_routing_groups_is_not_current() -> None:
    """A cached profile of a group-limited mixture of experts (DeepSeek-V3) counted before `extra.moe` recorded the
    groups is counted again, so its all-to-alls are costed node-limited (autopp.costmodel.alltoall); a model without
    groups (None) does not ask for them."""
    from autopp.cli.profile import _current
    measured = load_profile(ROOT / "profiles" / "mlp")
    old = Profile(replace(measured.meta, extra={**measured.meta.extra, "moe": {"num_experts": 8, "top_k": 2}}),
                  measured.units, measured.edges)
    fp = old.meta.fingerprint
    facts = {"num_experts": 8, "top_k": 2, "num_groups": 4, "group_top_k": 2}
    assert _current(old, fp, None, None, (), "fp32", facts) == "it was counted before the routing fact num_groups"
    assert _current(old, fp, None, None, (), "fp32", {**facts, "num_groups": None, "group_top_k": None}) is None
    assert _current(old, fp, None, None, (), "fp32") is None


@pytest.mark.integration
def test_the_quick_starts_shipped_profile_is_current(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """README's Llama-3-8B command plans from profiles/llama-3-8b-h100-sxm/ as shipped (26 s on a fresh clone, where
    counting it takes minutes): a change to counting that makes it stale fails here, saying why, until it is counted
    again (`autopp profile --hf-config examples/configs/llama-3-8b.json --analytic h100-sxm -o
    profiles/llama-3-8b-h100-sxm`)."""
    import argparse

    from autopp.cli import profile as cli_profile
    from autopp.cli.plan import add_parser

    monkeypatch.chdir(ROOT)
    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    add_parser(sub)
    args = sub.choices["plan"].parse_args(["--hf-config", "examples/configs/llama-3-8b.json", "--device", "h100-sxm",
                                           "--nodes", "2"])

    def counting(*_a: object, **_k: object) -> None:
        raise AssertionError(capsys.readouterr().err)

    monkeypatch.setattr("autopp.measure.analytic.analytic_profile", counting)
    profile = cli_profile.profile_for(args, tp=None)
    assert "using profile profiles/llama-3-8b-h100-sxm/" in capsys.readouterr().err
    assert profile.meta.tp_degrees == (2, 4, 8)


def test_default_profile_directories_name_the_length_recipe_and_optimizer() -> None:
    """Testers: alternating --seq-len counted one directory again each time, a --seq-len 4096 request missed the
    shipped profiles/qwen3-30b-a3b-h100-sxm-s4096/, and --optimizer adam overwrote the shipped profiles/gpt/: each
    length, recipe and optimizer other than the target's default has a directory of its own, named as
    scripts/published.py names its profiles."""
    from autopp.cli import _parser
    from autopp.cli.profile import default_profile_dir

    def where(*flags: str) -> str:
        return default_profile_dir(_parser().parse_args(["plan", *flags, "--devices", "2", "--memory", "1GiB"])).name

    qwen = ["--hf-config", "examples/configs/qwen3-30b-a3b.json", "--device", "h100-sxm"]
    assert where(*qwen) == "qwen3-30b-a3b-h100-sxm"
    assert where(*qwen, "--seq-len", "4096") == "qwen3-30b-a3b-h100-sxm-s4096"
    assert where(*qwen, "--seq-len", "512") == "qwen3-30b-a3b-h100-sxm"  # the default length names nothing
    assert where(*qwen, "--seq-len", "4096", "--precision", "bf16-pure") == "qwen3-30b-a3b-h100-sxm-s4096-bf16-pure"
    assert where(*qwen, "--precision", "bf16", "--optimizer", "adamw") == "qwen3-30b-a3b-h100-sxm"
    assert where("examples/gpt.py") == "gpt" and where("examples/gpt.py", "--optimizer", "adam") == "gpt-adam"
