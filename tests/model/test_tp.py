"""autopp.model.tp: plans found (HF, TP_PLAN, a wrapper), resolved and refused in one line, degrees, torch styles,
the local shard (sharded parameters divided by t, the forward still runs) and the per-unit collective counts."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from autopp.errors import ModelFileError, TpPlanError
from autopp.model.contract import ModelFile, check_forward, load_model_file
from autopp.model.fake import run_fake
from autopp.model.meta import build_meta
from autopp.model.tp import (TpPlan, check_degree, find_tp_plan, local_model_file, local_shard, resolve,
                             sequence_modules, torch_styles, tp_degrees)
from autopp.model.tp_collectives import unit_collectives
from autopp.model.units import discover_units

from ..conftest import EXAMPLES

LLAMA_PLAN = {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output",
              **{f"model.layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
              "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
              "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}

MLP_FILE = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))

def build_model():
    return nn.Sequential(Block(), Block())

def sample_batch(b):
    return torch.randn(b, 8), torch.randn(b, 8)

TP_PLAN = {PLAN}
"""


@pytest.fixture(scope="module")
def llama() -> tuple[ModelFile, nn.Module]:
    pytest.importorskip("transformers")
    mf = load_model_file(EXAMPLES / "hf_llama.py")
    return mf, build_meta(mf).model


def _mlp_file(tmp_path: Path, plan: str = "{'*.fc1': 'colwise', '*.fc2': 'rowwise'}") -> ModelFile:
    path = tmp_path / "mlp.py"
    path.write_text(textwrap.dedent(MLP_FILE).replace("{PLAN}", plan))
    return load_model_file(path)


def test_hf_llama_plan_is_found_and_resolved(llama: tuple[ModelFile, nn.Module]) -> None:
    mf, model = llama
    plan = find_tp_plan(mf, model)
    assert plan is not None and plan.patterns == LLAMA_PLAN
    assert plan.source == "LlamaConfig.base_model_tp_plan under 'model.' + LlamaForCausalLM._tp_plan"
    resolved = resolve(plan, model)
    assert len(resolved) == 2 + 4 * 7
    assert resolved["model.layers.3.mlp.down_proj"] == "rowwise" and resolved["lm_head"] == "colwise_gather_output"
    assert list(resolved)[0] == "model.embed_tokens"  # model order


def test_hf_plan_under_a_wrapper_is_prefixed(llama: tuple[ModelFile, nn.Module]) -> None:
    mf, model = llama
    wrapper = nn.Module()
    wrapper.add_module("backbone", model)
    plan = find_tp_plan(mf, wrapper)
    assert plan is not None and set(plan.patterns) == {f"backbone.{k}" for k in LLAMA_PLAN}
    assert "under 'backbone.model.'" in plan.source
    assert "backbone.model.layers.0.self_attn.q_proj" in resolve(plan, wrapper)


def test_tp_plan_in_the_model_file_wins(tmp_path: Path) -> None:
    mf = _mlp_file(tmp_path)
    assert mf.tp_plan == {"*.fc1": "colwise", "*.fc2": "rowwise"}
    model = mf.build()
    plan = find_tp_plan(mf, model)
    assert plan == TpPlan({"*.fc1": "colwise", "*.fc2": "rowwise"}, f"TP_PLAN in {mf.path}")
    assert resolve(plan, model) == {"0.fc1": "colwise", "0.fc2": "rowwise", "1.fc1": "colwise", "1.fc2": "rowwise"}
    assert tp_degrees(model, resolve(plan, model), 8) == [1, 2, 4, 8]


def test_an_empty_tp_plan_means_none_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    mf = _mlp_file(tmp_path, "{}")
    assert find_tp_plan(mf, mf.build()) is None
    with pytest.raises(ModelFileError, match=r"mlp.py: TP_PLAN must be a dict .* got '\*.fc1': 2$"):
        _mlp_file(tmp_path, "{'*.fc1': 2}")
    with pytest.raises(ModelFileError, match=r"got a list$"):
        _mlp_file(tmp_path, "['fc1']")


def test_gpt_has_no_plan() -> None:
    mf = load_model_file(EXAMPLES / "gpt.py")
    assert find_tp_plan(mf, build_meta(mf).model) is None


@pytest.mark.parametrize("patterns,message", [
    ({"*.fc3": "colwise"}, r"pattern '\*.fc3' matches no module of Sequential; names start at the model root "
                           r"\(e.g. '0.fc1'\)"),
    ({"*.fc1": "packed_colwise"}, r"'\*.fc1': style 'packed_colwise' is not supported; use one of \['colwise'"),
    ({"0": "colwise"}, r": 0 \(pattern '0'\) is a Block; style 'colwise' shards only torch.nn.Linear"),
    ({"*.fc1": "embedding_rowwise"}, r"0.fc1 .* is a Linear; style 'embedding_rowwise' shards only "
                                     r"torch.nn.Embedding"),
    ({"*.fc1": "colwise", "0.fc1": "rowwise"}, r"0.fc1 is given two styles, 'colwise' and 'rowwise'"),
    ({"*.fc2": "colwise_loss_parallel"}, r"'colwise_loss_parallel' is the output layer's style \(its logits into the "
                                         r"loss\), given to 2 modules \(0.fc2, 1.fc2\): give it to the output layer "
                                         r"alone, 'colwise_gather_output' to the others$"),
])
def test_bad_plans_fail_in_one_line(tmp_path: Path, patterns: dict[str, str], message: str) -> None:
    mf = _mlp_file(tmp_path)
    with pytest.raises(TpPlanError, match=message) as info:
        resolve(TpPlan(patterns, "TP_PLAN in mlp.py"), mf.build())
    assert "\n" not in str(info.value) and str(info.value).startswith("TP_PLAN in mlp.py: ")


