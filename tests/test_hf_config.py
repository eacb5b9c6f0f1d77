"""An HF config.json as a model source, torch-free (autopp.data.hf_config): the shipped configs read, defaults, and
every bad file or flag one line naming the file and what to do; the CLI refuses them before torch loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopp.cli import main
from autopp.data.hf_config import DEFAULT_SEQ_LEN, HF_TASKS, hf_source, max_positions, read_hf_config
from autopp.errors import ModelFileError

from .conftest import EXAMPLES

CONFIGS = EXAMPLES / "configs"
TINY = CONFIGS / "tiny-llama.json"


@pytest.mark.parametrize("name,model_type,positions", [
    ("llama-3-8b", "llama", 8192), ("llama-3-70b", "llama", 8192),
    ("qwen2.5-7b", "qwen2", 131072), ("tiny-llama", "llama", 32), ("deepseek-v3", "deepseek_v3", 163840),
    ("qwen3-30b-a3b", "qwen3_moe", 40960), ("llama-1b", "llama", 131072),
    ("llama-3.1-8b", "llama", 131072)])
def test_shipped_configs_read(name: str, model_type: str, positions: int) -> None:
    values = read_hf_config(CONFIGS / f"{name}.json")
    assert values["model_type"] == model_type and max_positions(values) == positions


def test_default_seq_len_is_capped_by_the_positions() -> None:
    assert hf_source(CONFIGS / "llama-3-8b.json").seq_len == DEFAULT_SEQ_LEN
    tiny = hf_source(TINY)
    assert tiny.seq_len == 32 and tiny.task == "causal-lm"
    assert tiny.to_json() == {"seq_len": 32, "task": "causal-lm", "model_type": "llama",
                              "attention": {"heads": 4, "kv_heads": 2, "head_dim": 16, "causal": True}}
    assert hf_source(TINY, 8, "seq-cls").to_json()["seq_len"] == 8


def test_gpt2_positions_key() -> None:
    assert max_positions({"model_type": "gpt2", "n_positions": 1024}) == 1024
    assert max_positions({"model_type": "x"}) is None


def _one_line_error(call, match: str) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelFileError, match=match) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_files_are_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    assert str(missing) in _one_line_error(lambda: hf_source(missing), "no such Hugging Face config.json")
    _one_line_error(lambda: hf_source(tmp_path), "is a directory")
    broken = tmp_path / "broken.json"
    broken.write_text('{"model_type": "llama",\n')
    _one_line_error(lambda: hf_source(broken), r"broken.json:\d+: not valid JSON .*give the config.json")
    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    _one_line_error(lambda: hf_source(array),
                    r"array.json: expected a JSON object, got list: give the config.json of a Hugging Face model")
    untyped = tmp_path / "untyped.json"
    untyped.write_text(json.dumps({"hidden_size": 8}))
    _one_line_error(lambda: hf_source(untyped), 'no "model_type" key')


def test_bad_task_and_seq_len_are_one_line() -> None:
    message = _one_line_error(lambda: hf_source(TINY, 8, "translation"), "unknown task 'translation'")
    assert all(t in message for t in HF_TASKS) and str(TINY) in message
    _one_line_error(lambda: hf_source(TINY, 33), r"`seq_len` 33 is above the config's max_position_embeddings "
                                                 r"\(32\); give `seq_len` 32 or less")
    _one_line_error(lambda: hf_source(TINY, 0), "positive number of tokens, got 0")


def _fails(args: list[str], capsys: pytest.CaptureFixture[str], pattern: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopp: error: ") and pattern in err[0], err


@pytest.mark.parametrize("command", [["profile"], ["plan", "--devices", "2", "--memory", "1GiB"]])
def test_cli_refuses_bad_hf_input_before_work(command: list[str], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = ["-o", str(tmp_path / ("out" if command[0] == "profile" else "p.json"))]
    _fails([*command, "--hf-config", str(tmp_path / "nope.json"), *out], capsys, "nope.json: no such Hugging Face")
    _fails([*command, "--hf-config", str(TINY), "--seq-len", "64", *out], capsys, "give --seq-len 32 or less")
    _fails([*command, str(EXAMPLES / "gpt.py"), "--hf-config", str(TINY), *out], capsys,
           "one of them), got MODEL.py and --hf-config")
    _fails([*command, str(EXAMPLES / "gpt.py"), "--seq-len", "8", *out], capsys,
           "--seq-len applies to --hf-config only")
    _fails([*command, *out], capsys, "give either MODEL.py or ")
    assert list(tmp_path.iterdir()) == []


def test_profile_refuses_co_runners_with_hf_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["profile", "--hf-config", str(TINY), "--co-runners", "1", "-o", str(tmp_path / "out")], capsys,
           "--co-runners is not supported with --hf-config")


def test_task_choices_are_the_known_tasks(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["profile", "--hf-config", str(TINY), "--task", "translation"])
    assert info.value.code == 2 and "invalid choice: 'translation'" in capsys.readouterr().err


@pytest.mark.parametrize("left_out", ["num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"])
def test_a_size_left_to_transformers_default_is_refused(tmp_path: Path, left_out: str) -> None:
    """Issue 26: a config without num_hidden_layers exited 0 and planned transformers' default of 32 layers."""
    values = json.loads(TINY.read_text())
    del values[left_out]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(values))
    message = _one_line_error(lambda: hf_source(path), f'no "{left_out}"')
    assert message.startswith(f"{path}: ") and "transformers would build its default size without a word" in message


def test_size_keys_by_another_family_name_or_in_text_config_are_read(tmp_path: Path) -> None:
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64}))
    assert hf_source(gpt2).model_type == "gpt2"
    nested = tmp_path / "llava.json"
    nested.write_text(json.dumps({"model_type": "llava", "text_config": json.loads(TINY.read_text())}))
    assert hf_source(nested).model_type == "llava"
