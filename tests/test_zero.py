"""ZeRO stages as descriptors (autopp.data.zero): what each shards and communicates, whether it runs, what each trainer
refuses, and the one place a stage number is parsed."""

from __future__ import annotations

import pytest

from autopp.data.zero import NO_ZERO, SEARCHED_ZERO, ZERO, ZeroStage, zero_stage
from autopp.errors import LayoutError


def test_the_registry_holds_stages_0_to_3_by_number() -> None:
    assert sorted(ZERO) == [0, 1, 2, 3] and all(z.stage == n for n, z in ZERO.items())
    assert NO_ZERO is ZERO[0]
    assert SEARCHED_ZERO == (ZERO[0], ZERO[1], ZERO[3])  # the stages `autopp run` runs
    assert len(set(ZERO.values())) == 4  # hashable and distinct (the search keys its groups by them)


@pytest.mark.parametrize("stage, replicated, optimizer, scatters, gathers, reshard", [
    (0, True, False, False, False, None),
    (1, False, True, False, False, False),
    (2, False, True, True, False, None),
    (3, False, True, False, True, True),
])
def test_what_each_stage_shards_and_communicates(stage: int, replicated: bool, optimizer: bool, scatters: bool,
                                                 gathers: bool, reshard: bool | None) -> None:
    z = ZERO[stage]
    assert (z.replicated, z.shards_optimizer, z.scatters_each_microbatch, z.gathers_each_forward,
            z.fsdp_reshard_after_forward) == (replicated, optimizer, scatters, gathers, reshard)


def test_only_stage_2_cannot_run_under_pipelining() -> None:
    assert [z.stage for z in ZERO.values() if z.not_runnable is not None] == [2]
    why = ZERO[2].not_runnable
    assert why is not None and why.endswith("so ZeRO stage 2 cannot run under it")
    assert ZERO[2] not in SEARCHED_ZERO


def test_names_in_messages() -> None:
    assert [str(z) for z in ZERO.values()] == ["ZeRO 0", "ZeRO 1", "ZeRO 2", "ZeRO 3"]
    assert repr(ZERO[2]) == "ZERO[2]"
    assert ZERO[3].sharded == "optimizer state, and parameters and gradients between steps"


@pytest.mark.parametrize("stage, trainer, refused", [
    (0, "torchtitan", None), (0, "megatron", None), (0, "deepspeed", None),
    (1, "torchtitan", None), (1, "megatron", None), (1, "deepspeed", None),
    (2, "torchtitan", "re-plan with `zero` 1 or 3"), (2, "megatron", "re-plan with `zero` 1"),
    (2, "deepspeed", "re-plan with `zero` 1"),
    (3, "torchtitan", None), (3, "megatron", None), (3, "deepspeed", "re-plan with `zero` 1"),
])
def test_each_trainers_refusals(stage: int, trainer: str, refused: str | None) -> None:
    why = ZERO[stage].refusal(trainer)
    if refused is None:
        assert why is None
    else:
        assert why is not None and why.endswith(refused)


def test_the_refusals_say_what_the_trainer_lacks() -> None:
    titan, ds = ZERO[2].refusal("torchtitan"), ZERO[3].refusal("deepspeed")
    assert titan is not None and titan.startswith("torchtitan has no ZeRO stage 2")
    assert ds is not None and ds.startswith("DeepSpeed's PipelineEngine runs ZeRO stage 0 or 1 only")
    assert ZERO[2].refusal("colossalai") is None  # a trainer it knows nothing about: no refusal
    one_stage = ZERO[3].refusal("deepspeed", pp=1)  # no pipeline: the export's one-stage PipelineModule is why
    assert one_stage is not None and one_stage.startswith("autopp's DeepSpeed export builds the model as a "
                                                          "PipelineModule at pp 1 too")
    assert ZERO[3].refusal("deepspeed", pp=2) == ds and ZERO[2].refusal("torchtitan", pp=1) == titan


def test_refusals_do_not_change_identity() -> None:
    same = ZeroStage(stage=1, sharded="optimizer state", shards_optimizer=True, fsdp_reshard_after_forward=False,
                     trainer_refusals={"torchtitan": "some other wording"})
    assert same == ZERO[1] and hash(same) == hash(ZERO[1])
    assert ZeroStage(stage=1, sharded="optimizer state", shards_optimizer=True) != ZERO[1]


def test_a_stage_number_is_parsed_once() -> None:
    assert [zero_stage(n) for n in range(4)] == list(ZERO.values()) and zero_stage(3) is ZERO[3]
    with pytest.raises(LayoutError, match=r"^ZeRO stage 4 does not exist; give one of \[0, 1, 2, 3\]$"):
        zero_stage(4)
    with pytest.raises(LayoutError, match=r"ZeRO stage -1 does not exist"):
        zero_stage(-1)
    for bad in (True, "1", 1.0, None):  # JSON and flag readers pass what they read; only an int stage is one
        with pytest.raises(LayoutError, match=rf"ZeRO stage {bad!r} does not exist"):
            zero_stage(bad)
