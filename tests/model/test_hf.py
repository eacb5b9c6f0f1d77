"""A ModelFile from an HF config.json alone (autopp.model.hf): the tiny config builds the same model as
examples/hf_llama.py, its batches and losses fit each task, the public shapes build on meta with their published
parameter counts, errors are one line, and `autopp profile|plan --hf-config` record where the profile came from.

Every test here imports transformers: integration tier (README.md, "Two tiers")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autopp.errors import ModelFileError
from autopp.model import check_forward, discover_units, fingerprint, load_model_file
from autopp.model.hf import _build, hf_model_file, load_model
from autopp.model.meta import build_units

from ..conftest import EXAMPLES, ONE_PIPELINE

pytestmark = pytest.mark.integration

CONFIGS = EXAMPLES / "configs"
TINY = CONFIGS / "tiny-llama.json"
#: The attention shape a causal-LM profile of it records (autopp.data.hf_config.HfSource.attention).
TINY_ATTENTION = {"heads": 4, "kv_heads": 2, "head_dim": 16, "causal": True}


@pytest.fixture(autouse=True)
def _needs_transformers() -> None:
    pytest.importorskip("transformers")


def test_tiny_config_is_examples_hf_llama() -> None:
    """Same numbers as examples/hf_llama.py: the same parameters, units and fingerprint."""
    mf = hf_model_file(TINY)
    model = mf.build()
    assert mf.path == TINY.resolve() and not model.config.use_cache
    assert sum(p.numel() for p in model.parameters()) == 508_480
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ref = load_model_file(EXAMPLES / "hf_llama.py")
    ref_model = ref.build()
    units = discover_units(mf, model)
    assert [u.split_point for u in units] == [u.split_point for u in discover_units(ref, ref_model)]
    assert fingerprint(model, units) == fingerprint(ref_model, discover_units(ref, ref_model))


def test_causal_lm_batch_and_loss() -> None:
    mf = hf_model_file(TINY, seq_len=8)
    model = mf.build()
    (ids,), target = mf.sample_batch(3)
    assert ids.shape == target.shape == (3, 8) and ids.dtype == torch.int64
    assert 0 <= int(ids.min()) and int(ids.max()) < 2048
    again, _ = mf.sample_batch(3)
    assert torch.equal(again[0], ids)  # reproducible for the seed
    loss = mf.loss_fn(model(ids), target)
    assert loss.shape == () and abs(loss.item() - torch.log(torch.tensor(2048.0)).item()) < 1.0  # ~ln(vocab)
    check_forward(mf, model)


def test_the_causal_lm_loss_keeps_the_logits_dtype_as_a_bf16_trainer_without_fp32_upcast() -> None:
    """The loss an HF model's profile is counted with (autopp.model.hf `_loss`) takes the cross-entropy of the
    logits in their own dtype, as NeMo AutoModel's `MaskedCrossEntropy(fp32_upcast=False)` does (its Qwen3-30B-A3B
    benchmark), not transformers' `ForCausalLMLoss`, which upcasts them to float32: on bf16 logits of 2 x 3 tokens x
    5 classes, by hand, the backward keeps one bf16 tensor of 30 log-probabilities (60 bytes; saved by log_softmax
    and nll_loss, one storage), nothing in float32, and the logits' gradient is bf16."""
    mf = hf_model_file(TINY, seq_len=8)
    logits = torch.randn(2, 3, 5, dtype=torch.bfloat16, requires_grad=True)
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        loss = mf.loss_fn(logits, torch.tensor([[0, 1, 2], [3, 4, 0]]))
    floats = {t.untyped_storage().data_ptr(): t for t in saved if t.is_floating_point() and t.numel() > 1}
    assert [(t.dtype, t.numel() * t.element_size()) for t in floats.values()] == [(torch.bfloat16, 60)]
    loss.backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


