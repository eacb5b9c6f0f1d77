"""The model file contract: loading, unit discovery, fingerprints, and one clear error per bad file."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.errors import ModelFileError
from autopp.modelfile import check_forward, discover_units, fingerprint, load_model_file

from .conftest import EXAMPLES, MODELS


def _units(path: Path) -> list[str | None]:
    mf = load_model_file(path)
    model = mf.build()
    return [u.split_point for u in discover_units(mf, model)]


def test_gpt_units_are_pre_blocks_post() -> None:
    mf = load_model_file(EXAMPLES / "gpt.py")
    units = discover_units(mf, mf.build())
    assert [u.name for u in units] == ["tok_emb"] + [f"h.{i}" for i in range(6)] + ["ln_f"]
    assert units[0].modules == ("tok_emb", "pos_emb") and units[-1].modules == ("ln_f", "head")


def test_sequential_children_are_units() -> None:
    assert _units(EXAMPLES / "mlp.py") == [None] + [str(i) for i in range(1, 8)]


def test_split_points_override(tmp_path: Path) -> None:
    src = (EXAMPLES / "gpt.py").read_text() + '\nSPLIT_POINTS = ["h.2", "ln_f"]\n'
    (tmp_path / "m.py").write_text(src)
    assert _units(tmp_path / "m.py") == [None, "h.2", "ln_f"]


def test_fingerprint_tracks_structure(tmp_path: Path) -> None:
    mf = load_model_file(EXAMPLES / "gpt.py")
    a, b = mf.build(seed=0), mf.build(seed=1)
    units = discover_units(mf, a)
    assert fingerprint(a, units) == fingerprint(b, units)  # weights do not matter
    (tmp_path / "m.py").write_text((EXAMPLES / "gpt.py").read_text().replace("LAYERS = 6", "LAYERS = 5"))
    mf2 = load_model_file(tmp_path / "m.py")
    model2 = mf2.build()
    assert fingerprint(model2, discover_units(mf2, model2)) != fingerprint(a, units)


BAD_FILES = {
    "syntax": ("def build_model(:\n", r"m\.py:1: syntax error"),
    "missing": ("import torch\ndef sample_batch(b):\n    return torch.zeros(b), torch.zeros(b)\n",
                r"missing required function build_model\(\)"),
    "raises": ("raise RuntimeError('boom')\n", r"importing it raised RuntimeError: boom \(at m\.py:1\)"),
    "not_module": ("def build_model():\n    return 3\ndef sample_batch(b):\n    return 1, 2\n",
                   r"build_model\(\) must return a torch\.nn\.Module, got int"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_get_one_clear_error(tmp_path: Path, case: str) -> None:
    text, pattern = BAD_FILES[case]
    (tmp_path / "m.py").write_text(text)
    with pytest.raises(ModelFileError, match=pattern):
        mf = load_model_file(tmp_path / "m.py")
        mf.build()


def test_no_such_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError, match=r"nope\.py: no such file"):
        load_model_file(tmp_path / "nope.py")


def test_sample_batch_that_does_not_fit_forward(tmp_path: Path) -> None:
    src = (MODELS / "linrelu.py").read_text().replace("torch.randn(batch_size, 8), ", "torch.randn(batch_size, 9), ")
    (tmp_path / "m.py").write_text(src)
    mf = load_model_file(tmp_path / "m.py")
    with pytest.raises(ModelFileError, match=r"forward\(\) on sample_batch\(2\) raised RuntimeError"):
        check_forward(mf, mf.build())


def test_unknown_split_point(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text((MODELS / "linrelu.py").read_text() + "\nSPLIT_POINTS = ['2', 'nine']\n")
    with pytest.raises(ModelFileError, match=r"split point 'nine' is not a module"):
        _units(tmp_path / "m.py")


def test_split_points_out_of_order(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text((MODELS / "linrelu.py").read_text() + "\nSPLIT_POINTS = ['4', '2']\n")
    with pytest.raises(ModelFileError, match=r"in the order forward\(\) calls them"):
        _units(tmp_path / "m.py")


def test_forward_failing_during_discovery_names_the_file(tmp_path: Path) -> None:
    src = (MODELS / "twostacks.py").read_text().replace(
        "        memory = self.emb(x)", "        assert x.shape[0] > 1, 'needs two samples'\n        memory = self.emb(x)")
    (tmp_path / "m.py").write_text(src)
    with pytest.raises(ModelFileError, match=r"m\.py: forward\(\) on sample_batch\(1\), run to find the order modules "
                                             r"are called in, raised AssertionError: needs two samples"):
        _units(tmp_path / "m.py")


def test_vit_units_are_patch_embedding_blocks_norm() -> None:
    assert _units(EXAMPLES / "vit.py") == [None, "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm"]


@pytest.mark.parametrize("example,container", [("hf_gpt2.py", "transformer.h"), ("hf_llama.py", "model.layers")])
def test_hf_models_units_found_without_split_points(example: str, container: str) -> None:
    pytest.importorskip("transformers")
    points = _units(EXAMPLES / example)
    assert points[1:5] == [f"{container}.{i}" for i in range(4)]
    assert len(points) == 6  # embeddings, 4 blocks, final norm with the LM head


def test_several_containers_each_block_a_unit() -> None:
    """twostacks.py: the blocks of `enc`, of the stages of `stages` (a container of containers) and of `dec` are all
    units, in call order; `bridge`, run between `enc` and `stages`, folds into the last `enc` unit; the LayerNorm list
    inside each block is nested in a container already taken and is not split."""
    mf = load_model_file(MODELS / "twostacks.py")
    units = discover_units(mf, mf.build())
    stages = ["stages.0.0", "stages.0.1", "stages.1.0", "stages.1.1"]
    assert [u.split_point for u in units] == [None, "enc.0", "enc.1", "enc.2", *stages, "dec.0", "dec.1", "head"]
    assert units[3].modules == ("enc.2", "bridge")
    assert units[0].modules == ("emb",) and units[-1].modules == ("head",)


@pytest.mark.parametrize("block", ["basic", "bottleneck"])
def test_resnet_stages_blocks_are_units(tmp_path: Path, block: str) -> None:
    src = (EXAMPLES / "resnet.py").read_text().replace('BLOCK = "basic"', f'BLOCK = "{block}"')
    (tmp_path / "m.py").write_text(src)
    mf = load_model_file(tmp_path / "m.py")
    units = discover_units(mf, mf.build())
    blocks = [f"layer{s}.{b}" for s in range(1, 5) for b in range(2)]
    assert [u.split_point for u in units] == [None, *blocks, "avgpool"]
    assert units[0].modules == ("conv1", "bn1", "relu", "maxpool") and units[-1].modules == ("avgpool", "fc")


def test_hf_bert_units_found_without_split_points() -> None:
    pytest.importorskip("transformers")
    assert _units(EXAMPLES / "hf_bert.py") == [None] + [f"bert.encoder.layer.{i}" for i in range(4)] + ["cls"]


def test_hf_t5_encoder_and_decoder_blocks_are_units() -> None:
    pytest.importorskip("transformers")
    mf = load_model_file(EXAMPLES / "hf_t5.py")
    units = discover_units(mf, mf.build())
    assert [u.split_point for u in units] == [None] + [f"encoder.block.{i}" for i in range(3)] + \
        [f"decoder.block.{i}" for i in range(3)] + ["decoder.final_layer_norm"]
    # The encoder's final norm runs between the stacks: it folds into the last encoder unit.
    assert "encoder.final_layer_norm" in units[3].modules and units[-1].modules[-1] == "lm_head"
