"""A ModelFile made from a Hugging Face config.json alone: the model built with the task's Auto class `from_config`
(random weights, offline, no hub), random token ids of the configured length as the batch, and the task's loss.

Tasks (autopp.data.hf_config.HF_TASKS): causal-lm (AutoModelForCausalLM; target: the next tokens), masked-lm
(AutoModelForMaskedLM; target: every input token, the cost of scoring each position), seq-cls
(AutoModelForSequenceClassification, num_labels from the config, else 2; target: one random label per sample).
The loss is the cross-entropy of the logits.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ..data.fields import is_int
from ..data.hf_config import DEFAULT_TASK, HfSource, check_seq_len, hf_source, max_positions
from ..errors import ModelFileError
from .contract import ModelFile, load_model_file

__all__ = ["TASK_CLASSES", "is_hf_config", "hf_model_file", "hf_config", "load_model"]

#: The transformers Auto class that builds each task's model.
TASK_CLASSES = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
                "seq-cls": "AutoModelForSequenceClassification"}


def is_hf_config(path: str | Path) -> bool:
    """Whether the model at `path` is an HF config.json (else a Python model file)."""
    return str(path).endswith(".json")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelFileError("building a model from an HF config needs transformers: pip install "
                             "-c scripts/constraints.txt 'autopp[models]'") from None
    return transformers


def _validation_errors() -> tuple[type[Exception], ...]:
    """The errors a config or model raises on bad values: ValueError and TypeError, and huggingface_hub's strict
    dataclass validation errors where that version has them (transformers' configs are strict dataclasses since 5.x)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return (ValueError, TypeError)
    return (ValueError, TypeError, StrictDataclassError)


def _one_line(exc: BaseException) -> str:
    """`exc`'s message on one line (the strict dataclass errors put the cause on an indented second line)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__


def hf_config(source: HfSource) -> Any:
    """The transformers config object: `AutoConfig.for_model` of the file's keys, with use_cache off and, for
    seq-cls, a padding token (0) when the config has none (the classifier reads the last non-padding token)."""
    transformers = _transformers()
    values = {k: v for k, v in source.values.items() if k not in ("model_type", "transformers_version")}
    try:
        config = transformers.AutoConfig.for_model(source.model_type, **values)
    except ValueError as exc:
        if "Unrecognized model identifier" not in str(exc):
            raise ModelFileError(f"{source.config_path}: transformers cannot read this config: "
                                 f"{str(exc).splitlines()[0]}") from None
        raise ModelFileError(f"{source.config_path}: transformers {transformers.__version__} does not know "
                             f"model_type {source.model_type!r}; check the key (e.g. llama, mistral, mixtral, qwen2, "
                             "gpt2) or upgrade transformers") from None
    except (TypeError, KeyError, AttributeError) as exc:
        raise ModelFileError(f"{source.config_path}: transformers cannot read this config: "
                             f"{type(exc).__name__}: {_one_line(exc)}") from None
    except _validation_errors() as exc:  # a value the config's validation refuses (e.g. heads not dividing hidden)
        raise ModelFileError(f"{source.config_path}: transformers refuses this config: {_one_line(exc)}") from None
    _check_defaulted_width(source, config)
    config.use_cache = False
    if source.task == DEFAULT_TASK:
        config._attn_implementation = _causal_attention()
    if source.task == "seq-cls" and getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = 0
    check_seq_len(source.config_path, source.seq_len, max_positions(config.to_dict()))
    if source.task == DEFAULT_TASK:
        _check_sliding_window(source, config)
    return config


def _check_sliding_window(source: HfSource, config: Any) -> None:
    """A ModelFileError when a causal LM's attention is windowed (Mistral's `sliding_window`; Qwen2's with
    `use_sliding_window`; any layer of `layer_types` "sliding_attention", as Gemma 2 and 3 alternate them) and the
    window is shorter than the sequence: `CAUSAL_ATTENTION` runs SDPA with is_causal and no mask, which would attend
    over the whole prefix and drop the window. transformers keeps it only through a (seq x seq) mask
    (`create_sliding_window_causal_mask`), the mask `_causal_attention` leaves out, so autopp refuses instead. Token i
    attends to j when i - j < window (transformers' `sliding_window_overlay`): a window of at least the sequence
    length changes nothing and is accepted."""
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None)
    if not is_int(window, 1) or source.seq_len <= window or kinds is not None and "sliding_attention" not in kinds:
        return
    given = "" if "sliding_window" in source.values else f" ({type(config).__name__}'s default: the file leaves it out)"
    raise ModelFileError(f"{source.config_path}: \"sliding_window\" {window}{given} is shorter than `seq_len` "
                         f"{source.seq_len}, and autopp builds causal LMs with full causal attention (SDPA is_causal, "
                         f"no mask), which would drop the window; give `seq_len` {window} or less, or "
                         "\"sliding_window\": null for full attention")


#: The attention implementation a causal LM is built with (`_causal_attention`).
CAUSAL_ATTENTION = "autopp_causal"


def _no_mask(batch_size: int, q_length: int, kv_length: int, *args: Any, attention_mask: Any = None,
             **kwargs: Any) -> None:
    """transformers' mask function for `CAUSAL_ATTENTION`: no mask (the batch has no padding: no attention_mask, or
    all ones); SDPA is told is_causal instead."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ModelFileError("autopp builds causal LMs without padding (attention is SDPA with is_causal); give "
                             "token ids alone, or an attention_mask of ones")
    return None


