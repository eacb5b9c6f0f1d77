"""Unit discovery: split points given or found (Sequential children, block groups), fingerprints, and one clear
error per bad split point."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autopp.errors import ModelFileError
from autopp.model.contract import load_model_file
from autopp.model.units import discover_units, fingerprint

from ..conftest import EXAMPLES, MODELS, ROOT


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


@pytest.mark.integration  # every Hugging Face model (importing transformers) is in the integration tier
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


@pytest.mark.integration
def test_hf_bert_units_found_without_split_points() -> None:
    pytest.importorskip("transformers")
    assert _units(EXAMPLES / "hf_bert.py") == [None] + [f"bert.encoder.layer.{i}" for i in range(4)] + ["cls"]


@pytest.mark.integration
def test_hf_t5_encoder_and_decoder_blocks_are_units() -> None:
    pytest.importorskip("transformers")
    mf = load_model_file(EXAMPLES / "hf_t5.py")
    units = discover_units(mf, mf.build())
    assert [u.split_point for u in units] == [None] + [f"encoder.block.{i}" for i in range(3)] + \
        [f"decoder.block.{i}" for i in range(3)] + ["decoder.final_layer_norm"]
    # The encoder's final norm runs between the stacks: it folds into the last encoder unit.
    assert "encoder.final_layer_norm" in units[3].modules and units[-1].modules[-1] == "lm_head"


#: The units of every example and test model as the container rule alone found them, recorded before sibling
#: groups (ModuleDict blocks, `block1`, `block2` attributes) were discovered too: [split_point, modules] per unit.
UNITS_BEFORE_SIBLING_GROUPS = json.loads((MODELS / "units.json").read_text())


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.integration) if "/hf_" in p else p
                                  for p in sorted(UNITS_BEFORE_SIBLING_GROUPS)])
def test_units_of_every_example_and_test_model_are_kept(path: str) -> None:
    if "/hf_" in path:
        pytest.importorskip("transformers")
    mf = load_model_file(ROOT / path)
    units = discover_units(mf, mf.build())
    assert [[u.split_point, list(u.modules)] for u in units] == UNITS_BEFORE_SIBLING_GROUPS[path]


def test_moduledict_blocks_are_units_in_call_order() -> None:
    """dictblocks.py calls its ModuleDict's blocks b2, b0, b3, b1; its two heads (a ModuleDict too) both read the
    last block's output, so they are not a chain and end up together in the last unit."""
    mf = load_model_file(MODELS / "dictblocks.py")
    units = discover_units(mf, mf.build())
    assert [u.split_point for u in units] == [None, "blocks.b2", "blocks.b0", "blocks.b3", "blocks.b1", "heads.mean"]
    assert units[0].modules == ("stem",) and units[-1].modules == ("heads.mean", "heads.scale")


def test_sibling_attribute_blocks_are_units() -> None:
    """siblings.py: `block1`..`block4` are units; the parallel heads are not; the Linear pairs inside each block
    (`fc1`, `fc2`: single torch.nn layers) are never blocks."""
    mf = load_model_file(MODELS / "siblings.py")
    units = discover_units(mf, mf.build())
    assert [u.split_point for u in units] == [None, "block1", "block2", "block3", "block4", "head_mean"]
    assert units[-1].modules == ("head_mean", "head_scale")


_HEADER = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, skip=None):
        return x + torch.tanh(self.lin(x if skip is None else x + skip))


def sample_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 8)


def build_model():
    return Model()
"""


def _inline_units(tmp_path: Path, model: str) -> list[str | None]:
    (tmp_path / "m.py").write_text(_HEADER + model)
    return _units(tmp_path / "m.py")


def test_parallel_heads_in_a_list_are_not_blocks(tmp_path: Path) -> None:
    """Two heads reading one trunk are not a chain: no unit boundary between them (the container rule alone cut
    before each head)."""
    assert _inline_units(tmp_path, """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.heads = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        h = self.trunk(x)
        return self.heads[0](h) * self.heads[1](h)
