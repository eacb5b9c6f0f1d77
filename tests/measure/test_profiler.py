"""The profiler: exact on layers that take known times on a fake clock, and on layers whose saved tensors are
known. Timing tests inject the clock (tests/models/fakeclock.py), so they hold on a machine under any load."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
import sys
from pathlib import Path
from typing import Any

import pytest

from autopp.measure import MeasureOptions, ProfileOptions, profile_model
from autopp.data.profile import Profile

from ..conftest import MODELS
from ..models.fakeclock import CLOCK

TICKING = MODELS / "ticking.py"


def _live(profile: Profile) -> list[dict[str, Any]]:
    """The profile's live values as meta.json stores them."""
    return [v.to_json() for v in profile.meta.live_values]


def _tied(profile: Profile) -> list[dict[str, Any]]:
    """The profile's tied parameter groups as meta.json stores them."""
    return [g.to_json() for g in profile.meta.tied_parameters]


def _module(name: str):  # type: ignore[no-untyped-def]
    return _module_at(MODELS / f"{name}.py")


def _module_at(path: Path):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(f"t_{path.stem}", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _exact(values: object) -> object:
    """Equal up to the rounding of the clock's float sums."""
    return pytest.approx(values, rel=1e-9, abs=1e-12)


def test_ticking_layers_give_known_times() -> None:
    ticking = _module("ticking")
    profile = profile_model(TICKING, ProfileOptions(microbatch_sizes=(2,)),
                            MeasureOptions(warmup=1, repeats=5, clock=CLOCK))
    table = profile.units.sort_values("unit")
    assert list(table.forward_s) == _exact(ticking.FORWARD_S)
    # The first unit's input is the model's: no input gradient, so its backward is the weight part only.
    assert list(table.backward_s) == _exact([ticking.BACKWARD_WEIGHT_S[0]] + ticking.BACKWARD_S[1:])
    assert list(table.recompute_s) == _exact(ticking.FORWARD_S)
    assert list(table.forward_spread_s) == _exact([0.0] * 3)


def test_backward_splits_into_input_and_weight_times() -> None:
    """torch's stage_backward_input then stage_backward_weight: each tick lands in its own column; the first unit,
    like torch's first stage, has no input-gradient step and counts its whole backward as weight time."""
    ticking = _module("ticking")
    profile = profile_model(TICKING, ProfileOptions(microbatch_sizes=(2,)),
                            MeasureOptions(warmup=1, repeats=5, compare_whole=False, clock=CLOCK))
    table = profile.units.sort_values("unit")
    assert list(table.backward_input_s) == _exact([0.0] + ticking.BACKWARD_INPUT_S[1:])
    assert list(table.backward_weight_s) == _exact(ticking.BACKWARD_WEIGHT_S)
    from autopp.costmodel import unit_arrays
    assert unit_arrays(profile, 2).backward_input[1] == pytest.approx(table.backward_input_s.iloc[1])
    assert table.recompute_keep_bytes.iloc[1] == 2 * ticking.WIDTH * 4  # the unit's input


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_time_budget_stops_repeats_early() -> None:
    ticking = _module("ticking")
    said: list[str] = []
    profile = profile_model(TICKING, ProfileOptions(microbatch_sizes=(1,)),
                            MeasureOptions(warmup=0, repeats=50, time_budget_s=0.06, compare_whole=False,
                                           clock=CLOCK), progress=said.append)
    assert profile.meta.time_budget_s == 0.06
    # One run ticks 5 forwards (timed, again for I/W, without grad, and twice for selective recomputation: recorded,
    # then replayed; a tick is no aten op, so the replay ticks too) and 2 backwards (full, then I + W): 0.152 s.
    # The budget is 0.06 s x 3 units per run, so the second run starts at 0.152 s and the third is not started.
    per_run = 5 * sum(ticking.FORWARD_S) + 2 * (sum(ticking.BACKWARD_S) - ticking.BACKWARD_INPUT_S[0])
    assert per_run == pytest.approx(0.152)
    runs = {m.split("timing run ")[1].split("/")[0] for m in said if "timing run" in m}
    assert runs == {"1", "2"}
    assert list(profile.units.forward_s) == _exact(ticking.FORWARD_S)


def test_whole_model_gap_recorded() -> None:
    profile = profile_model(TICKING, ProfileOptions(microbatch_sizes=(1,)),
                            MeasureOptions(warmup=1, repeats=2, clock=CLOCK))
    (whole,) = profile.meta.whole_model
    assert whole["microbatch_size"] == 1
    ticking = _module("ticking")
    expected = sum(ticking.FORWARD_S) + sum(ticking.BACKWARD_S) - ticking.BACKWARD_INPUT_S[0]
    assert whole["whole_s"] == _exact(expected)
    assert whole["units_s"] == _exact(expected)  # the pieces add up to the whole model exactly
    assert whole["gap"] == pytest.approx(0.0, abs=1e-9)


def test_linear_relu_saved_bytes_and_sizes() -> None:
    profile = profile_model(MODELS / "linrelu.py", ProfileOptions(microbatch_sizes=(1, 3)),
                            MeasureOptions(warmup=0, repeats=1))
    rows = profile.units.set_index(["unit", "microbatch_size"])
    f32 = 4
    for b in (1, 3):
        # Linear saves its input; ReLU saves its output (the next Linear's input shares that storage).
        assert rows.loc[(0, b)].activation_bytes == b * 8 * f32
        assert rows.loc[(1, b)].activation_bytes == b * 32 * f32
        assert rows.loc[(0, b)].output_bytes == b * 32 * f32
        assert rows.loc[(4, b)].output_bytes == b * 4 * f32  # the model's output: the last stage holds it
        # Selective recomputation keeps each Linear's output (its addmm) and nothing of a ReLU, which it reruns.
        assert [rows.loc[(u, b)].selective_activation_bytes for u in range(5)] == [b * w * f32 for w in
                                                                                  (32, 0, 16, 0, 4)]
        assert rows.loc[(1, b)].selective_recompute_s > 0
    assert rows.loc[(0, 1)].param_bytes == (8 * 32 + 32) * f32
    assert rows.loc[(1, 1)].param_bytes == 0
    cuts = profile.cut_bytes(3)
    assert cuts == [3 * 32 * f32, 3 * 32 * f32, 3 * 16 * f32, 3 * 16 * f32]


def test_optimizer_state_counted() -> None:
    profile = profile_model(MODELS / "linrelu.py", ProfileOptions(microbatch_sizes=(1,), optimizer="adam"),
                            MeasureOptions(warmup=0, repeats=1))
    assert (profile.units.optimizer_bytes == 2 * profile.units.param_bytes).all()
    assert profile.meta.dtype == "float32"


def test_the_pipelining_runtimes_time_per_action_is_measured_into_the_meta_on_cpu() -> None:
    profile = profile_model(MODELS / "linrelu.py", ProfileOptions(microbatch_sizes=(1,)),
                            MeasureOptions(warmup=0, repeats=3, compare_whole=False))
    assert profile.meta.runtime_forward_s > 0 and profile.meta.runtime_backward_s > 0  # autopp.measure.runtime
    assert "runtime_cost_skipped" not in profile.meta.extra


def test_bfloat16_parameters_and_fp32_optimizer_state() -> None:
    options = ProfileOptions(microbatch_sizes=(1,), optimizer="adam", dtype="bfloat16")
    profile = profile_model(MODELS / "linrelu.py", options, MeasureOptions(warmup=0, repeats=1, compare_whole=False))
    rows = profile.units.set_index("unit")
    numel = 8 * 32 + 32
    # the bf16 recipe's fp32 gradients (autopp.data.precision: Megatron's main_grad, FSDP2's reduce_dtype)
    assert rows.loc[0].param_bytes == 2 * numel and rows.loc[0].grad_bytes == 4 * numel
    assert rows.loc[0].optimizer_bytes == (2 + 1) * 4 * numel  # two fp32 states and an fp32 master copy
    assert profile.meta.dtype == "bfloat16" and "precision" not in profile.meta.extra  # bfloat16 implies bf16


def test_pure_bf16_is_measured_with_its_bytes_and_recorded() -> None:
    """bf16-pure: bf16 gradients and two bf16 Adam moments, no master (2 + 2 + 4 bytes a parameter); the recipe is
    recorded in the metadata, as bfloat16 alone means bf16 mixed precision (autopp.data.precision)."""
    options = ProfileOptions(microbatch_sizes=(1,), optimizer="adam", dtype="bfloat16", precision="bf16-pure")
    profile = profile_model(MODELS / "linrelu.py", options, MeasureOptions(warmup=0, repeats=1, compare_whole=False))
    row, numel = profile.units.set_index("unit").loc[0], 8 * 32 + 32
    assert (row.param_bytes, row.grad_bytes, row.optimizer_bytes) == (2 * numel, 2 * numel, 4 * numel)
    assert profile.meta.extra["precision"] == "bf16-pure"


@pytest.mark.integration  # about half a second: the unit tier stays under a minute
def test_non_chain_model_live_values_per_cut() -> None:
    """masked.py: a mask made before the blocks is read by every block; the embedding output is read again by the
    last block (its residual add runs in that piece, before the head). Each value crosses each cut it spans once."""
    m = _module("masked")
    profile = profile_model(MODELS / "masked.py", ProfileOptions(microbatch_sizes=(1, 2)),
                            MeasureOptions(warmup=0, repeats=1, compare_whole=False))
    assert profile.meta.unit_names == ("emb", "blocks.0", "blocks.1", "blocks.2", "head")
    values = {(v["src"], tuple(v["dsts"])): v for v in _live(profile)}
    mask, residual = values[(0, (1, 2, 3))], values[(0, (1, 3))]
    assert mask["action"] == "recompute" and mask["bytes"] == {"1": m.T * m.T, "2": m.T * m.T}
    assert residual["action"] == "relay" and residual["relayed_over"] == [1, 2]
    h = 2 * m.T * m.WIDTH * 4  # one activation at microbatch 2
    assert residual["bytes"]["2"] == h
    assert profile.cut_bytes(2) == [h + m.T * m.T, 2 * h + m.T * m.T, 2 * h + m.T * m.T, h]
    assert profile.cut_bytes(2, recompute=True) == [h, 2 * h, 2 * h, h]
    assert [len(profile.cut_values(k)) for k in range(1, 5)] == [2, 3, 3, 1]  # h0 is also block 0's input
    g = profile.graph(2)
    assert g.has_edge(0, 3) and g.has_edge(0, 2)  # non-neighbour edges are recorded


@pytest.mark.integration
def test_hf_gpt2_units_tied_weights_and_mask() -> None:
    pytest.importorskip("transformers")
    from ..conftest import EXAMPLES
    gpt2 = EXAMPLES / "hf_gpt2.py"
    profile = profile_model(gpt2, ProfileOptions(microbatch_sizes=(1,)),
                            MeasureOptions(warmup=0, repeats=1, compare_whole=False))
    assert profile.meta.unit_names == ("transformer.wte",) + tuple(f"transformer.h.{i}" for i in range(4)) + \
        ("transformer.ln_f",)
    (tied,) = _tied(profile)
    assert tied["names"] == ["transformer.wte.weight", "lm_head.weight"] and tied["units"] == [0, 5]
    rows = profile.units.set_index("unit")
    assert rows.loc[0].tied_param_bytes == rows.loc[5].tied_param_bytes == tied["bytes"] == 2048 * 64 * 4
    assert rows.loc[2].tied_param_bytes == 0
    shared = [v for v in _live(profile) if v["src"] == 0 and len(v["dsts"]) > 1]
    assert shared and all(v["action"] == "recompute" for v in shared)  # the causal mask, read by every block


def test_graph_edges_carry_boundary_bytes(gpt_profile) -> None:  # type: ignore[no-untyped-def]
    g = gpt_profile.graph(2)
    assert sorted(g.successors(0)) == [1]
    assert g.edges[3, 4]["bytes"] == 2 * 64 * 128 * 4  # batch x context x width float32
    assert g.nodes[7]["name"] == "ln_f"


def test_bad_microbatch_sizes() -> None:
    with pytest.raises(ValueError, match="positive"):
        profile_model(MODELS / "linrelu.py", ProfileOptions(microbatch_sizes=(0,)))


@pytest.mark.integration
def test_two_stacks_encoder_output_relayed_across_decoder_units() -> None:
    """twostacks.py: the encoder's output (`memory`) feeds the bridge and is read again by both dec blocks."""
    m = _module("twostacks")
    profile = profile_model(MODELS / "twostacks.py", ProfileOptions(microbatch_sizes=(2,)),
                            MeasureOptions(warmup=0, repeats=1, compare_whole=False))
    h = 2 * 3 * m.WIDTH * 4
    # Unit 3 (enc.2 and the bridge) sends the bridge's output to unit 4 and `memory` to the dec units 8 and 9.
    (bridge, memory) = [v for v in _live(profile) if v["src"] == 3]
    assert bridge["dsts"] == [4] and bridge["action"] == "send"
    assert memory["dsts"] == [8, 9] and memory["action"] == "relay" and memory["relayed_over"] == [4, 5, 6, 7, 8]
    assert memory["bytes"] == {"2": h}
    assert profile.cut_bytes(2) == [h, h, h] + [2 * h] * 6 + [h]  # cuts before units 4..9 carry both


@pytest.mark.integration
def test_resnet_cut_bytes_follow_the_downsampling() -> None:
    from ..conftest import EXAMPLES
    r = _module_at(EXAMPLES / "resnet.py")
    profile = profile_model(EXAMPLES / "resnet.py", ProfileOptions(microbatch_sizes=(2,)),
                            MeasureOptions(warmup=0, repeats=1, compare_whole=False))
    assert all(v["action"] == "send" for v in _live(profile))  # a chain
    side = r.IMAGE // 4  # stride-2 convolution and max pool
    stage = [2 * r.WIDTH * 2 ** s * (side // 2 ** s) ** 2 * 4 for s in range(4)]  # bytes of each stage's output
    assert profile.cut_bytes(2) == [stage[0], stage[0], stage[0], stage[1], stage[1], stage[2], stage[2],
                                    stage[3], stage[3]]
    assert profile.meta.tied_parameters == ()


@pytest.mark.integration
def test_hf_bert_mask_relayed_and_tied_decoder() -> None:
    pytest.importorskip("transformers")
    from ..conftest import EXAMPLES
    bert = _module_at(EXAMPLES / "hf_bert.py")
    profile = profile_model(EXAMPLES / "hf_bert.py", ProfileOptions(microbatch_sizes=(2,)),
                            MeasureOptions(warmup=0, repeats=1, compare_whole=False))
    assert profile.meta.unit_names == ("bert.embeddings",) + tuple(f"bert.encoder.layer.{i}" for i in range(4)) + \
        ("cls",)
    # The extended attention mask: made once by unit 0 from the padding-mask input, read by every block.
    (mask,) = [v for v in _live(profile) if v["src"] == 0 and len(v["dsts"]) > 1]
    assert mask["dsts"] == [1, 2, 3, 4] and mask["action"] == "relay" and mask["relayed_over"] == [1, 2, 3]
    h = 2 * bert.CONTEXT * bert.WIDTH * 4
    assert profile.cut_bytes(2)[1] == h + mask["bytes"]["2"]  # between blocks 0 and 1: hidden states and the mask
    tied = {tuple(g["names"]): g for g in _tied(profile)}
    embedding = tied[("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")]
    assert embedding["units"] == [0, 5] and embedding["bytes"] == bert.VOCAB * bert.WIDTH * 4


@pytest.mark.integration
def test_hf_t5_encoder_output_relayed_to_every_decoder_block() -> None:
    pytest.importorskip("transformers")
    from ..conftest import EXAMPLES
    t5 = _module_at(EXAMPLES / "hf_t5.py")
    profile = profile_model(EXAMPLES / "hf_t5.py", ProfileOptions(microbatch_sizes=(2,)),
                            MeasureOptions(warmup=0, repeats=1, compare_whole=False))
    encoder_out = 2 * t5.SOURCE * t5.WIDTH * 4
    decoder = [4, 5, 6]  # units of decoder.block.0..2; unit 3 is the last encoder block with the encoder's norm
    (memory,) = [v for v in _live(profile)
                 if v["src"] == 3 and v["dsts"] == decoder and v["bytes"]["2"] == encoder_out]
    assert memory["action"] == "relay" and memory["relayed_over"] == [4, 5]
    cuts = profile.cut_bytes(2, recompute=True)
    assert cuts[4] >= encoder_out and cuts[5] >= encoder_out  # before decoder blocks 1 and 2
    (tied,) = _tied(profile)
    assert "lm_head.weight" in tied["names"] and tied["units"] == [0, 3, 7]  # decoder embedding runs in unit 3


def test_optimizer_step_measured_and_charged_to_the_plan(tmp_path: Path) -> None:
    """The profile times one optimizer step over the whole model; the plan charges the slowest rank its share."""
    from autopp.data.cluster import Cluster
    from autopp.data.layout import LayoutPins
    from autopp.data.profile import load_profile
    from autopp.schedule import ScheduleName
    from autopp.solve import PlanRequest, make_plan
    profile = profile_model(MODELS / "linrelu.py", ProfileOptions(microbatch_sizes=(2,), optimizer="adam"),
                            MeasureOptions(warmup=1, repeats=3, compare_whole=False))
    assert profile.meta.optimizer_step_s > 0
    assert load_profile(profile.save(tmp_path / "p")).meta.optimizer_step_s == profile.meta.optimizer_step_s
    plan = make_plan(profile, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**30), global_batch=4,
                                          num_microbatches=2, schedule=ScheduleName.ONE_F_ONE_B,
                                          pins=LayoutPins(pp=2, dp=1)))
    assert 0 < plan.predicted.optimizer_s <= profile.meta.optimizer_step_s


# Issue 16: meta-device models, measured a window of pieces at a time; repeated units measured once.

TICKBLOCKS = MODELS / "tickblocks.py"
_TIMES = [f"{k}{s}" for k in ("forward", "backward", "backward_input", "backward_weight", "recompute")
          for s in ("_s", "_spread_s")]


def _materialized(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The qualified names of every tensor the profiler materializes, in order."""
    from autopp.model.meta import MetaModel
    names: list[str] = []
    original = MetaModel.materialize

    def spy(self: MetaModel, wanted: Any, *args: Any, **kwargs: Any) -> Any:
        wanted = list(wanted)
        names.extend(wanted)
        return original(self, wanted, *args, **kwargs)
    monkeypatch.setattr(MetaModel, "materialize", spy)
    return names


def test_repeated_blocks_are_measured_once_and_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    """tickblocks.py: three blocks of one structure and input shape. Shared: block 0 is measured, blocks 1 and 2 copy
    it and are never materialized (the limit keeps the whole model from being materialized for the optimizer step);
    measured every unit, the same times (the fake clock: spread 0, so agreeing within the profile's own spread
    means equal)."""
    tb = _module("tickblocks")
    names = _materialized(monkeypatch)
    shared = profile_model(TICKBLOCKS, ProfileOptions(microbatch_sizes=(2,)),
                           MeasureOptions(warmup=1, repeats=3, compare_whole=False, clock=CLOCK,
                                          memory_limit_bytes=2000))
    assert not [n for n in names if n.startswith(("blocks.1.", "blocks.2."))]
    rows = shared.units.set_index("unit")
    assert list(rows.source) == ["measured", "measured", "shared", "shared", "measured"]
    assert list(rows.same_as) == [-1, -1, 1, 1, -1]
    names.clear()
    every = profile_model(TICKBLOCKS, ProfileOptions(microbatch_sizes=(2,)),
                          MeasureOptions(warmup=1, repeats=3, compare_whole=False, clock=CLOCK, measure_every_unit=True,
                                         memory_limit_bytes=2000))
    assert [n for n in names if n.startswith("blocks.2.")] == ["blocks.2.bias"]
    assert list(every.units.source) == ["measured"] * 5
    assert list(every.units.forward_s[1:4]) == _exact([tb.BLOCK_FORWARD_S] * 3)
    spread = every.units[[c for c in _TIMES if c.endswith("spread_s")]].to_numpy()
    assert list(spread.ravel()) == _exact([0.0] * spread.size)  # the clock's float sums round by its magnitude
    for column in _TIMES + ["activation_bytes", "param_bytes", "output_bytes", "recompute_keep_bytes"]:
        assert list(shared.units[column]) == _exact(list(every.units[column])), column


def test_shared_profile_loads_back(tmp_path: Path) -> None:
    from autopp.data.profile import load_profile
    profile = profile_model(TICKBLOCKS, ProfileOptions(microbatch_sizes=(1,)),
                            MeasureOptions(warmup=0, repeats=1, compare_whole=False, clock=CLOCK))
    back = load_profile(profile.save(tmp_path / "p"))
    assert list(back.units.source) == list(profile.units.source) and list(back.units.same_as) == [-1, -1, 1, 1, -1]


WIDE = 1024  # a WIDE x WIDE float32 weight: 4 MiB, above SMALL_BYTES, so built on meta
LAYERS = 8


def _wide_model_file() -> Any:
    """LAYERS units of Linear(WIDE, WIDE) + ReLU."""
    import torch
    from torch import nn
    from autopp.model.contract import ModelFile, default_loss

    def build() -> nn.Module:
        return nn.Sequential(*[nn.Sequential(nn.Linear(WIDE, WIDE), nn.ReLU()) for _ in range(LAYERS)])
    return ModelFile(Path("wide.py"), build, lambda b: (torch.randn(b, WIDE), torch.randn(b, WIDE)), default_loss,
                     None)


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_the_whole_model_is_never_materialized(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a limit below the model's parameters and gradients, every piece (each measured: no sharing) is materialized
    alone (a hook on materialization refuses more than one unit at once), the whole-model comparison is skipped and
    says why, and the optimizer step is the pieces' sum; the process's memory, after a first profile of the same
    model (torch.export's own growth; glibc keeps freed memory), grows by less than half the model's parameters and
    gradients (psutil; RSS as a loose bound only)."""
    import threading
    import psutil
    from autopp.model.meta import MetaModel
    unit = 2 * (WIDE * WIDE + WIDE) * 4  # one unit's parameters and gradients
    total = LAYERS * unit
    seen: list[int] = []
    original = MetaModel.load

    def refuse_more_than_one_unit(self: MetaModel, *args: Any, **kwargs: Any) -> int:
        n = original(self, *args, **kwargs)
        seen.append(self.materialized_bytes)
        assert self.materialized_bytes <= unit // 2, f"{self.materialized_bytes} bytes materialized at once"
        return n
    monkeypatch.setattr(MetaModel, "load", refuse_more_than_one_unit)
    options = (ProfileOptions(microbatch_sizes=(1,)),
               MeasureOptions(warmup=0, repeats=1, memory_limit_bytes=unit, measure_every_unit=True))
    profile_model(_wide_model_file(), *options)  # first: torch.export's and the allocator's own growth
    seen.clear()
    process = psutil.Process()
    start = process.memory_info().rss
    rss = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.005):
            rss.append(process.memory_info().rss)
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        profile = profile_model(_wide_model_file(), *options)
    finally:
        done.set()
        sampler.join()
    assert len(seen) == LAYERS and max(seen) == unit // 2 < total
    assert profile.meta.extra["materialized_peak_bytes"] == unit // 2
    assert profile.meta.whole_model == () and "not materialized whole" in profile.meta.extra["whole_model_skipped"]
    assert profile.meta.optimizer_step_s > 0
    assert list(profile.units.source) == ["measured"] * LAYERS
    if sys.platform.startswith("linux"):  # a freed unit's large tensors are not kept resident (allocator.py)
        assert profile.meta.extra["allocator"] == "glibc: no trim, mmap from 256 MiB"
    assert max(rss) - start < total // 2, (max(rss) - start, total)


def test_co_runners_need_the_whole_model() -> None:
    from autopp.errors import ModelFileError
    with pytest.raises(ModelFileError, match=r"--co-runners 1 needs the whole model .* > the limit of 1000 bytes"):
        profile_model(_wide_model_file(), ProfileOptions(microbatch_sizes=(1,)),
                      MeasureOptions(co_runners=1, memory_limit_bytes=1000))


def test_cpu_peak_bytes_per_unit() -> None:
    """linrelu.py: the peak bytes allocated in each unit's forward and backward, measured on CPU like CUDA's."""
    profile = profile_model(MODELS / "linrelu.py", ProfileOptions(microbatch_sizes=(1, 3)),
                            MeasureOptions(warmup=0, repeats=1, compare_whole=False))
    peaks = profile.unit_peak_bytes()
    assert sorted(peaks) == list(range(profile.num_units)) and all(sorted(p) == [1, 3] for p in peaks.values())
    rows = profile.units.set_index(["unit", "microbatch_size"])
    for (u, b), row in rows.iterrows():
        # at least the gradients it leaves and what autograd saved, at most everything it touched twice over
        assert row.grad_bytes + row.activation_bytes <= peaks[u][b] <= 4 * (row.param_bytes + row.activation_bytes
                                                                            + row.output_bytes + 512)
    assert "LiveBytes" in profile.meta.extra["peak_bytes_how"]


@pytest.mark.integration
def test_shared_and_every_unit_agree_within_the_spread() -> None:
    """Real timing (the only way to see it on a real model): examples/gpt.py's blocks, shared from block 0 and each
    measured. Two medians agree when their max - min ranges, widened to cover the machine's drift between the two
    profiles (twice each spread), overlap, or when they are within 35 % of each other: a loaded CI machine drifted
    20 % between two profiles taken seconds apart (stop 39). That a shared row is block 1's own figures is checked
    exactly (until 2026-12-06 by its time being far from the embedding's and the head's, 5x less and 4x more than a
    block on a quiet machine: under two CPU-bound co-runners the head's forward came out 1.5x a block's, a speed
    the test asserted); no speed is asserted."""
    from ..conftest import EXAMPLES
    options, measuring = ProfileOptions(microbatch_sizes=(2,)), MeasureOptions(warmup=2, repeats=7, compare_whole=False)
    shared = profile_model(EXAMPLES / "gpt.py", options, measuring).units.set_index("unit")
    every = profile_model(EXAMPLES / "gpt.py", options, replace(measuring, measure_every_unit=True))
    every = every.units.set_index("unit")
    blocks = [u for u in shared.index if shared.source[u] == "shared"]
    assert blocks == [2, 3, 4, 5, 6] and set(shared.same_as[blocks]) == {1}

    def near(a: float, b: float) -> bool:
        return abs(a - b) <= 0.35 * max(a, b)

    for kind in ("forward", "backward"):
        times, spreads = f"{kind}_s", f"{kind}_spread_s"
        for u in blocks:
            a, b = shared[times][u], every[times][u]
            assert near(a, b) or abs(a - b) <= 2 * (shared[spreads][u] + every[spreads][u]), (u, kind, a, b)
        for u in blocks:  # shared from block 1 exactly: its times and spreads, not another unit's
            assert (shared[times][u], shared[spreads][u]) == (shared[times][1], shared[spreads][1]), (u, kind)
        assert shared[times][1] not in (shared[times][0], shared[times][7]), kind  # measured apart from those


def test_plan_checks_its_profile_on_the_meta_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`autopp plan MODEL.py` (cli/profile.py profile_for) takes the fingerprint of the model built on meta, as the
    profiler does: the current profile is reused and no large parameter is built (the model file records the
    device of its large weight)."""
    import argparse
    from autopp.cli.profile import profile_for
    model = tmp_path / "big.py"
    model.write_text(
        "from pathlib import Path\nimport torch\nfrom torch import nn\nSPLIT_POINTS = ['1']\n"
        "def build_model():\n    m = nn.Sequential(nn.Linear(8, 600), nn.Linear(600, 600), nn.Linear(600, 8))\n"
        "    Path(__file__).with_suffix('.device').write_text(str(m[1].weight.device))\n    return m\n"
        "def sample_batch(b):\n    return torch.randn(b, 8), torch.randn(b, 8)\n"
        "def loss_fn(out, target):\n    return nn.functional.mse_loss(out, target)\n")
    monkeypatch.chdir(tmp_path)
    profile_model(model, ProfileOptions(microbatch_sizes=(1,)),
                  MeasureOptions(warmup=0, repeats=1, compare_whole=False)).save(Path("profiles/big"))
    args = argparse.Namespace(model=str(model), profile=None, hf_config=None, seq_len=None, task=None, precision=None)
    assert profile_for(args).num_units == 2
    assert "using profile profiles/big/" in capsys.readouterr().err
    assert (tmp_path / "big.device").read_text() == "meta"


def test_the_memory_limit_on_cuda_is_a_quarter_of_the_gpus_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29, item 5 (found by reading the CUDA path): the whole model was materialized on the GPU whenever it
    fitted a quarter of the host's RAM, which can be many times the GPU's memory. Devices faked: no GPU here."""
    from types import SimpleNamespace

    import torch

    from autopp.measure import profiler
    monkeypatch.setattr(profiler, "physical_memory_bytes", lambda: 2 * 2**40)  # 2 TiB of host memory
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=141 * 2**30))
    assert profiler.default_memory_limit("cuda") == 141 * 2**30 // 4
    assert profiler.default_memory_limit("cpu") == 2**40 // 2
    monkeypatch.setattr(profiler, "physical_memory_bytes", lambda: 64 * 2**30)  # the smaller of the two
    assert profiler.default_memory_limit("cuda") == 16 * 2**30
