"""The model-file contract: loading, the checks of build_model / sample_batch / loss_fn, one forward and backward
checked before anything is measured, and one clear error per bad file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autopp.errors import ModelFileError
from autopp.model.contract import check_forward, default_loss, load_model_file

from ..conftest import MODELS


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


def test_directory_is_not_reported_as_missing(tmp_path: Path) -> None:
    # issue 13.7: a directory given as the model file said "no such file"
    with pytest.raises(ModelFileError, match=r"is a directory; give the model's Python file"):
        load_model_file(tmp_path)


def test_non_scalar_loss_names_its_shape(tmp_path: Path) -> None:
    # issue 13.7: "got Tensor" without the shape
    src = (MODELS / "linrelu.py").read_text() + "\n\ndef loss_fn(output, target):\n    return (output - target) ** 2\n"
    (tmp_path / "m.py").write_text(src)
    mf = load_model_file(tmp_path / "m.py")
    with pytest.raises(ModelFileError, match=r"m\.py: loss_fn must return a scalar Tensor .*got a Tensor of shape \(2, "):
        check_forward(mf, mf.build())


CUSTOM_OP_WITHOUT_GRADIENT = '''

@torch.library.custom_op("autopp_test_modelfile::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x):
    return torch.empty_like(x)


class Double(nn.Module):
    def forward(self, x):
        return double(x)


def build_model():
    return nn.Sequential(nn.Linear(8, 8), Double(), nn.Linear(8, 4))
'''


def test_backward_that_raises_is_one_clear_error(tmp_path: Path) -> None:
    # issue 13.5: a custom op without register_autograd gave a 40-line traceback after profiling had begun
    (tmp_path / "m.py").write_text((MODELS / "linrelu.py").read_text() + CUSTOM_OP_WITHOUT_GRADIENT)
    mf = load_model_file(tmp_path / "m.py")
    model = mf.build()
    with pytest.raises(ModelFileError, match=r"m\.py: backward of the loss on sample_batch\(2\) raised RuntimeError: "
                                             r".*register_autograd"):
        check_forward(mf, model)
    assert all(p.grad is None for p in model.parameters())


def test_the_custom_op_hint_is_given_only_when_an_operation_has_no_gradient(tmp_path: Path) -> None:
    # Review of issue 13.5: every backward failure got "a torch.library.custom_op needs register_autograd", an
    # in-place modification too.
    inplace = """

class SigmoidInPlace(nn.Module):
    def forward(self, x):
        y = x.sigmoid()
        y.add_(1)
        return y


def build_model():
    return nn.Sequential(nn.Linear(8, 8), SigmoidInPlace(), nn.Linear(8, 4))
"""
    (tmp_path / "m.py").write_text((MODELS / "linrelu.py").read_text() + inplace)
    mf = load_model_file(tmp_path / "m.py")
    with pytest.raises(ModelFileError, match=r"raised RuntimeError: one of the variables needed for gradient "
                                             r"computation has been modified by an inplace operation") as info:
        check_forward(mf, mf.build())
    assert "needs a gradient" not in str(info.value)  # (the path holds the test name, "custom_op" included)


def test_default_loss_takes_the_logits_of_an_hf_output_structure() -> None:
    from dataclasses import dataclass


    @dataclass
    class Output:  # the shape of transformers' ModelOutput: the loss reads `.logits`
        logits: torch.Tensor

    torch.manual_seed(0)
    logits, target = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 5), target.reshape(-1))
    torch.testing.assert_close(default_loss(Output(logits), target), expected)
    torch.testing.assert_close(default_loss(logits, target), expected)


def test_batch_norms_names_every_batch_norm_module_and_none_elsewhere() -> None:
    """What profiles record in `extra.batch_norm` (issue 26 item 11): the BatchNorm CNN's norms, none of GroupNorm's."""
    from autopp.model.contract import batch_norms
    bn = batch_norms(load_model_file(MODELS / "bncnn.py").build(0))
    assert bn[:3] == ["stem.1", "blocks.0.bn1", "blocks.0.bn2"]
    assert batch_norms(load_model_file(MODELS / "gncnn.py").build(0)) == []
