"""Meta-device models (autopp.model.meta): built without their large weights, checked, split and walked on meta,
materialized a piece at a time with the modules' own initialisation."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from autopp.model.contract import ModelFile, check_forward, default_loss, load_model_file
from autopp.model.meta import FALLBACK_STD, build_meta, meta_pieces, retarget
from autopp.model.split import walk_split_graph
from autopp.model.units import discover_units

from ..conftest import EXAMPLES, MODELS

BIG = 600  # a BIG x BIG float32 weight is 1.4 MB, above SMALL_BYTES (1 MiB)


class Table(nn.Module):
    """A module with no initialisation of its own, a buffer computed in __init__, and a large weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(BIG, BIG))
        self.register_buffer("steps", torch.arange(BIG, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.steps


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(BIG, BIG)
        self.small = nn.Linear(BIG, 4)
        self.table = Table()
        self.norm = nn.LayerNorm(BIG)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(self.norm(self.table(self.big(x))))


def _model_file(build: Any = Net, points: tuple[str, ...] | None = ("table", "norm")) -> ModelFile:
    return ModelFile(Path("net.py"), build, lambda b: (torch.randn(b, BIG), torch.randn(b, 4)), default_loss, points)


def test_large_parameters_are_never_built_and_small_ones_keep_their_values() -> None:
    meta = build_meta(_model_file())
    assert all(t.device.type == "meta" for t in list(meta.model.parameters()) + list(meta.model.buffers()))
    assert "big.weight" not in meta.real and "table.weight" not in meta.real  # 1.4 MB each: never built
    assert set(meta.real) >= {"big.bias", "small.weight", "small.bias", "table.steps", "norm.weight", "norm.bias"}
    assert torch.equal(meta.real["table.steps"], torch.arange(BIG, dtype=torch.float32))


def test_small_parameters_are_built_for_real_only_up_to_a_byte_budget() -> None:
    """A model of many small layers is not built whole: once the real parameters reach `real_bytes`, the small
    ones after them go to meta too (and take their module's initialisation when materialized)."""
    mf = ModelFile(Path("many.py"), lambda: nn.Sequential(*[nn.Linear(64, 64) for _ in range(10)]),
                   lambda b: (torch.randn(b, 64), torch.randn(b, 64)), default_loss, None)
    layer = (64 * 64 + 64) * 4
    meta = build_meta(mf, real_bytes=3 * layer)
    assert sorted(meta.real) == [f"{i}.{p}" for i in range(3) for p in ("bias", "weight")]
    loaded = meta.materialize(["9.weight"], "cpu")["9.weight"]
    assert not bool(torch.isnan(loaded).any()) and float(loaded.abs().max()) <= 1 / 8  # Linear's own init bound
    assert len(build_meta(mf).real) == 20  # the default budget holds them all


def test_materialize_runs_the_modules_own_initialisation_never_uninitialised_memory(
        caplog: pytest.LogCaptureFixture) -> None:
    meta = build_meta(_model_file())
    with caplog.at_level(logging.WARNING, logger="autopp.model.meta"):
        values = meta.materialize(["big.weight", "table.weight", "table.steps", "norm.weight"], "cpu")
    assert all(not torch.isnan(t).any() for t in values.values())
    bound = 1 / BIG ** 0.5  # nn.Linear.reset_parameters: kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(fan_in), ...)
    assert 0 < values["big.weight"].abs().max() <= bound and values["big.weight"].std() > bound / 3
    assert torch.equal(values["table.steps"], torch.arange(BIG, dtype=torch.float32))  # kept from __init__
    assert torch.equal(values["norm.weight"], torch.ones(BIG))
    # Table has no initialisation: the documented fallback, logged, not the NaN it was filled with.
    assert abs(float(values["table.weight"].std()) - FALLBACK_STD) < FALLBACK_STD / 10
    assert "Table.weight: no initialisation of its own" in caplog.text
    assert meta.model.big.weight.device.type == "meta"  # the meta model itself stays on meta


def test_tied_weights_stay_tied_on_meta_and_when_loaded() -> None:
    def tied() -> nn.Module:
        net = Net()
        net.table.weight = net.big.weight
        return net
    meta = build_meta(_model_file(tied))
    assert meta.model.table.weight is meta.model.big.weight
    meta.load(meta.model, "cpu")
    assert meta.model.table.weight is meta.model.big.weight and meta.model.big.weight.device.type == "cpu"
    assert meta.materialized_bytes == sum(p.numel() * 4 for p in meta.model.parameters()) + BIG * 4  # + steps
    meta.unload(meta.model)
    assert meta.model.table.weight is meta.model.big.weight and meta.model.big.weight.device.type == "meta"
    assert meta.materialized_bytes == 0


def test_a_model_built_on_meta_is_accepted() -> None:
    def on_meta() -> nn.Module:
        with torch.device("meta"):
            return Net()
    meta = build_meta(_model_file(on_meta))
    assert meta.real == {}
    values = meta.materialize(["norm.weight", "table.steps"], "cpu")
    assert torch.equal(values["norm.weight"], torch.ones(BIG))
    assert torch.equal(values["table.steps"], torch.zeros(BIG))  # no value to keep: the buffer fallback


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_check_forward_and_units_on_meta_as_on_the_real_model() -> None:
    for path in (MODELS / "masked.py", EXAMPLES / "gpt.py"):
        mf = load_model_file(path)
        meta = build_meta(mf, small_bytes=0)
        check_forward(mf, meta.model)
        assert discover_units(mf, meta.model) == discover_units(mf, mf.build())


def test_check_forward_on_meta_still_names_the_model_files_mistake() -> None:
    mf = _model_file()
    broken = ModelFile(mf.path, mf.build_model, lambda b: (torch.randn(b, BIG + 1), torch.randn(b, 4)),
                       default_loss, None)
    with pytest.raises(Exception, match=r"net.py: forward\(\) on sample_batch\(2\) raised"):
        check_forward(broken, build_meta(broken).model)


def test_pieces_split_on_meta_load_one_at_a_time_and_run_on_the_device() -> None:
    """masked.py makes its mask with `device=x.device`, which torch.export records as the constant meta: retarget
    moves it, so a materialized piece runs on real inputs."""
    mf = load_model_file(MODELS / "masked.py")
    meta = build_meta(mf, small_bytes=0)
    units = discover_units(mf, meta.model)
    pipe, _, meta_inputs, _ = meta_pieces(mf, meta, [u.split_point for u in units[1:]], 2)
    assert all(t.device.type == "meta" for t in pipe.split_gm.parameters())
    assert retarget(pipe, "cpu") >= 1
    pieces = [pipe.split_gm.get_submodule(n.target) for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    names = [n for n, _ in pieces[1].named_parameters()]
    assert names == ["blocks.0.lin.weight", "blocks.0.lin.bias"]  # the model's qualified names
    assert meta_inputs[0].device.type == "meta"
    most: list[int] = []

    def one_at_a_time(node: Any, args: tuple[Any, ...]) -> Any:
        piece = pipe.split_gm.get_submodule(node.target)
        meta.load(piece, "cpu")
        most.append(meta.materialized_bytes)
        out = piece(*args)
        meta.unload(piece)
        return out

    env: dict[Any, Any] = {}
    inputs, _ = mf.sample_batch(2)
    for _ in walk_split_graph(pipe.split_gm, inputs, env, one_at_a_time):
        pass
    (out,) = [v for k, v in env.items() if k.op == "call_module"][-1:]
    assert out.shape == (2, 6, 2) and torch.isfinite(out).all()
    assert most == [(4 * 8 + 8) * 4] + [(8 * 8 + 8) * 4] * 3 + [(8 * 2 + 2) * 4]  # each piece's own, alone
    assert meta.materialized_bytes == 0 and all(p.device.type == "meta" for p in pipe.split_gm.parameters())


@pytest.mark.integration
def test_hf_llama_on_meta_keeps_its_rotary_tables_and_discovers_its_blocks() -> None:
    pytest.importorskip("transformers")
    mf = load_model_file(EXAMPLES / "hf_llama.py")
    meta = build_meta(mf, small_bytes=0)
    check_forward(mf, meta.model)
    real = mf.build()
    assert discover_units(mf, meta.model) == discover_units(mf, real)
    values = meta.materialize(["model.rotary_emb.inv_freq", "model.layers.0.mlp.up_proj.weight"], "cpu")
    assert torch.equal(values["model.rotary_emb.inv_freq"], real.model.rotary_emb.inv_freq)
    std = real.config.initializer_range  # transformers' _init_weights: normal(0, initializer_range)
    assert abs(float(values["model.layers.0.mlp.up_proj.weight"].std()) - std) < std / 10


class Routed(nn.Module):
    """Counts tokens per expert as transformers' MoE experts do (integrations/moe.py): `histc` of float ids on the
    CPU, of int32 ids elsewhere, so a trace on meta records the int32 branch, which the CPU kernel refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.router(x).argmax(-1).flatten()
        ids = ids.float() if x.device.type == "cpu" else ids.int()
        counts = torch.histc(ids, bins=4, min=0, max=3)
        return self.out(x) * counts.sum()


def test_retarget_to_cpu_casts_an_integer_histc_input_traced_on_meta() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), Routed())
    mf = ModelFile(Path("routed.py"), lambda: model, lambda b: ((torch.randn(b, 3, 8),), torch.randn(b, 3, 8)),
                   default_loss, None)
    meta = build_meta(mf)
    pipe, _, _, _ = meta_pieces(mf, meta, ["1"], 2)
    routed = pipe.get_stage_module(1)
    histc = [n for n in pipe.split_gm.modules() if isinstance(getattr(n, "graph", None), torch.fx.Graph)
             for n in n.graph.nodes if n.target is torch.ops.aten.histc.default]
    assert [n.args[0].meta["val"].dtype for n in histc] == [torch.int32]  # the meta branch, traced
    assert retarget(pipe, "cpu") >= 1
    assert [n.args[0].meta["val"].dtype for n in histc] == [torch.float32]
    meta.load(routed, "cpu")
    out = routed(torch.randn(2, 3, 8))  # before: RuntimeError: "histogram_cpu" not implemented for 'Int'
    assert out.shape == (2, 3, 8) and bool(torch.isfinite(out).all())


class Stacked(nn.Module):
    """A stacked weight of 8 MiB made with torch.empty, as transformers' MoE experts make theirs, and a small one;
    records where each was made before register_parameter sees it."""

    made_on: dict[str, str] = {}

    def __init__(self) -> None:
        super().__init__()
        big, small = torch.empty(8, 512, 512), torch.zeros(4, 4)
        Stacked.made_on.update(big=big.device.type, small=small.device.type)
        self.big, self.small = nn.Parameter(big), nn.Parameter(small)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_a_tensor_larger_than_the_real_budget_is_made_on_meta() -> None:
    # DeepSeek-V3's experts: torch.empty(256, 4096, 7168) allocated 30 GB before register_parameter moved it to meta
    # ("DefaultCPUAllocator: can't allocate memory: you tried to allocate 30064771072 bytes").
    mf = ModelFile(Path("stacked.py"), Stacked, lambda b: ((torch.randn(b, 4),), torch.randn(b, 4)), default_loss,
                   None)
    meta = build_meta(mf, real_bytes=1 << 20)
    assert Stacked.made_on == {"big": "meta", "small": "cpu"}
    assert meta.model.big.device.type == "meta" and torch.equal(meta.real["small"], torch.zeros(4, 4))
    assert torch.empty(8, 512, 512).device.type == "cpu"  # nothing left active
