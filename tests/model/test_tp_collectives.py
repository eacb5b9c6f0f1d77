"""autopp.model.tp_collectives: each unit's TP collectives per microbatch, counted from one forward on fake tensors;
an HF config's head under loss parallelism (autopp.model.tp.LOSS_PARALLEL) in place of the gathered logits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from autopp.model.contract import ModelFile, load_model_file
from autopp.model.fake import run_fake
from autopp.model.hf import hf_model_file
from autopp.model.meta import build_meta
from autopp.model.tp import LOSS_PARALLEL, find_tp_plan, local_model_file, resolve, sequence_modules
from autopp.model.tp_collectives import unit_collectives
from autopp.model.units import discover_units

from ..conftest import EXAMPLES


@pytest.fixture(scope="module")
def llama() -> tuple[ModelFile, nn.Module]:
    pytest.importorskip("transformers")
    mf = load_model_file(EXAMPLES / "hf_llama.py")
    return mf, build_meta(mf).model


@pytest.mark.integration  # about half a second: the unit tier stays under a minute
def test_llama_collectives_per_block(llama: tuple[ModelFile, nn.Module]) -> None:
    """2 all-reduces in F (o_proj, down_proj) and 2 in B (the q/k/v input, the gate/up input) per block, each of
    b*s*h elements; the embedding's output all-reduce; lm_head's all-gather (b*s*vocab) and input-grad all-reduce."""
    mf, model = llama
    resolved = resolve(find_tp_plan(mf, model), model)  # type: ignore[arg-type]
    units = discover_units(mf, model)
    inputs, _ = mf.sample_batch(2)
    got = unit_collectives(model, resolved, [u.modules for u in units], lambda: run_fake(lambda *i: model(*i), *inputs))
    bsh = 2 * 32 * 64 * 4
    assert [c.columns() for c in got[1:5]] == [{
        "tp_forward_allreduce_bytes": 2 * bsh, "tp_backward_allreduce_bytes": 2 * bsh, "tp_forward_allgather_bytes": 0,
        "tp_forward_collectives": 2, "tp_backward_collectives": 2, "sp_sequence_bytes": 0}] * 4
    assert (got[0].forward_allreduce_bytes, got[0].forward_collectives, got[0].backward_collectives) == (bsh, 1, 0)
    assert (got[5].forward_allgather_bytes, got[5].backward_allreduce_bytes) == (2 * 32 * 2048 * 4, bsh)
    assert (got[5].forward_collectives, got[5].backward_collectives) == (1, 1)
    # with the sequence-wise modules: each block's two norm inputs, the final norm's (Korthikanti's 4 s b h of 34)
    norms = sequence_modules(find_tp_plan(mf, model), model, resolved)  # type: ignore[arg-type]
    seq = unit_collectives(model, resolved, [u.modules for u in units],
                           lambda: run_fake(lambda *i: model(*i), *inputs), norms)
    assert [c.sequence_bytes for c in seq] == [0, *[2 * bsh] * 4, bsh]
    assert [replace(c, sequence_bytes=0) for c in seq] == got


@pytest.mark.integration  # about a second: the unit tier stays under a minute
def test_an_hf_configs_head_keeps_its_logits_sharded_into_the_loss() -> None:
    """An HF config's model file (its loss autopp's cross-entropy of the logits): the plan's gathered head becomes
    LOSS_PARALLEL (a model file's own loss keeps colwise_gather_output, test above); its collectives are no
    all-gather of the logits but three all-reduces of one number per token in F, and the input-gradient all-reduce
    in B; its local shard computes the loss on 1/t of the vocabulary, targets taken modulo the shard's rows."""
    pytest.importorskip("transformers")
    mf = hf_model_file(EXAMPLES / "configs" / "tiny-llama.json", seq_len=16)
    model = build_meta(mf).model
    plan = find_tp_plan(mf, model)
    assert plan is not None and plan.patterns["lm_head"] == LOSS_PARALLEL and "loss parallel" in plan.source
    resolved = resolve(plan, model)
    units = discover_units(mf, model)
    inputs, _ = mf.sample_batch(2)
    got = unit_collectives(model, resolved, [u.modules for u in units], lambda: run_fake(lambda *i: model(*i), *inputs))
    head = got[-1]
    hidden = model.config.hidden_size
    assert head.forward_allgather_bytes == 0 and head.forward_allreduce_bytes == 3 * 2 * 16 * 4
    assert (head.forward_collectives, head.backward_collectives) == (3, 1)
    assert head.backward_allreduce_bytes == 2 * 16 * hidden * 4
    local = local_model_file(mf, resolved, 2)
    shard = local.build()
    logits = shard(*inputs).logits
    assert logits.shape[-1] == model.config.vocab_size // 2  # the logits stay sharded
    _, target = mf.sample_batch(2)
    assert int(target.max()) >= logits.shape[-1]  # some ids lie outside the shard: taken modulo its rows
    loss = local.loss_fn(shard(*inputs), target)
    assert loss.isfinite() and loss.requires_grad


def test_loss_parallel_sends_float32_maxima_and_sums_beside_the_logits_dtype() -> None:
    """torch's loss_parallel all-reduces, per token, the maximum and the sum of exponentials in float32 (its
    computation dtype) and the target's log-probability in the logits' dtype: 4 + 4 + 2 bytes a token in bfloat16;
    its input's gradient is all-reduced once in B."""
    head = nn.Sequential(nn.Linear(8, 32, bias=False)).to(torch.bfloat16)
    x = torch.randn(3, 5, 8, dtype=torch.bfloat16)
    (got,) = unit_collectives(head, {"0": LOSS_PARALLEL}, [["0"]], lambda: head(x))
    assert (got.forward_allreduce_bytes, got.forward_collectives) == (3 * 5 * (4 + 4 + 2), 3)
    assert (got.backward_allreduce_bytes, got.backward_collectives, got.forward_allgather_bytes) == (3 * 5 * 8 * 2, 1, 0)


def test_only_the_output_layer_takes_loss_parallelism(tmp_path: Path) -> None:
    """Qwen3-Next's HF plan gathers its linear attention's projections inside the blocks: those stay gathered, only
    the output layer (`get_output_embeddings()`) keeps its logits sharded into the loss."""
    pytest.importorskip("transformers")
    from transformers import Qwen3NextConfig
    config = Qwen3NextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4,
                             num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"])
    path = tmp_path / "tiny-qwen3-next.json"
    path.write_text(config.to_json_string())
    mf = hf_model_file(path, seq_len=16)
    model = build_meta(mf).model
    plan = find_tp_plan(mf, model)
    assert plan is not None and plan.patterns["lm_head"] == LOSS_PARALLEL
    assert plan.patterns["model.layers.*.linear_attn.in_proj_qkvz"] == "colwise_gather_output"
    assert [n for n, s in resolve(plan, model).items() if s == LOSS_PARALLEL] == ["lm_head"]
