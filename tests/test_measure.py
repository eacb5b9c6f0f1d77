"""The profiler: exact on layers that sleep known times, and on layers whose saved tensors are known."""

from __future__ import annotations

import importlib.util

import pytest

from autopp.measure import profile_model

from .conftest import MODELS


def _module(name: str):  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(f"t_{name}", MODELS / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sleep_layers_give_known_times() -> None:
    sleepy = _module("sleepy")
    profile = profile_model(MODELS / "sleepy.py", microbatch_sizes=(2,), warmup=1, repeats=3)
    table = profile.units.sort_values("unit")
    for measured, expected in zip(table.forward_s, sleepy.FORWARD_S):
        assert expected <= measured < expected + 0.004
    for measured, expected in zip(table.backward_s, sleepy.BACKWARD_S):
        assert expected <= measured < expected + 0.004


def test_linear_relu_saved_bytes_and_sizes() -> None:
    profile = profile_model(MODELS / "linrelu.py", microbatch_sizes=(1, 3), warmup=0, repeats=1)
    rows = profile.units.set_index(["unit", "microbatch_size"])
    f32 = 4
    for b in (1, 3):
        # Linear saves its input; ReLU saves its output (the next Linear's input shares that storage).
        assert rows.loc[(0, b)].activation_bytes == b * 8 * f32
        assert rows.loc[(1, b)].activation_bytes == b * 32 * f32
        assert rows.loc[(0, b)].output_bytes == b * 32 * f32
        assert rows.loc[(4, b)].output_bytes == 0  # the last unit feeds the loss, not another stage
    assert rows.loc[(0, 1)].param_bytes == (8 * 32 + 32) * f32
    assert rows.loc[(1, 1)].param_bytes == 0
    cuts = profile.cut_bytes(3)
    assert cuts == [3 * 32 * f32, 3 * 32 * f32, 3 * 16 * f32, 3 * 16 * f32]


def test_optimizer_state_counted() -> None:
    profile = profile_model(MODELS / "linrelu.py", microbatch_sizes=(1,), optimizer="adam", warmup=0, repeats=1)
    assert (profile.units.optimizer_bytes == 2 * profile.units.param_bytes).all()


def test_graph_edges_carry_boundary_bytes(gpt_profile) -> None:  # type: ignore[no-untyped-def]
    g = gpt_profile.graph(2)
    assert sorted(g.successors(0)) == [1]
    assert g.edges[3, 4]["bytes"] == 2 * 64 * 128 * 4  # batch x context x width float32
    assert g.nodes[7]["name"] == "ln_f"


def test_bad_microbatch_sizes() -> None:
    with pytest.raises(ValueError, match="positive"):
        profile_model(MODELS / "linrelu.py", microbatch_sizes=(0,))