def test_causal_lm_attention_is_sdpa_with_is_causal_and_no_mask() -> None:
    """Issue 27: a causal LM is built with autopp's attention (autopp.model.hf.CAUSAL_ATTENTION): SDPA with
    is_causal=True and no mask, so no (seq x seq) mask crosses the units or is saved under torch.export; its output
    is transformers' own "sdpa" output."""
    from torch.overrides import TorchFunctionMode

    from autopp.model.hf import CAUSAL_ATTENTION
    mf = hf_model_file(TINY, seq_len=8)
    torch.manual_seed(0)
    model = mf.build()
    assert model.config._attn_implementation == CAUSAL_ATTENTION
    torch.manual_seed(0)
    reference = mf.build()
    reference.config._attn_implementation = "sdpa"
    calls: list[tuple[object, object]] = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            kwargs = kwargs or {}
            if func is torch.nn.functional.scaled_dot_product_attention:
                calls.append((kwargs.get("attn_mask", args[3] if len(args) > 3 else None), kwargs.get("is_causal")))
            return func(*args, **kwargs)

    (ids,), _ = mf.sample_batch(2)
    with Spy():
        out = model(ids).logits
    assert calls and all(mask is None and causal is True for mask, causal in calls)
    torch.testing.assert_close(out, reference(ids).logits)


def test_seq_cls_batch_and_loss(tmp_path: Path) -> None:
    config = tmp_path / "cls.json"
    config.write_text(json.dumps({**json.loads(TINY.read_text()), "pad_token_id": None,
                                  "id2label": {"0": "a", "1": "b", "2": "c"}}))
    mf = hf_model_file(config, seq_len=8, task="seq-cls")
    model = mf.build()
    (ids,), target = mf.sample_batch(4)
    assert ids.shape == (4, 8) and int(ids.min()) >= 1 and target.shape == (4,) and int(target.max()) < 3
    assert model(ids).logits.shape == (4, 3)
    check_forward(mf, model)


def test_masked_lm_on_bert(tmp_path: Path) -> None:
    config = tmp_path / "bert.json"
    config.write_text(json.dumps({"model_type": "bert", "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2,
                                  "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 16}))
    mf = hf_model_file(config, task="masked-lm")
    (ids,), target = mf.sample_batch(2)
    assert ids.shape == (2, 16) and torch.equal(ids, target)
    check_forward(mf, mf.build())


@pytest.mark.parametrize("name,params", [("llama-3-8b", 8_030_261_248), ("llama-3-70b", 70_553_706_496),
                                         ("qwen2.5-7b", 7_615_616_512), ("deepseek-v3", 671_026_404_352),
                                         ("qwen3-30b-a3b", 30_532_122_624), ("llama-1b", 1_235_814_400),
                                         ("llama-3.1-8b", 8_030_261_248), ("bloom-176b", 176_247_271_424)])
def test_public_shapes_build_on_meta(name: str, params: int) -> None:
    """The published sizes (Llama-3-8B 8.03 B, 70B 70.6 B, Qwen2.5-7B 7.62 B; the mixtures of experts DeepSeek-V3
    671 B without its multi-token-prediction layer, which transformers does not build, Qwen3-30B-A3B 30.5 B, and
    the Llama-3.2-1B-shaped config of scripts/device_check.sh, 1.24 B with its tied embedding; BLOOM 176,247 M as
    its paper gives it), nothing allocated."""
    mf = hf_model_file(CONFIGS / f"{name}.json")
    with torch.device("meta"):
        model = mf.build()
    assert sum(p.numel() for p in model.parameters()) == params
    assert {p.device.type for p in model.parameters()} == {"meta"}


def _one_line(call, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ModelFileError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_transformers_errors_are_one_line(tmp_path: Path) -> None:
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({**json.loads(TINY.read_text()), "model_type": "not-a-model"}))
    _one_line(lambda: hf_model_file(unknown), r"unknown.json: transformers \S+ does not know model_type "
                                              r"'not-a-model'; check the key")
    _one_line(lambda: hf_model_file(TINY, task="masked-lm"),
              "tiny-llama.json: transformers has no masked-lm model for model_type 'llama'; give `task` causal-lm "
              "or seq-cls")
    novocab = tmp_path / "novocab.json"
    novocab.write_text(json.dumps({**json.loads(TINY.read_text()), "vocab_size": 1}))
    _one_line(lambda: hf_model_file(novocab), '"vocab_size" must be an integer >= 2')


def test_a_feed_forward_width_left_to_the_class_default_is_refused(tmp_path: Path) -> None:
    """Issue 26: a config without intermediate_size would build Llama's 11008 (BERT's 3072, T5's d_ff 2048) without
    a word; GPT-2 without n_inner is its own 4 x hidden rule and builds."""
    values = json.loads(TINY.read_text())
    del values["intermediate_size"]
    narrow = tmp_path / "narrow.json"
    narrow.write_text(json.dumps(values))
    _one_line(lambda: hf_model_file(narrow), rf'^{narrow}: no "intermediate_size": transformers would use '
                                             "LlamaConfig's default 11008 without a word; add the model's own value")
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64}))
    assert hf_model_file(gpt2, seq_len=8).build() is not None