""") == [None]


def test_a_block_called_twice_starts_no_unit(tmp_path: Path) -> None:
    """Shared weights: torch's pipeline() would copy blocks.0 into a second stage, where its gradient would never
    reach the original. A group with a member called more than once is not a group of blocks."""
    assert _inline_units(tmp_path, """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        for block in [*self.blocks, self.blocks[0]]:
            x = block(x)
        return x
""") == [None]


def test_sibling_stages_made_only_of_blocks_give_way_to_their_blocks(tmp_path: Path) -> None:
    """`stage1`, `stage2` hold only `first`/`second` blocks (called with keyword arguments): the blocks are the
    units, as for a container of containers."""
    assert _inline_units(tmp_path, """
class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = Block()
        self.second = Block()

    def forward(self, x):
        return self.second(x=self.first(x=x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.stage1 = Stage()
        self.stage2 = Stage()

    def forward(self, x):
        return self.stage2(self.stage1(self.stem(x)))
""") == [None, "stage1.first", "stage1.second", "stage2.first", "stage2.second"]


def test_containers_and_sibling_groups_together(tmp_path: Path) -> None:
    """A U-Net-like model: `down1`, `down2` and `up1`, `up2` are sibling groups of one class each (the ups also
    read the downs' outputs), `mid` is a ModuleList of blocks; all are units, in call order, the head after them."""
    assert _inline_units(tmp_path, """
class Up(Block):
    pass


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.down1, self.down2 = Block(), Block()
        self.mid = nn.ModuleList(Block() for _ in range(3))
        self.up2, self.up1 = Up(), Up()
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        s1 = self.down1(self.stem(x))
        h = s2 = self.down2(s1)
        for block in self.mid:
            h = block(h)
        return self.head(self.up1(self.up2(h, s2), s1))
""") == [None, "down1", "down2", "mid.0", "mid.1", "mid.2", "up2", "up1", "head"]


_SHARED_PROJECTION = """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = self.proj(block(x))
        return self.head(x)
"""


def test_no_unit_starts_where_a_cut_would_split_a_modules_calls(tmp_path: Path) -> None:
    """`proj` runs after every block: a cut before blocks.1 or blocks.2 would copy its weights onto two stages,
    where torch's pipeline() trains them apart, so no unit starts there."""
    assert _inline_units(tmp_path, _SHARED_PROJECTION) == [None, "blocks.0", "head"]


def test_split_point_that_splits_a_modules_calls_is_refused(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(_HEADER + _SHARED_PROJECTION + "\nSPLIT_POINTS = ['blocks.1']\n")
    with pytest.raises(ModelFileError, match=r"m\.py: split point 'blocks\.1' cuts between two calls of 'proj', whose "
                                             r"parameters would then be copied onto two stages"):
        _units(tmp_path / "m.py")


def test_parallel_members_of_a_chain_of_one_class_stay_in_one_unit(tmp_path: Path) -> None:
    """Blocks and two heads, all of one class and siblings: block1..block3 and head_a are a chain (head_a reads
    block3); head_b reads block3 too, not head_a, so it starts no chain of its own and only follows as what runs
    after the last block."""
    assert _inline_units(tmp_path, """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.block1, self.block2, self.block3 = Block(), Block(), Block()
        self.head_a, self.head_b = Block(), Block()

    def forward(self, x):
        h = self.block3(self.block2(self.block1(self.stem(x))))
        return self.head_a(h) * self.head_b(h)
""") == [None, "block1", "block2", "block3", "head_a", "head_b"]


def test_discovery_leaves_buffers_alone(tmp_path: Path) -> None:
    """Discovery runs forward in training mode: buffers that forward updates (as BatchNorm's statistics) must be as
    before, so a model profiled or run after discovery starts from the state it was built with."""
    (tmp_path / "m.py").write_text(_HEADER + """
class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        self.calls += 1
        for block in self.blocks:
            x = block(x)
        return self.drop(x)
""")
    mf = load_model_file(tmp_path / "m.py")
    model = mf.build()
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    assert [u.split_point for u in discover_units(mf, model)] == [None, "blocks.1", "drop"]
    assert all(torch.equal(b, buffers[name]) for name, b in model.named_buffers())