def test_colwise_rep_is_colwise_gather_output(tmp_path: Path) -> None:
    model = _mlp_file(tmp_path).build()
    assert resolve(TpPlan({"1.fc2": "colwise_rep"}, "x"), model) == {"1.fc2": "colwise_gather_output"}


def test_grad_allreduce_style_shards_nothing_counts_its_gradients_and_is_not_run(tmp_path: Path) -> None:
    """HF's replicated_with_grad_allreduce (Qwen3's q_norm/k_norm): any module, nothing narrowed or divided, one
    backward all-reduce of its parameters' gradients per call; the runner refuses it in one line."""
    model = _mlp_file(tmp_path).build()
    plan = TpPlan({"*.fc2": "replicated_with_grad_allreduce"}, "x")
    resolved = resolve(plan, model)
    assert resolved == {"0.fc2": "replicated_with_grad_allreduce", "1.fc2": "replicated_with_grad_allreduce"}
    assert tp_degrees(model, resolved, 3) == [1, 2, 3]  # it divides nothing
    local_shard(model, resolved, 2)
    assert model[0].fc2.weight.shape == (8, 32) and model[0].fc2.bias.shape == (8,)  # nothing narrowed
    counts = unit_collectives(model, resolved, [["0"], ["1"]], lambda: model(torch.randn(3, 8)))
    assert (counts[0].forward_collectives, counts[0].backward_collectives) == (0, 1)
    assert counts[0].backward_allreduce_bytes == (8 * 32 + 8) * 4  # fc2's weight and bias gradients
    with pytest.raises(TpPlanError, match=r"^0.fc2: style 'replicated_with_grad_allreduce' is planned but not run: "
                                          r"autopp's runner does not all-reduce its gradients over the TP ranks; "
                                          r"run a plan with tp 1$"):
        torch_styles(resolved, ["0.fc2"])


def test_hf_plans_leave_patterns_matching_nothing_unused(tmp_path: Path) -> None:
    """transformers applies its plan by module name, so Qwen3-MoE's dense-MLP patterns go unused on layers with
    routed experts; a TP_PLAN the user wrote is still refused (test_bad_plans_fail_in_one_line)."""
    model = _mlp_file(tmp_path).build()
    assert resolve(TpPlan({"*.fc1": "colwise", "*.gate_proj": "colwise"}, "hf", partial=True), model) == \
        {"0.fc1": "colwise", "1.fc1": "colwise"}
    with pytest.raises(TpPlanError, match=r"^hf: none of its 1 patterns matches a module of Sequential$"):
        resolve(TpPlan({"*.gate_proj": "colwise"}, "hf", partial=True), model)


def test_degrees_divide_heads_and_sharded_dims(llama: tuple[ModelFile, nn.Module]) -> None:
    mf, model = llama
    resolved = resolve(find_tp_plan(mf, model), model)  # type: ignore[arg-type]
    assert tp_degrees(model, resolved, 8) == [1, 2]  # 2 kv heads
    assert tp_degrees(model, {}, 3) == [1, 2, 3]
    with pytest.raises(TpPlanError, match=r"degree 4 does not divide config.num_key_value_heads \(2\); use one of "
                                          r"\[2\]"):
        check_degree(model, resolved, 4)


