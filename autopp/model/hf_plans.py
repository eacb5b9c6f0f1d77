"""Tensor-parallel plans for Hugging Face models whose transformers class has none (no `base_model_tp_plan`), by
`model_type`, and the head counts their modules keep as attributes, which a local shard divides by the degree."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = ["HfExtraPlan", "EXTRA_PLANS", "extra_plan", "divide_heads"]


@dataclass(frozen=True)
class HfExtraPlan:
    """A plan for one HF model type: `base` patterns relative to the base model (as `base_model_tp_plan` is),
    `head` patterns relative to the task model (as a model class's `_tp_plan` is), where the layout comes from, and
    the module attributes that hold the attention head count (a reshape reads them)."""

    base: dict[str, str]
    head: dict[str, str]
    source: str
    head_attributes: tuple[str, ...] = ()


#: BLOOM (transformers' BloomModel; Scao et al. 2022, arXiv:2211.05100, s.3.4.1): trained with Megatron-DeepSpeed's
#: tensor parallelism, whose layout the model keeps: the fused query_key_value weight is ordered head by head
#: ([heads, 3, head_dim] on its output features), so a colwise split into equal chunks gives each rank whole heads'
#: q, k and v; the vocabulary-parallel embedding is tied to the LM head. BloomAttention and BloomModel (the ALiBi
#: tensor's heads) keep the head count as `num_heads`.
EXTRA_PLANS: dict[str, HfExtraPlan] = {
    "bloom": HfExtraPlan(
        base={"word_embeddings": "embedding_rowwise", "h.*.self_attention.query_key_value": "colwise",
              "h.*.self_attention.dense": "rowwise", "h.*.mlp.dense_h_to_4h": "colwise",
              "h.*.mlp.dense_4h_to_h": "rowwise"},
        head={"lm_head": "colwise_gather_output"},
        source="Megatron-DeepSpeed's layout, as BLOOM was trained (autopp.model.hf_plans)",
        head_attributes=("num_heads",)),
}


def extra_plan(hf: nn.Module) -> HfExtraPlan | None:
    """The plan autopp keeps for HF model `hf`'s `config.model_type`, or None."""
    return EXTRA_PLANS.get(str(getattr(getattr(hf, "config", None), "model_type", "")))


def divide_heads(hf: nn.Module, t: int) -> None:
    """Divide by `t` (in place) the head counts `hf`'s modules keep as attributes (`HfExtraPlan.head_attributes`),
    where they equal the config's `num_attention_heads`: TP rank 0's local shard reshapes its 1/t of the heads. The
    shard's ALiBi slopes are then those of a t-times smaller model: its shapes and costs are rank 0's, its values are
    not: these plans are for profiling only (`find_tp_plan`'s `counting`; autopp.run does not take them)."""
    extra = extra_plan(hf)
    heads = getattr(getattr(hf, "config", None), "num_attention_heads", None)
    if extra is None or not isinstance(heads, int) or t == 1:
        return
    for module in hf.modules():
        for attr in extra.head_attributes:
            if getattr(module, attr, None) == heads:
                setattr(module, attr, heads // t)