@pytest.mark.parametrize(("key", "value", "match"), [
    ("num_attention_heads", 5, r"hidden size \(64\) is not a multiple of the number of attention heads \(5\)"),
    ("hidden_size", "64", "hidden_size"),
    ("max_position_embeddings", None, "max_position_embeddings")])
def test_bad_config_values_are_one_line(tmp_path: Path, key: str, value: object, match: str) -> None:
    """A value transformers refuses, whether reading the config or building the model, names the config file."""
    bad = tmp_path / "badcfg.json"
    bad.write_text(json.dumps({**json.loads(TINY.read_text()), key: value}))
    _one_line(lambda: hf_model_file(bad).build(), rf"^{bad}: transformers .*{match}")


def test_one_unit_config_is_told_to_add_layers(tmp_path: Path) -> None:
    """A config cannot define SPLIT_POINTS: a config of 0 layers (1 unit) is told what a config can do."""
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({**json.loads(TINY.read_text()), "num_hidden_layers": 0}))
    _one_line(lambda: build_units(hf_model_file(flat)),
              r"flat.json: found 1 unit\(s\); a pipeline needs >= 2: use a config with at least 2 layers$")


def test_from_config_failure_names_the_config(tmp_path: Path) -> None:
    class Refusing:
        @staticmethod
        def from_config(config: object, dtype: torch.dtype) -> torch.nn.Module:
            raise ValueError("The hidden size (64) is not a multiple\nof the number of attention heads (5)")

    _one_line(lambda: _build(tmp_path / "c.json", Refusing, object()),
              r"c.json: transformers cannot build a model from this config: The hidden size \(64\) is not a "
              r"multiple of the number of attention heads \(5\)$")


def test_seq_len_checked_against_the_class_default(tmp_path: Path) -> None:
    """A config without max_position_embeddings takes its class's default (GPT-2: 1024), checked once transformers
    has read it."""
    config = tmp_path / "gpt2.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64}))
    _one_line(lambda: hf_model_file(config, seq_len=2048), r"`seq_len` 2048 is above .* \(1024\)")


def _mistral(tmp_path: Path, **values: object) -> Path:
    """The tiny Llama config as a Mistral (a sliding-window family), with `values`; a window left out is
    MistralConfig's default 4096."""
    config = tmp_path / "mistral.json"
    config.write_text(json.dumps({**json.loads(TINY.read_text()), "model_type": "mistral", **values}))
    return config


def test_a_sliding_window_shorter_than_the_sequence_is_refused(tmp_path: Path) -> None:
    """Review: causal LMs are built with SDPA is_causal and no mask (`_causal_attention`), which attends over the
    whole prefix: a Mistral window of 8 tokens under 16-token samples was dropped without a word."""
    config = _mistral(tmp_path, sliding_window=8)
    _one_line(lambda: hf_model_file(config, seq_len=16),
              rf'^{config}: "sliding_window" 8 is shorter than `seq_len` 16, and autopp builds causal LMs with full '
              r'causal attention \(SDPA is_causal, no mask\), which would drop the window; give `seq_len` 8 or less, '
              r'or "sliding_window": null for full attention$')
    assert hf_model_file(config, seq_len=8).build() is not None  # i - j < 8 for every pair: no window to drop
    assert hf_model_file(_mistral(tmp_path, sliding_window=None), seq_len=16).build() is not None
    assert hf_model_file(_mistral(tmp_path), seq_len=16).build() is not None  # the default 4096 covers 16 tokens
    # the seq-cls model keeps transformers' own attention (and mask), window included
    assert hf_model_file(config, seq_len=16, task="seq-cls").build() is not None


