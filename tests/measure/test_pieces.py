"""Grouping pieces into materialization windows, and the structure key that decides which units share a
measurement (the profiler's use of both: tests/measure/test_profiler.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopp.measure.pieces import piece_key, windows


def test_windows_hold_consecutive_pieces_within_the_limit() -> None:
    assert windows([3, 3, 3, 9, 1], 6) == [[0, 1], [2], [3], [4]]  # a piece above the limit is alone
    assert windows([3, 3, 3], 0) == [[0], [1], [2]]  # limit 0: one piece at a time
    assert windows([1, 2, 3], 100) == [[0, 1, 2]]


def test_piece_key_sees_shapes_constants_and_module_types() -> None:
    def traced(scale: float, width: int = 4) -> nn.Module:
        class Scaled(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(width, width)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.lin(x) * scale
        return torch.fx.symbolic_trace(Scaled())
    x = (torch.ones(2, 4),)
    linear, conv = {"lin": nn.Linear(4, 4)}, {"lin": nn.Conv1d(4, 4, 1)}  # the original modules, by name
    key = piece_key(traced(2.0), x, linear, (False,))
    assert piece_key(traced(2.0), x, linear, (False,)) == key  # another instance, same structure
    assert piece_key(traced(3.0), x, linear, (False,)) != key  # another constant
    assert piece_key(traced(2.0), (torch.ones(3, 4),), linear, (False,)) != key  # another input shape
    assert piece_key(traced(2.0), x, conv, (False,)) != key  # another original module type
    assert piece_key(traced(2.0), x, linear, (True,)) != key  # the last piece (it includes the loss)
    assert piece_key(traced(2.0, 8), (torch.ones(2, 8),), linear, (False,)) != \
        piece_key(traced(2.0), (torch.ones(2, 8),), linear, (False,))  # another parameter shape


def test_optimizer_step_is_timed_on_a_bounded_slice_and_scaled_by_numel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fake optimizer whose step takes 1 ns per element on a fake clock: parameters within the slice are stepped
    themselves (and restored); more elements than the slice are stepped on a slice of `slice_numel` elements only,
    the time scaled to their whole count, so the optimizer state never exceeds the slice."""
    from autopp.measure import pieces
    from autopp.measure.options import MeasureOptions, ProfileOptions
    from autopp.measure.settings import Settings
    now = [0.0]
    stepped: list[int] = []

    class Elementwise:
        def __init__(self, params: list[nn.Parameter]) -> None:
            self.params = params

        def step(self) -> None:
            n = sum(p.numel() for p in self.params)
            stepped.append(n)
            now[0] += 1e-9 * n
            for p in self.params:
                p.data.add_(1.0)

        def zero_grad(self, set_to_none: bool = True) -> None:
            for p in self.params:
                p.grad = None
    monkeypatch.setattr(pieces, "make_optimizer", lambda _name, params: Elementwise(params))
    settings = Settings(ProfileOptions(optimizer="adamw"), MeasureOptions(warmup=1, repeats=3, clock=lambda: now[0]))
    small = [nn.Parameter(torch.zeros(30, 10)), nn.Parameter(torch.zeros(50))]
    assert pieces.optimizer_step_s(small, settings, slice_numel=400) == pytest.approx(350e-9)
    assert stepped == [350] * 4 and all(bool((p == 0).all()) for p in small)  # restored
    stepped.clear()
    large = [nn.Parameter(torch.ones(1000, 10)), nn.Parameter(torch.ones(4000))]
    assert pieces.optimizer_step_s(large, settings, slice_numel=400) == pytest.approx(14000e-9)
    assert stepped == [400] * 4 and all(bool((p == 1).all()) for p in large)  # never stepped themselves


def test_a_failing_measurement_frees_what_it_materialized(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure_pieces called from the API: a measurement that raises leaves nothing materialized."""
    from autopp.measure import pieces
    from autopp.measure.options import MeasureOptions, ProfileOptions
    from autopp.measure.settings import Settings
    from autopp.model.contract import load_model_file
    from autopp.model.meta import build_meta
    from autopp.model.units import discover_units
    from ..conftest import MODELS
    mf = load_model_file(MODELS / "linrelu.py")
    meta = build_meta(mf)
    units = discover_units(mf, meta.model)
    settings = Settings(ProfileOptions(), MeasureOptions(warmup=0, repeats=1))

    def fail(*_args: object) -> None:
        assert meta.materialized_bytes > 0
        raise RuntimeError("measurement failed")
    monkeypatch.setattr(pieces, "_time_window", fail)
    with pytest.raises(RuntimeError, match="measurement failed"):
        pieces.measure_pieces(mf, meta, units, 1, settings, limit_bytes=0)
    assert meta.materialized_bytes == 0
