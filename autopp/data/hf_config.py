"""A Hugging Face config.json as a model source, torch-free: read it, check the task and the sequence length against
it, and name how it was used (`HfSource`), so the CLI can refuse a bad config before torch or transformers load and
a profile can record what it was made from (`ProfileMeta.extra["hf_config"]`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ModelFileError
from ..jsonio import read_json
from .fields import Fields, is_int

__all__ = ["HF_TASKS", "DEFAULT_TASK", "DEFAULT_SEQ_LEN", "POSITION_KEYS", "SIZE_KEYS", "HfSource", "read_hf_config",
           "max_positions", "check_seq_len", "check_size_keys", "hf_source"]

#: The tasks an HF config can be built for (autopp.model.hf maps each to its transformers Auto class, batch, loss).
HF_TASKS = ("causal-lm", "masked-lm", "seq-cls")
DEFAULT_TASK = "causal-lm"
#: Tokens per sample when --seq-len is not given (capped by the config's largest position).
DEFAULT_SEQ_LEN = 512
#: Keys that give a config's largest position, by model family (GPT-2 says n_positions).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")

#: The keys that set a model's size, each with its other families' names for it (transformers' `attribute_map`:
#: GPT-2 n_layer, T5 num_layers, DBRX n_layers, ...). Left out, transformers fills its class default (Llama: 32
#: layers of 4096) without a word, and autopp would plan another model than the user's.
SIZE_KEYS: dict[str, tuple[str, ...]] = {
    "num_hidden_layers": ("n_layer", "num_layers", "n_layers"),
    "hidden_size": ("n_embd", "d_model", "dim"),
    "num_attention_heads": ("n_head", "num_heads", "n_heads"),
    "vocab_size": (),
}

#: A mixture of experts' routing keys by model type (the experts per layer, then the experts per token): left out,
#: transformers fills its class default (Mixtral: 8 experts, top-2) as silently as a size (a tester's config).
MOE_KEYS: dict[str, tuple[str, str]] = {
    "mixtral": ("num_local_experts", "num_experts_per_tok"), "gpt_oss": ("num_local_experts", "num_experts_per_tok"),
    "qwen2_moe": ("num_experts", "num_experts_per_tok"), "qwen3_moe": ("num_experts", "num_experts_per_tok"),
    "deepseek_v3": ("n_routed_experts", "num_experts_per_tok")}

_WHAT = "Hugging Face config.json"
_ADVICE = "give the config.json of a Hugging Face model (e.g. examples/configs/llama-3-8b.json)"


@dataclass(frozen=True, kw_only=True)
class HfSource:
    """A model made from an HF config alone: which file, and the sample shape and task it is built for."""

    config_path: Path
    """The config.json, resolved."""
    values: dict[str, Any]
    """The config's keys and values as the file gives them."""
    seq_len: int
    """Tokens per sample: the batch is (microbatch size, seq_len) token ids."""
    task: str
    """One of HF_TASKS."""

    @property
    def model_type(self) -> str:
        return str(self.values["model_type"])

    def attention(self) -> dict[str, int | bool]:
        """The attention's shape, which context parallelism's cost reads (autopp.costmodel.context): query and
        key/value heads, head size, and whether it is causal (the causal-lm task)."""
        values = {**(self.values.get("text_config") or {}), **self.values}
        hidden, heads = (next(values[k] for k in (key, *SIZE_KEYS[key]) if k in values)
                         for key in ("hidden_size", "num_attention_heads"))
        return {"heads": int(heads), "kv_heads": int(values.get("num_key_value_heads") or heads),
                "head_dim": int(values.get("head_dim") or hidden // heads), "causal": self.task == DEFAULT_TASK}

    def to_json(self) -> dict[str, Any]:
        """What a profile records in `meta.extra["hf_config"]` (the path itself is the profile's `model_path`),
        with the attention's shape (`attention`)."""
        return {"seq_len": self.seq_len, "task": self.task, "model_type": self.model_type,
                "attention": self.attention()}


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The config's keys and values; a ModelFileError naming the file if it is missing, not JSON, not an object or
    has no `model_type`."""
    p = Path(path).resolve()
    data = Fields(str(p), ModelFileError, _ADVICE).obj(read_json(p, _WHAT, ModelFileError, _ADVICE))
    if not isinstance(data.get("model_type"), str) or not data["model_type"]:
        raise ModelFileError(f"{p}: no \"model_type\" key (e.g. \"llama\"): transformers needs it to know the "
                             "architecture; add it as the model's own config.json has it")
    return data


def max_positions(values: dict[str, Any]) -> int | None:
    """The config's largest position (`max_position_embeddings` or its family's name for it), if it gives one."""
    for key in POSITION_KEYS:
        value = values.get(key)
        if is_int(value, 1):
            return value
    return None


def check_seq_len(path: str | Path, seq_len: int, limit: int | None) -> None:
    """A ModelFileError if `seq_len` is not positive or above the config's largest position `limit`."""
    if seq_len < 1:
        raise ModelFileError(f"{path}: `seq_len` must be a positive number of tokens, got {seq_len}")
    if limit is not None and seq_len > limit:
        raise ModelFileError(f"{path}: `seq_len` {seq_len} is above the config's max_position_embeddings ({limit}); "
                             f"give `seq_len` {limit} or less")


def check_size_keys(path: str | Path, values: dict[str, Any]) -> None:
    """A ModelFileError naming the first size key (`SIZE_KEYS`) the config gives under none of its names, at its
    top level or in its `text_config` (a multimodal model's language part)."""
    given = set(values) | set(values.get("text_config") or {})
    for key, aliases in SIZE_KEYS.items():
        if not given & {key, *aliases}:
            other = f" (or {', '.join(aliases)})" if aliases else ""
            raise ModelFileError(f"{path}: no \"{key}\"{other}: transformers would build its default size without a "
                                 "word; add the model's own value, as its config.json on the Hub has it")
    experts_key, top_key = MOE_KEYS.get(str(values.get("model_type")), (None, None))
    if experts_key is None or top_key is None:
        return
    for key in (experts_key, top_key):
        if key not in given:
            raise ModelFileError(f"{path}: no \"{key}\" for this mixture of experts ({values['model_type']}): "
                                 "transformers would route with its default without a word; add the model's own "
                                 "value, as its config.json on the Hub has it")
    routed = {**(values.get("text_config") or {}), **values}
    if isinstance(routed[top_key], int) and isinstance(routed[experts_key], int) and \
            routed[top_key] > routed[experts_key]:
        raise ModelFileError(f"{path}: \"{top_key}\" {routed[top_key]} is above \"{experts_key}\" "
                             f"{routed[experts_key]}: a token cannot reach more experts than there are")


def hf_source(path: str | Path, seq_len: int | None = None, task: str = DEFAULT_TASK) -> HfSource:
    """The checked source: the config read, `task` known, `seq_len` (default: DEFAULT_SEQ_LEN, capped by the
    config's largest position) within the config's positions."""
    values = read_hf_config(path)
    p = Path(path).resolve()
    check_size_keys(p, values)
    if task not in HF_TASKS:
        raise ModelFileError(f"{p}: unknown task {task!r}; give `task` one of {', '.join(HF_TASKS)}")
    limit = max_positions(values)
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, limit) if limit else DEFAULT_SEQ_LEN
    check_seq_len(p, seq_len, limit)
    return HfSource(config_path=p, values=values, seq_len=seq_len, task=task)
