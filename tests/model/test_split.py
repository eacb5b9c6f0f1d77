"""split_model: the pieces run torch.export's generated code, not the fx interpreter."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export.unflatten import InterpreterModule

from autopp.model.contract import load_model_file
from autopp.model.split import piece_names, split_model
from autopp.model.units import discover_units

from ..conftest import MODELS


def test_pieces_run_generated_code_and_match_the_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Sequential(nn.Linear(8, 2)))
    x = torch.randn(3, 4)
    pipe = split_model(model, (x,), ["1"])
    inner = [m for m in pipe.split_gm.modules() if isinstance(m, InterpreterModule)]
    assert inner and not any(m._run_with_interpreter for m in inner)
    torch.testing.assert_close(pipe(x)[0], model(x))


def test_checking_the_pieces_leaves_buffers_and_random_state_alone() -> None:
    """split_model runs the pieces once to check their generated code: BatchNorm statistics and the random state
    must be as `pipeline()` left them, or the runner's stages would start from other values than the reference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5)),
                          nn.Sequential(nn.Linear(8, 2)))
    x = torch.randn(3, 4)
    state = torch.random.get_rng_state()
    pipe = split_model(model, (x,), ["1"])
    assert torch.equal(torch.random.get_rng_state(), state)
    counts = [b for name, b in pipe.split_gm.named_buffers() if name.endswith("num_batches_tracked")]
    assert counts and all(int(b) == 0 for b in counts)


@pytest.mark.parametrize("name", ["dictblocks.py", "siblings.py"])
def test_sibling_blocks_split_into_one_piece_per_unit(name: str) -> None:
    """Blocks found in a ModuleDict (called out of insertion order) or as `block1`..`block4` attributes: cutting
    before each unit gives one piece per unit, holding exactly that unit's parameters, and the same output."""
    mf = load_model_file(MODELS / name)
    model = mf.build()
    units = discover_units(mf, model)
    (x,), _ = mf.sample_batch(2)
    pipe = split_model(model, (x,), [u.split_point for u in units[1:]])
    assert pipe.num_stages == len(units) == 6
    for unit, piece in zip(units, piece_names(pipe)):
        held = {n for n, _ in pipe.split_gm.get_submodule(piece).named_parameters()}
        assert held == {f"{m}.{n}" for m in unit.modules for n, _ in model.get_submodule(m).named_parameters()}
    torch.testing.assert_close(pipe(x)[0], model(x))
