"""Mixture-of-experts layers as autopp sees them (autopp.model.experts): the stacked-experts modules, their bytes per
unit (the profile's `expert_param_bytes` and `moe_layers`) and the routing facts a profile records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from autopp.data.precision import RECIPES
from autopp.measure.memory import static_bytes
from autopp.model import load_model_file
from autopp.model.experts import expert_bytes, experts_modules, is_experts, moe_facts

from ..conftest import EXAMPLES, MODELS

CONFIGS = EXAMPLES / "configs"


@pytest.fixture(autouse=True)
def _needs_transformers() -> None:
    pytest.importorskip("transformers")


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
@pytest.mark.parametrize("model, experts, top_k", [("hf_mixtral.py", 4, 2), ("hf_qwen3_moe.py", 4, 2),
                                                   ("hf_qwen2_moe.py", 4, 2)])
def test_stacked_experts_their_bytes_and_routing(model: str, experts: int, top_k: int) -> None:
    m = load_model_file(MODELS / model).build(0)
    found = experts_modules(m)
    assert list(found) == [f"model.layers.{i}.mlp.experts" for i in range(4)]
    block = m.get_submodule("model.layers.0")
    stacked = sum(p.numel() * 4 for p in found["model.layers.0.mlp.experts"].parameters())
    assert expert_bytes(block) == {"expert_param_bytes": stacked, "moe_layers": 1}
    assert static_bytes(block, "sgd", RECIPES["fp32"])["expert_param_bytes"] == stacked < static_bytes(
        block, "sgd", RECIPES["fp32"])["param_bytes"]  # the shared expert of Qwen2-MoE, attention, norms: dense
    assert expert_bytes(m.get_submodule("model.embed_tokens")) == {"expert_param_bytes": 0, "moe_layers": 0}
    assert moe_facts(m) == {"num_experts": experts, "top_k": top_k, "num_groups": None, "group_top_k": None}


@pytest.mark.parametrize("name, changes, groups", [("deepseek-v3", {}, (8, 4)), ("qwen3-30b-a3b", {}, (None, None)),
                                                   ("deepseek-v3", {"topk_group": 8}, (None, None))])
def test_a_group_limited_routing_is_recorded_from_the_config(name: str, changes: dict[str, int],
                                                              groups: tuple[int | None, int | None],
                                                              tmp_path: Path) -> None:
    """DeepSeek-V3's config routes each token within 4 of 8 expert groups (n_group, topk_group: node-limited routing,
    arXiv:2412.19437 s.2.1.2), which the all-to-alls' cost and Megatron's export read; Qwen3 has no groups, and a
    topk_group of every group limits nothing. Built on meta from examples/configs."""
    import torch
    from autopp.model.hf import hf_model_file
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps({**json.loads((CONFIGS / f"{name}.json").read_text()), **changes}))
    with torch.device("meta"):
        facts = moe_facts(hf_model_file(config).build())
    assert (facts["num_groups"], facts["group_top_k"]) == groups and facts["top_k"] == 8


def test_a_dense_model_has_no_experts() -> None:
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    assert not is_experts(mlp) and experts_modules(mlp) == {} and moe_facts(mlp) == {}


@pytest.mark.integration
def test_an_analytic_profile_records_the_experts_and_the_routing() -> None:
    """The counted profile of tiny Qwen3-MoE: each block's stacked-expert bytes and MoE layer (units.csv's optional
    columns) and the routing in meta.extra["moe"], which the planner's ep terms and the exporters read."""
    from autopp.measure.analytic import analytic_profile
    from autopp.measure.options import ProfileOptions
    p = analytic_profile(MODELS / "hf_qwen3_moe.py", "h100-sxm", ProfileOptions(microbatch_sizes=(1,)))
    assert p.meta.extra["moe"] == {"num_experts": 4, "top_k": 2, "num_groups": None, "group_top_k": None}
    assert list(p.units.moe_layers) == [0, 1, 1, 1, 1, 0]
    blocks = p.units[p.units.moe_layers == 1]
    assert (blocks.expert_param_bytes == 4 * 4 * (2 * 32 * 32 + 32 * 32)).all()  # float32 gate_up + down, 4 experts
    assert (blocks.expert_param_bytes < blocks.param_bytes).all() and p.units.expert_param_bytes.iloc[0] == 0