def test_a_window_the_config_turns_off_is_accepted(tmp_path: Path) -> None:
    """Qwen2 carries a `sliding_window` that applies only with `use_sliding_window` (transformers then sets it)."""
    config = tmp_path / "qwen2.json"
    config.write_text(json.dumps({**json.loads(TINY.read_text()), "model_type": "qwen2", "sliding_window": 4,
                                  "use_sliding_window": False}))
    assert hf_model_file(config, seq_len=16).build() is not None
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_sliding_window": True,
                                  "max_window_layers": 0}))
    _one_line(lambda: hf_model_file(config, seq_len=16), r'"sliding_window" 4 is shorter than `seq_len` 16')


def test_load_model_routes_json_to_the_config() -> None:
    mf = load_model(TINY, {"seq_len": 4, "task": "causal-lm", "model_type": "llama"})
    assert mf.sample_batch(2)[0][0].shape == (2, 4)
    assert load_model(EXAMPLES / "mlp.py").path == (EXAMPLES / "mlp.py").resolve()


def test_cli_profile_then_plan_reuses_or_refreshes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`autopp profile --hf-config --seq-len S` writes profiles/<config stem>-sS/ recording the config, sequence
    length and task; `autopp plan --hf-config` reuses it at the same sequence length and profiles another length
    into a directory of its own (a tester: alternating lengths counted the one directory again each time); the plan
    records both, and `autopp run` builds the model from the config at that length and validates it."""
    from autopp.cli import main
    from autopp.data.profile import load_profile
    monkeypatch.chdir(tmp_path)
    quick = ["--microbatch-sizes", "1", "--repeats", "1", "--warmup", "0"]
    assert main(["profile", "--hf-config", str(TINY), "--seq-len", "8", *quick]) == 0
    profile = load_profile(tmp_path / "profiles" / "tiny-llama-s8")
    assert Path(profile.meta.model_path) == TINY.resolve()
    assert profile.meta.extra["hf_config"] == {"seq_len": 8, "task": "causal-lm", "model_type": "llama",
                                               "attention": TINY_ATTENTION}
    assert profile.num_units == 6
    capsys.readouterr()
    plan = ["plan", "--hf-config", str(TINY), "--devices", "2", "--memory", "1GiB", "--global-batch", "2",
            *ONE_PIPELINE]
    assert main([*plan, "--seq-len", "8"]) == 0
    assert "using profile profiles/tiny-llama-s8/" in capsys.readouterr().err
    assert json.loads((tmp_path / "tiny-llama-s8.plan.json").read_text())["fingerprint"] == profile.meta.fingerprint
    assert main([*plan, "--seq-len", "4"]) == 0
    assert "wrote profile profiles/tiny-llama-s4/" in capsys.readouterr().err
    assert load_profile(tmp_path / "profiles" / "tiny-llama-s4").meta.extra["hf_config"]["seq_len"] == 4
    assert load_profile(tmp_path / "profiles" / "tiny-llama-s8").meta.extra["hf_config"]["seq_len"] == 8
    plan_file = tmp_path / "tiny-llama-s4.plan.json"
    assert json.loads(plan_file.read_text())["hf_config"] == {"seq_len": 4, "task": "causal-lm", "model_type": "llama",
                                                              "attention": TINY_ATTENTION}
    assert main(["run", str(plan_file), "--steps", "2"]) == 0
    assert json.loads((tmp_path / "tiny-llama-s4.plan.report.json").read_text())["passed"] is True
