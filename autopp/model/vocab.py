"""Finding the vocabulary layers vocabulary parallelism splits (Yeung et al., MLSys 2025; autopp.run.vocab runs it):
the token embedding as the model's first call, a bias-free head onto its vocabulary as its last, and the mean
cross-entropy of the head's logits as the loss. The profiler records the outcome (`vocab_facts`, a profile's
`meta.extra["vocab"]`) so that the planner refuses a model it cannot split at plan time, in one line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn import functional as F

from ..errors import AutoppError, RunError
from .contract import ModelFile

__all__ = ["VocabModules", "find_vocab_modules", "check_cross_entropy", "vocab_facts", "body_model", "hidden_states"]


@dataclass(frozen=True)
class VocabModules:
    """The modules vocabulary parallelism splits: the token embedding (the model's first call) and the output
    layer (its last, whose output is the model's output)."""

    embedding: str
    head: str
    vocab: int
    hidden: int
    tied: bool
    """The head's weight is the embedding's (GPT-2): one shard of rows per rank serves both."""
    padding_idx: int | None = None
    """The embedding's padding row, whose gradient stays zero (HF models set it from pad_token_id)."""


def find_vocab_modules(model: nn.Module, example: Sequence[Any]) -> VocabModules:
    """The embedding and head of `model`, found by one example forward; a RunError (one line) for a model whose
    first call is not an nn.Embedding, whose last is not a bias-free nn.Linear onto the embedding's vocabulary, or
    whose output is not that layer's."""
    calls: list[tuple[str, nn.Module, Any]] = []
    names = {id(m): n for n, m in model.named_modules()}
    hooks = [m.register_forward_hook(lambda mod, _i, out: calls.append((names[id(mod)], mod, out)))
             for m in model.modules() if not list(m.children())]
    try:
        with torch.no_grad():
            output = model(*example)
    finally:
        for h in hooks:
            h.remove()
    if not calls:
        raise RunError("vocabulary parallelism: the model calls no module")
    (emb_name, emb, _), (head_name, head, head_out) = calls[0], calls[-1]
    if not isinstance(emb, nn.Embedding):
        raise RunError(f"vocabulary parallelism needs an nn.Embedding as the model's first call, got {emb_name!r} "
                       f"({type(emb).__name__})")
    if emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
        raise RunError(f"vocabulary parallelism: embedding {emb_name!r} uses max_norm, sparse or "
                       "scale_grad_by_freq, which its vocabulary shards do not reproduce")
    if not isinstance(head, nn.Linear) or head.bias is not None or head.out_features != emb.num_embeddings:
        raise RunError(f"vocabulary parallelism needs a bias-free nn.Linear onto the {emb.num_embeddings}-token "
                       f"vocabulary as the model's last call, got {head_name!r} ({type(head).__name__})")
    if not any(leaf is head_out for leaf in pytree.tree_leaves(output)):
        raise RunError(f"vocabulary parallelism: the model's output does not hold the output of its head "
                       f"{head_name!r}")
    return VocabModules(emb_name, head_name, emb.num_embeddings, emb.embedding_dim, head.weight is emb.weight,
                        emb.padding_idx)


def check_cross_entropy(loss_fn: Any, model: nn.Module, mods: VocabModules, tokens: torch.Tensor,
                        target: torch.Tensor) -> None:
    """Refuse a model file whose loss is not the mean cross-entropy of the head's logits (what the output pass
    computes), compared on one example batch."""
    logits: list[torch.Tensor] = []
    hook = model.get_submodule(mods.head).register_forward_hook(lambda _m, _i, out: logits.append(out))
    try:
        with torch.no_grad():
            got = float(loss_fn(model(tokens), target))
    finally:
        hook.remove()
    want = float(F.cross_entropy(logits[0].reshape(-1, mods.vocab), target.reshape(-1)))
    if not abs(got - want) <= 1e-4 * max(1.0, abs(want)):
        raise RunError(f"vocabulary parallelism computes the mean cross-entropy of the head's logits ({want:.6g} "
                       f"on an example batch), but the model file's loss_fn gives {got:.6g}")


class _Fed(nn.Module):
    """Stands for the embedding in the body model: the body's input is already the embedded tokens."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def body_model(model: nn.Module, mods: VocabModules) -> nn.Module:
    """`model` without its vocabulary layers (modified in place): it takes the embedded tokens, of the tokens'
    shape plus the hidden size, and returns the hidden states the head reads."""
    for name, repl in ((mods.embedding, _Fed()), (mods.head, nn.Identity())):
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, repl)
    return model


def hidden_states(output: Any) -> torch.Tensor:
    """The one floating-point tensor of the body's output."""
    found = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if len(found) != 1:
        raise RunError(f"vocabulary parallelism: the body's last stage returns {len(found)} floating-point tensors, "
                       "expected its hidden states alone")
    return found[0]


def vocab_facts(mf: ModelFile, first: Sequence[str], last: Sequence[str], seed: int = 0,
                on_meta: nn.Module | None = None) -> dict[str, Any]:
    """What a profile records (`meta.extra["vocab"]`): the vocabulary layers, found on a model built with `seed` and
    checked on an example microbatch of 1, when the embedding is among `first` (unit 0's modules) and the head among
    `last` (the last unit's); else `{"refused": why}`. With the model built `on_meta`, a model whose first unit holds
    no nn.Embedding is refused without building or running it."""
    if on_meta is not None and not any(isinstance(m, nn.Embedding) and any(n == u or n.startswith(u + ".")
                                                                           for u in first)
                                       for n, m in on_meta.named_modules()):
        return {"refused": f"vocabulary parallelism needs a token embedding (nn.Embedding) in the first unit, whose "
                           f"modules are {list(first)}"}
    try:
        model = mf.build(seed)
        inputs, target = mf.sample_batch(1, seed)
        if len(inputs) != 1:
            raise RunError(f"vocabulary parallelism takes one input (the tokens), the model file gives {len(inputs)}")
        mods = find_vocab_modules(model, (inputs[0],))
        check_cross_entropy(mf.loss_fn, model, mods, inputs[0], target)
        _check_body(model, mods, inputs[0])
    except AutoppError as exc:
        return {"refused": str(exc)}
    except Exception as exc:  # noqa: BLE001 - an optional check: the profile records why, the planner says it
        return {"refused": f"vocabulary parallelism: checking the model raised {type(exc).__name__}: {exc}"}
    for name, unit, where in ((mods.embedding, first, "first"), (mods.head, last, "last")):
        if not any(name == m or name.startswith(m + ".") for m in unit):
            return {"refused": f"vocabulary parallelism needs {name!r} in the {where} unit, whose modules are "
                               f"{list(unit)}"}
    return {"embedding": mods.embedding, "head": mods.head, "vocab": mods.vocab, "hidden": mods.hidden,
            "tied": mods.tied}


def _check_body(model: nn.Module, mods: VocabModules, tokens: torch.Tensor) -> None:
    """A RunError unless the model without its vocabulary layers (`body_model`, in place) takes the embedded tokens
    where it took their ids and gives the hidden states of each token, as vocabulary parallelism runs it (a tester:
    GPT-2 reads the ids' shape before its embedding to make its position ids, and its plan failed at run time)."""
    embedded = torch.zeros(*tokens.shape, mods.hidden)
    try:
        with torch.no_grad():
            out = hidden_states(body_model(model, mods)(embedded))
    except Exception as exc:  # noqa: BLE001 - the model's own code: any failure means the body cannot be fed so
        raise RunError(f"vocabulary parallelism feeds the model the embedded tokens in place of their ids, and its "
                       f"forward does not take them ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}): it "
                       "reads the ids before its embedding (as GPT-2's position ids do)") from None
    if tuple(out.shape) != (*tokens.shape, mods.hidden):
        raise RunError(f"vocabulary parallelism: the model fed the embedded tokens {list(embedded.shape)} gave hidden "
                       f"states {list(out.shape)}, not {[*tokens.shape, mods.hidden]}")
