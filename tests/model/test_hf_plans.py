"""autopp.model.hf_plans: BLOOM's tensor-parallel plan (Megatron's layout) is found for profiling only, resolves on
transformers' BloomForCausalLM, and its local shard divides the head counts the modules keep, so rank 0's shard runs
with 1/t of the heads; a model with its own HF plan (Llama) is left alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from autopp.model.contract import ModelFile
from autopp.model.hf_plans import EXTRA_PLANS, divide_heads
from autopp.model.tp import find_tp_plan, local_shard, resolve, sequence_modules, tp_degrees

#: bigscience/bloom's keys at a tiny size (8 heads of 8, 2 blocks, a vocabulary of 96).
TINY_BLOOM = {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "hidden_size": 64, "n_head": 8,
              "n_layer": 2, "vocab_size": 96, "layer_norm_epsilon": 1e-05, "pad_token_id": 3, "bos_token_id": 1,
              "eos_token_id": 2, "use_cache": False}


@pytest.fixture()
def bloom(tmp_path: Path) -> tuple[ModelFile, nn.Module]:
    pytest.importorskip("transformers")
    from autopp.model.hf import hf_model_file
    path = tmp_path / "tiny-bloom.json"
    path.write_text(json.dumps(TINY_BLOOM))
    mf = hf_model_file(path, 16)
    torch.manual_seed(0)
    return mf, mf.build()


def test_bloom_plan_is_found_for_counting_only(bloom: tuple[ModelFile, nn.Module]) -> None:
    mf, model = bloom
    assert find_tp_plan(mf, model) is None  # transformers has none: the runner is not offered one
    plan = find_tp_plan(mf, model, counting=True)
    assert plan is not None and plan.source.startswith(EXTRA_PLANS["bloom"].source)
    assert "loss parallel" in plan.source  # an HF config's loss is autopp's cross-entropy: the logits stay sharded
    assert plan.patterns["lm_head"] == "colwise_loss_parallel" and EXTRA_PLANS["bloom"].head["lm_head"] == \
        "colwise_gather_output"
    assert plan.patterns["transformer.word_embeddings"] == "embedding_rowwise"
    assert plan.patterns["transformer.h.*.self_attention.query_key_value"] == "colwise"
    assert plan.patterns["transformer.h.*.mlp.dense_4h_to_h"] == "rowwise"
    resolved = resolve(plan, model)
    assert len(resolved) == 2 + 4 * TINY_BLOOM["n_layer"]
    assert tp_degrees(model, resolved, 8) == [1, 2, 4, 8]  # 8 heads, 64 wide, 96 words
    # the norms between the sharded projections run on 1/t of the sequence under SP
    assert "transformer.h.0.input_layernorm" in sequence_modules(plan, model, resolved)


def test_bloom_local_shard_runs_with_a_quarter_of_the_heads(bloom: tuple[ModelFile, nn.Module]) -> None:
    mf, model = bloom
    plan = find_tp_plan(mf, model, counting=True)
    assert plan is not None
    resolved = resolve(plan, model)
    x, _ = mf.sample_batch_fn(2)
    local = local_shard(model, resolved, 4)
    attention = local.transformer.h[0].self_attention
    assert (local.transformer.num_heads, attention.num_heads) == (2, 2)
    assert attention.query_key_value.weight.shape == (3 * 64 // 4, 64)
    assert attention.dense.weight.shape == (64, 64 // 4)
    logits = local(x).logits
    assert logits.shape == (2, 16, TINY_BLOOM["vocab_size"] // 4)  # loss parallel: a quarter of the vocabulary


class _Attention(nn.Module):
    def __init__(self, heads: int) -> None:
        super().__init__()
        self.num_heads = heads


class _Model(nn.Module):
    """A stand-in HF model: a config with `model_type` and 8 heads, an attention module keeping `num_heads`."""

    def __init__(self, model_type: str) -> None:
        super().__init__()
        self.config = type("Config", (), {"model_type": model_type, "num_attention_heads": 8})()
        self.attention = _Attention(8)
        self.other = _Attention(3)


def test_divide_heads_only_for_the_model_types_with_a_kept_plan() -> None:
    llama, bloom = _Model("llama"), _Model("bloom")
    divide_heads(llama, 2)
    divide_heads(bloom, 2)
    assert llama.attention.num_heads == 8  # Llama's plan is transformers' own: nothing to divide
    assert (bloom.attention.num_heads, bloom.other.num_heads) == (4, 3)  # only counts equal to the config's heads