def test_torch_styles_for_the_modules_present(tmp_path: Path) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    resolved = {"a": "colwise", "b": "rowwise", "c": "colwise_gather_output", "e": "embedding_rowwise"}
    styles = torch_styles(resolved, ["a", "b", "c", "e", "z"])
    assert list(styles) == ["a", "b", "c", "e"] and list(torch_styles(resolved, ["b"])) == ["b"]
    assert isinstance(styles["a"], ColwiseParallel) and styles["a"].output_layouts == (Shard(-1),)
    assert isinstance(styles["c"], ColwiseParallel) and styles["c"].output_layouts == (Replicate(),)
    assert isinstance(styles["e"], RowwiseParallel) and styles["e"].input_layouts == (Replicate(),)
    assert isinstance(styles["b"], RowwiseParallel) and styles["b"].input_layouts == (Shard(-1),)


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_local_shard_halves_the_sharded_parameters_and_still_runs(llama: tuple[ModelFile, nn.Module]) -> None:
    mf, _ = llama
    model = build_meta(mf).model
    resolved = resolve(find_tp_plan(mf, model), model)  # type: ignore[arg-type]
    before = {n: _param_bytes(model.get_submodule(n)) for n in resolved}
    norm = _param_bytes(model.model.norm)
    local_shard(model, resolved, 2)
    assert {n: _param_bytes(model.get_submodule(n)) for n in resolved} == {n: b // 2 for n, b in before.items()}
    assert _param_bytes(model.model.norm) == norm
    q = model.model.layers[0].self_attn.q_proj
    assert (q.out_features, q.weight.device.type) == (32, "meta")
    inputs, _ = mf.sample_batch(2)
    assert run_fake(lambda *i: model(*i), *inputs).logits.shape == (2, 32, 2048)  # gathered to the full vocabulary


def test_local_shard_runs_real_and_keeps_tied_weights_tied(tmp_path: Path) -> None:
    emb = nn.Embedding(8, 4)
    head = nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    local_shard(model, {"0": "embedding_rowwise", "1": "colwise_gather_output"}, 2)
    assert model[0].weight is model[1].weight and model[0].weight.shape == (4, 4)
    out = model(torch.tensor([[1, 7]]))
    assert out.shape == (1, 2, 8)
    torch.testing.assert_close(out[0, 1], out[0, 1, :4].repeat(2))
    torch.testing.assert_close(out[0, 1, :4], model[0].weight[3] @ model[1].weight.T)  # id 7 -> local row 3


def test_local_model_file_builds_the_shard(tmp_path: Path) -> None:
    mf = _mlp_file(tmp_path)
    model = mf.build()
    local = local_model_file(mf, resolve(find_tp_plan(mf, model), model), 4)  # type: ignore[arg-type]
    built = local.build()
    assert (built[0].fc1.weight.shape, built[0].fc2.weight.shape, built[0].fc2.bias.shape) == ((8, 8), (8, 8), (8,))
    inputs, target = local.sample_batch(3)
    assert built(*inputs).shape == target.shape


def test_a_shard_that_breaks_the_models_forward_is_named_with_what_to_do(tmp_path: Path) -> None:
    """Tester: a model reshaping q to its config's head count failed under `autopp profile --tp 2` with a bare
    "shape '[2, 8, 4, 4]' is invalid" that did not say it was TP rank 0's shard that ran, nor what to change."""
    from ..models import plainlm
    good = Path(plainlm.__file__).read_text()
    bad = good.replace("reshape(b, n, -1, HEAD_DIM)", "reshape(b, n, WIDTH // HEAD_DIM, HEAD_DIM)")
    assert bad != good
    for text, fails in ((good, False), (bad, True)):
        (tmp_path / "lm.py").write_text(text)
        mf = load_model_file(tmp_path / "lm.py")
        local = local_model_file(mf, resolve(find_tp_plan(mf, mf.build()), mf.build()), 2)  # type: ignore[arg-type]
        if not fails:
            check_forward(local, local.build())
            continue
        with pytest.raises(ModelFileError, match=r"lm\.py \(TP rank 0's shard at tp 2, whose colwise outputs hold 1/2 "
                           r"of their features: take head counts from the tensor, e\.g\. reshape\(b, s, -1, "
                           r"head_dim\)\): forward\(\) on sample_batch\(2\) raised RuntimeError: shape"):
            check_forward(local, local.build())


def test_sequence_modules_are_the_norms_beside_the_sharded_blocks(llama: tuple[ModelFile, nn.Module]) -> None:
    """Llama: each block's input_layernorm and post_attention_layernorm and the final norm (torchtitan's SP plan);
    a norm beside colwise / rowwise projections (a per-head q_norm) is not sequence-wise."""
    mf, model = llama
    plan = find_tp_plan(mf, model)
    assert plan is not None
    names = sequence_modules(plan, model, resolve(plan, model))
    assert names == [f"model.layers.{i}.{n}" for i in range(4) for n in ("input_layernorm",
                                                                         "post_attention_layernorm")] + ["model.norm"]
    model.get_submodule("model.layers.0.self_attn").add_module("q_norm", nn.RMSNorm(16))
    try:
        assert sequence_modules(plan, model, resolve(plan, model)) == names
    finally:
        del model.get_submodule("model.layers.0.self_attn")._modules["q_norm"]


def test_a_tp_plan_names_its_sequence_parallel_modules(tmp_path: Path) -> None:
    mf = _mlp_file(tmp_path, "{'*.fc1': 'colwise', '*.fc2': 'rowwise', '1': 'sequence_parallel'}")
    model = mf.build()
    plan = find_tp_plan(mf, model)
    assert plan is not None
    resolved = resolve(plan, model)
    assert "1" not in resolved and len(resolved) == 4  # left to sequence_modules
    assert sequence_modules(plan, model, resolved) == ["1"]
    assert sequence_modules(TpPlan({"*.fc1": "colwise"}, "x"), model, resolved) == []  # no norm: none derived
    with pytest.raises(TpPlanError, match=r"^x: sequence_parallel pattern '\*.norm' matches no module of "
                                          r"Sequential$"):
        sequence_modules(TpPlan({"*.norm": "sequence_parallel"}, "x"), model, resolved)