def _causal_attention() -> str:
    """`CAUSAL_ATTENTION`, registered with transformers (AttentionInterface, AttentionMaskInterface): its own SDPA
    attention with no mask, so that SDPA runs with is_causal=True as the GPU trainers' fused kernels do. transformers'
    "sdpa" does that too, but only when it can check at run time that no padding is present; under torch.export
    (which cuts the model into units) it cannot, and a (seq x seq) boolean mask then crosses every cut and is saved
    by every layer: 17 GB per sample at 131,072 tokens. The same model under context parallelism needs the
    is_causal form as well (autopp.run.context)."""
    transformers = _transformers()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    transformers.AttentionMaskInterface.register(CAUSAL_ATTENTION, _no_mask)
    transformers.AttentionInterface.register(CAUSAL_ATTENTION, sdpa_attention_forward)
    return CAUSAL_ATTENTION


#: A block's feed-forward width by family (Llama and BERT, T5, OPT): a config class that takes one of these with a
#: fixed default (Llama 11008, BERT 3072, T5 2048) uses it silently when the file leaves it out; a default of None
#: (GPT-2's n_inner) means "4 x hidden" and is the model's own rule, not a size from elsewhere.
_WIDTH_KEYS = ("intermediate_size", "d_ff", "ffn_dim")


def _check_defaulted_width(source: HfSource, config: Any) -> None:
    """A ModelFileError when the config leaves out a feed-forward width its class would fill with a fixed number
    (data.hf_config.check_size_keys checks the other size keys before transformers loads)."""
    import inspect

    params = inspect.signature(type(config).__init__).parameters
    given = set(source.values) | set(source.values.get("text_config") or {})
    for key in _WIDTH_KEYS:
        default = params[key].default if key in params else None
        if isinstance(default, int) and key not in given:
            raise ModelFileError(f"{source.config_path}: no \"{key}\": transformers would use "
                                 f"{type(config).__name__}'s default {default} without a word; add the model's own "
                                 "value, as its config.json on the Hub has it")


def _auto_class(source: HfSource, config: Any) -> Any:
    """The task's Auto class, if transformers has a model of that task for the config's type."""
    auto = getattr(_transformers(), TASK_CLASSES[source.task])
    if type(config) not in auto._model_mapping:
        others = [t for t in TASK_CLASSES if t != source.task]
        raise ModelFileError(f"{source.config_path}: transformers has no {source.task} model for model_type "
                             f"{source.model_type!r}; give `task` {' or '.join(others)}")
    return auto


def _build(config_path: Path, auto: Any, config: Any) -> nn.Module:
    """The task's model with random weights, in float32 (the profile's --dtype casts it). A value the config accepted
    but the model cannot be built with is a ModelFileError naming the config file."""
    try:
        return auto.from_config(copy.deepcopy(config), dtype=torch.float32)
    except _validation_errors() as exc:
        raise ModelFileError(f"{config_path}: transformers cannot build a model from this config: "
                             f"{_one_line(exc)}") from None


@dataclass(frozen=True)
class _Shape:
    """What a batch needs to know of the config: vocabulary, labels, and the first token id to draw."""

    vocab: int
    labels: int
    low: int  # seq-cls draws ids >= 1 so that no input token is the padding token 0


def _shape(source: HfSource, config: Any) -> _Shape:
    vocab = getattr(config, "vocab_size", None)
    if not is_int(vocab, 2):
        raise ModelFileError(f"{source.config_path}: \"vocab_size\" must be an integer >= 2 to draw token ids, "
                             f"got {vocab!r}")
    return _Shape(vocab=vocab, labels=int(getattr(config, "num_labels", 2) or 2),
                  low=1 if source.task == "seq-cls" else 0)


def _sample(source: HfSource, s: _Shape, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids (b, seq_len), the task's target)."""
    n = source.seq_len
    if source.task == "causal-lm":
        ids = torch.randint(s.low, s.vocab, (batch_size, n + 1))
        return ids[:, :-1], ids[:, 1:]
    ids = torch.randint(s.low, s.vocab, (batch_size, n))
    if source.task == "masked-lm":
        return ids, ids.clone()
    return ids, torch.randint(0, s.labels, (batch_size,))


def _loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (class dimension last) against integer targets, averaged, in the logits' own
    dtype: no float32 upcast, as NeMo AutoModel's `MaskedCrossEntropy(fp32_upcast=False)` (nemo_automodel/components/
    loss/masked_ce.py); transformers' `ForCausalLMLoss` and torchtitan's `cross_entropy_loss` (torchtitan/components/
    loss.py) upcast to float32, which doubles the bytes of the loss's logits-sized tensors in a bf16 profile."""
    logits = getattr(output, "logits", output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def hf_model_file(config_path: str | Path, seq_len: int | None = None, task: str = DEFAULT_TASK) -> ModelFile:
    """A ModelFile for the HF config at `config_path`, built for `task` on samples of `seq_len` tokens (default:
    autopp.data.hf_config.DEFAULT_SEQ_LEN, capped by the config's max_position_embeddings). The file is read and
    checked now (the file first, then transformers' reading of it)."""
    source = hf_source(config_path, seq_len, task)
    config = hf_config(source)
    return ModelFile(source.config_path, partial(_build, source.config_path, _auto_class(source, config), config),
                     partial(_sample, source, _shape(source, config)), _loss, None, cross_entropy=True)


def load_model(path: str | Path, hf: dict[str, Any] | None = None) -> ModelFile:
    """The model at `path`: a Python model file (autopp.model.contract), or, for a `.json`, the HF config built as
    `hf` says (`{"seq_len": S, "task": T}`, as a profile's `meta.extra["hf_config"]` records it)."""
    if is_hf_config(path):
        hf = hf or {}
        return hf_model_file(path, hf.get("seq_len"), hf.get("task", DEFAULT_TASK))
    return load_model_file(path)
