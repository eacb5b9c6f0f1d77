"""The catalogue of bad inputs (issue 13): each is exit code 2, one error line on stderr naming the file or flag at
fault, and nothing written.

Every case runs `autopp.cli.main` in-process in a fresh directory (also the working directory, so default outputs
such as `profiles/MODEL/` land there too) and compares the directory before and after: nothing may appear or
change. Progress lines (`profiling: ...`, printed one per line when stderr is not a terminal) are not errors and are
left out of the count. A valid profile (the shipped profiles/mlp) and a valid plan made from it are prepared once.
Covered: model files, profiles, plans, cluster and links files, flags, output paths of profile, profile-links, plan,
run and show. Not here (other points' catalogues): NaN verdicts, rank faults, run-time output.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from autopp.cli import main

from .conftest import ONE_PIPELINE, ROOT

SHIPPED = ROOT / "profiles" / "mlp"
PROGRESS = ("profiling: ", "running: ", "planning: ")

GOOD_MODEL = '''
import torch
from torch import nn

def build_model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))

def sample_batch(b):
    return torch.randn(b, 4), torch.randn(b, 4)
'''


@dataclass(frozen=True)
class Env:
    """Paths a case may use: `tmp` (fresh, the working directory), the shared valid `prof` and `plan`."""

    tmp: Path
    prof: Path
    plan: Path

    @property
    def model(self) -> Path:
        return self.tmp / "m.py"

    @property
    def bad_plan(self) -> Path:
        return self.tmp / "p.json"

    @property
    def bad_prof(self) -> Path:
        return self.tmp / "prof"

    @property
    def cluster(self) -> Path:
        return self.tmp / "c.json"

    @property
    def links(self) -> Path:
        return self.tmp / "l.json"


@dataclass(frozen=True)
class Case:
    id: str
    argv: Callable[[Env], list[str]]
    names: Callable[[Env], str]
    """What the error line must contain: the offending file's path, or the flag."""
    setup: Callable[[Env], None] = lambda env: None


CASES: list[Case] = []


def _plan_args(env: Env, *extra: str) -> list[str]:
    return ["plan", "--profile", str(env.prof), "--devices", "2", "--memory", "1GiB", *extra,
            "-o", str(env.tmp / "out.json")]


def _plan_hf(env: Env, name: str) -> list[str]:
    return ["plan", "--hf-config", str(env.tmp / name), "--devices", "2", "--memory", "1GiB"]


def _tiny_mixtral(env: Env, **routing: int) -> None:
    """examples/configs/tiny-llama.json as a Mixtral with `routing`'s keys, written to x.json."""
    (env.tmp / "x.json").write_text(json.dumps(
        {**json.loads((ROOT / "examples/configs/tiny-llama.json").read_text()), "model_type": "mixtral",
         "architectures": ["MixtralForCausalLM"], **routing}))


# ---- model files: `autopp profile MODEL` (and a few through `autopp plan MODEL`) ----
MODEL_FILES: dict[str, str] = {
    "syntax-error": "def build_model(:\n",
    "import-raises": "raise ImportError('no such package: flash_attn')\n",
    "import-exits": "import sys\nsys.exit(3)\n",
    "no-build-model": "import torch\ndef sample_batch(b):\n    return torch.randn(b, 4), torch.randn(b, 4)\n",
    "no-sample-batch": "from torch import nn\ndef build_model():\n    return nn.Linear(4, 4)\n",
    "build-model-not-callable": GOOD_MODEL + "build_model = 3\n",
    "build-model-raises": GOOD_MODEL + "def build_model():\n    raise RuntimeError('out of ideas')\n",
    "build-model-exits": GOOD_MODEL + "def build_model():\n    raise SystemExit(1)\n",
    "build-model-not-module": GOOD_MODEL + "def build_model():\n    return [1, 2]\n",
    "sample-batch-raises": GOOD_MODEL + "def sample_batch(b):\n    raise KeyError('data')\n",
    "sample-batch-not-pair": GOOD_MODEL + "def sample_batch(b):\n    return torch.randn(b, 4)\n",
    "sample-batch-not-tensors": GOOD_MODEL + "def sample_batch(b):\n    return [1.0] * b, torch.randn(b, 4)\n",
    "sample-batch-wrong-batch-dim": GOOD_MODEL + "def sample_batch(b):\n    return torch.randn(4, b + 1), torch.randn(b, 4)\n",
    "forward-raises": GOOD_MODEL + "def sample_batch(b):\n    return torch.randn(b, 5), torch.randn(b, 4)\n",
    "too-many-inputs": GOOD_MODEL + "def sample_batch(b):\n    return (torch.randn(b, 4), torch.randn(b, 4)), torch.randn(b, 4)\n",
    "loss-raises": GOOD_MODEL + "def loss_fn(out, target):\n    raise ValueError('bad loss')\n",
    "loss-not-scalar": GOOD_MODEL + "def loss_fn(out, target):\n    return (out - target) ** 2\n",
    "loss-not-tensor": GOOD_MODEL + "def loss_fn(out, target):\n    return 0.5\n",
    "loss-fn-not-callable": GOOD_MODEL + "loss_fn = 'mse'\n",
    "split-points-not-strings": GOOD_MODEL + "SPLIT_POINTS = [1, 2]\n",
    "split-point-unknown": GOOD_MODEL + "SPLIT_POINTS = ['9']\n",
    "split-points-out-of-order": GOOD_MODEL + "SPLIT_POINTS = ['2', '1']\n",
    "one-unit": GOOD_MODEL + "def build_model():\n    return nn.Linear(4, 4)\n",
    "backward-raises": GOOD_MODEL + '''
@torch.library.custom_op("autopp_catalogue::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2

@twice.register_fake
def _(x):
    return torch.empty_like(x)

class Twice(nn.Module):
    def forward(self, x):
        return twice(x)

def build_model():
    return nn.Sequential(nn.Linear(4, 4), Twice(), nn.Linear(4, 4))
''',
    "not-exportable": GOOD_MODEL + '''
class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x

def build_model():
    return nn.Sequential(nn.Linear(4, 4), Gate(), nn.Linear(4, 4))
''',
    "null-bytes": "x = 1\0\n",
}


def _writer(text: str) -> Callable[[Env], None]:
    return lambda env: env.model.write_text(text)


for _name, _text in MODEL_FILES.items():
    CASES.append(Case(f"model:{_name}", lambda env: ["profile", str(env.model), "--microbatch-size", "1",
                                                     "--repeats", "1", "--warmup", "0"],
                      lambda env: str(env.model), _writer(_text)))
CASES += [
    Case("model:missing", lambda env: ["profile", str(env.model)], lambda env: str(env.model)),
    Case("model:directory", lambda env: ["profile", str(env.tmp)], lambda env: str(env.tmp)),
    Case("plan-model:missing", lambda env: ["plan", str(env.model), "--devices", "2", "--memory", "1GiB"],
         lambda env: str(env.model)),
    Case("plan-model:directory", lambda env: ["plan", str(env.tmp), "--devices", "2", "--memory", "1GiB"],
         lambda env: str(env.tmp)),
    Case("plan-model:syntax-error", lambda env: ["plan", str(env.model), "--devices", "2", "--memory", "1GiB"],
         lambda env: str(env.model), _writer("def build_model(:\n")),
    Case("plan-model:no-build-model", lambda env: ["plan", str(env.model), "--devices", "2", "--memory", "1GiB"],
         lambda env: str(env.model), _writer("x = 1\n")),
]


# ---- profiles: `autopp plan --profile DIR` ----
def _damaged(file: str, edit: Callable[[str], str]) -> Callable[[Env], None]:
    def setup(env: Env) -> None:
        shutil.copytree(env.prof, env.bad_prof)
        path = env.bad_prof / file
        path.write_text(edit(path.read_text()))
    return setup


def _meta(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Env], None]:
    def change(text: str) -> str:
        data = json.loads(text)
        out = edit(data)
        return json.dumps(data if out is None else out)
    return _damaged("meta.json", change)


def _megatron_shaped(meta: dict[str, Any], **extra: str) -> None:
    """The shipped MLP's 8 units named as Megatron's layout reads a model (embedding, numbered blocks, output part),
    for the cases that plan `--for megatron` past its check of the model (`trainer_model_problem`); `extra` in the
    meta's `extra`."""
    meta["unit_names"] = ["embed", *(f"layers.{k}" for k in range(len(meta["unit_names"]) - 2)), "head"]
    meta["extra"].update(extra)


def _removed(file: str) -> Callable[[Env], None]:
    def setup(env: Env) -> None:
        shutil.copytree(env.prof, env.bad_prof)
        (env.bad_prof / file).unlink()
    return setup


def _replace_cell(column: str, value: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        lines = text.splitlines()
        header = lines[0].split(",")
        row = lines[1].split(",")
        row[header.index(column)] = value
        return "\n".join([lines[0], ",".join(row), *lines[2:]]) + "\n"
    return edit


def _drop_column(name: str) -> Callable[[str], str]:
    """A CSV text without the column `name` (a required one: the optional trailing ones may be absent)."""
    def drop(text: str) -> str:
        rows = [r.split(",") for r in text.splitlines()]
        k = rows[0].index(name)
        return "\n".join(",".join(r[:k] + r[k + 1:]) for r in rows) + "\n"
    return drop


PROFILES: dict[str, tuple[Callable[[Env], None], str]] = {
    "missing": (lambda env: None, ""),
    "empty-dir": (lambda env: env.bad_prof.mkdir(), ""),
    "a-file": (lambda env: env.bad_prof.write_text("x"), ""),
    "meta-not-json": (_damaged("meta.json", lambda t: t[: len(t) // 2]), "meta.json"),
    "meta-a-list": (_meta(lambda d: [d]), "meta.json"),
    "meta-version": (_meta(lambda d: d.update(version=7)), "meta.json"),
    "meta-missing-field": (_meta(lambda d: d.pop("unit_names") and None), "meta.json"),
    "meta-unknown-field": (_meta(lambda d: d.update(colour="red")), "meta.json"),
    "meta-sizes-text": (_meta(lambda d: d.update(microbatch_sizes="1,4")), "meta.json"),
    "meta-sizes-zero": (_meta(lambda d: d.update(microbatch_sizes=[0, 4])), "meta.json"),
    "meta-unit-names-not-list": (_meta(lambda d: d.update(unit_names="0 1 2")), "meta.json"),
    "meta-split-point-count": (_meta(lambda d: d.update(split_points=d["split_points"][:-1])), "meta.json"),
    "meta-fingerprint-number": (_meta(lambda d: d.update(fingerprint=12)), "meta.json"),
    "units-missing": (_removed("units.csv"), "units.csv"),
    "edges-missing": (_removed("edges.csv"), "edges.csv"),
    "units-empty": (_damaged("units.csv", lambda t: ""), "units.csv"),
    "units-truncated": (_damaged("units.csv", lambda t: t[: len(t) // 2]), "units.csv"),
    "units-nan": (_damaged("units.csv", _replace_cell("forward_s", "nan")), "units.csv"),
    "units-empty-cell": (_damaged("units.csv", _replace_cell("backward_s", "")), "units.csv"),
    "units-text": (_damaged("units.csv", _replace_cell("param_bytes", "many")), "units.csv"),
    "units-negative": (_damaged("units.csv", _replace_cell("activation_bytes", "-5")), "units.csv"),
    "units-inf": (_damaged("units.csv", _replace_cell("forward_s", "inf")), "units.csv"),
    "units-lacks-column": (_damaged("units.csv", _drop_column("forward_s")), "units.csv"),
    "units-row-missing": (_damaged("units.csv", lambda t: "\n".join(t.splitlines()[:-1]) + "\n"), "units.csv"),
    "edges-text": (_damaged("edges.csv", lambda t: t.splitlines()[0] + "\nx,y,z,w\n"), "edges.csv"),
    # a new user's: MoE layers counted, the routing (extra.moe) gone: planned with "None per layer" until export
    "units-moe-without-routing": (_damaged("units.csv", _replace_cell("moe_layers", "1")), "meta.json"),
}
for _name, (_setup, _file) in PROFILES.items():
    CASES.append(Case(f"profile:{_name}", lambda env: _plan_args(env)[:2] + [str(env.bad_prof)] + _plan_args(env)[3:],
                      lambda env, f=_file: str(env.bad_prof / f) if f else str(env.bad_prof), _setup))


# ---- plans: `autopp run PLAN` and `autopp show PLAN` ----
def _seq1f1b(d: dict[str, Any]) -> None:
    """The plan under Seq1F1B in 2 chunks."""
    d.update(schedule="Seq1F1B", seq_chunks={"lengths": [2, 2], "time_share": [0.5, 0.5], "memory_share": [0.5, 0.5]})


def _plan_edit(edit: Callable[[dict[str, Any]], Any]) -> Callable[[Env], None]:
    def setup(env: Env) -> None:
        data = json.loads(env.plan.read_text())
        data["model_path"] = str((ROOT / "examples" / "mlp.py"))
        out = edit(data)
        env.bad_plan.write_text(json.dumps(data if out is None else out))
    return setup


def _stage(i: int, **values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: d["stages"][i].update(values)


def _every_stage(**values: Any) -> Callable[[dict[str, Any]], None]:
    def edit(d: dict[str, Any]) -> None:
        for stage in d["stages"]:
            stage.update(values)
    return edit


PLANS: dict[str, Callable[[Env], None]] = {
    "missing": lambda env: None,
    "directory": lambda env: env.bad_plan.mkdir(),
    "not-json": lambda env: env.bad_plan.write_text("{\n  \"version\": 1,\n"),
    "a-list": _plan_edit(lambda d: [d]),
    "version": _plan_edit(lambda d: d.update(version=3)),
    "missing-field": _plan_edit(lambda d: d.pop("stages") and None),
    "unknown-field": _plan_edit(lambda d: d.update(colour="red")),
    "microbatches-text": _plan_edit(lambda d: d.update(num_microbatches="two")),
    "microbatches-zero": _plan_edit(lambda d: d.update(num_microbatches=0)),
    "microbatches-million": _plan_edit(lambda d: d.update(num_microbatches=1_000_000)),
    "microbatches-below-stages": _plan_edit(lambda d: d.update(num_microbatches=1)),
    "microbatches-float": _plan_edit(lambda d: d.update(num_microbatches=2.5)),
    "microbatch-size-negative": _plan_edit(lambda d: d.update(microbatch_size=-4)),
    "microbatch-size-bool": _plan_edit(lambda d: d.update(microbatch_size=True)),
    "ranks-zero": _plan_edit(lambda d: d.update(num_ranks=0)),
    "dp-zero": _plan_edit(lambda d: d.update(dp=0)),
    "pp-mismatch": _plan_edit(lambda d: d.update(pp=3)),
    "virtual-stages-mismatch": _plan_edit(lambda d: d.update(virtual_stages=2)),
    "memory-text": _plan_edit(lambda d: d.update(memory_limit_bytes="1GiB")),
    "seed-negative": _plan_edit(lambda d: d.update(seed=-1)),
    "seed-huge": _plan_edit(lambda d: d.update(seed=2**70)),
    "schedule-unknown": _plan_edit(lambda d: d.update(schedule="2F2B")),
    "custom-without-order": _plan_edit(lambda d: d.update(schedule="Custom")),
    "device-order-not-permutation": _plan_edit(lambda d: d.update(device_order=[0, 0])),
    "custom-order-not-lists": _plan_edit(lambda d: d.update(custom_order="0F0 0B0")),
    "model-path-empty": _plan_edit(lambda d: d.update(model_path="")),
    "fingerprint-number": _plan_edit(lambda d: d.update(fingerprint=7)),
    "notes-not-list": _plan_edit(lambda d: d.update(notes="fast")),
    "stages-empty": _plan_edit(lambda d: d.update(stages=[])),
    "stage-not-object": _plan_edit(lambda d: d["stages"].__setitem__(0, 3)),
    "stage-rank-out-of-range": _plan_edit(_stage(1, rank=5)),
    "stage-index-wrong": _plan_edit(_stage(1, index=4)),
    "stage-units-gap": _plan_edit(lambda d: d["stages"][1].update(units=[d["stages"][1]["units"][0] + 1,
                                                                         d["stages"][1]["units"][1]])),
    "stage-units-not-pair": _plan_edit(_stage(0, units=[0])),
    "stage-unit-names-count": _plan_edit(_stage(0, unit_names=[])),
    "stage-split-point-missing": _plan_edit(_stage(1, split_point=None)),
    "stage-forward-negative": _plan_edit(_stage(0, forward_s=-1.0)),
    "stage-memory-text": _plan_edit(_stage(0, memory_bytes="10MB")),
    "stage-activation-unknown": _plan_edit(_stage(0, activation="full")),
    "stage-offload-redo-negative": _plan_edit(_stage(0, activation="offload", offload_redo_s=-1.0)),
    "v1-stage-recompute-text": _plan_edit(lambda d: d.update(version=1, stages=[
        {**{k: v for k, v in s.items() if k != "activation"}, "recompute": "yes" if i == 0 else False}
        for i, s in enumerate(d["stages"])])),
    "v2-stage-recompute": _plan_edit(_stage(0, recompute=True)),  # version 2 with version 1's field
    "v1-stage-activation": _plan_edit(lambda d: d.update(version=1)),  # version 1 with version 2's field
    "predicted-step-nan": _plan_edit(lambda d: d["predicted"].update(step_time_s=float("nan"))),
    "predicted-peaks-text": _plan_edit(lambda d: d["predicted"].update(peak_memory_bytes=["1MB"])),
    "baselines-not-object": _plan_edit(lambda d: d.update(baselines=[1])),
    "device-number": _plan_edit(lambda d: d.update(device=7)),
    "optimizer-empty": _plan_edit(lambda d: d.update(optimizer="")),
    "optimizer-unknown": _plan_edit(lambda d: d.update(optimizer="lamb")),  # refused by the runner, naming the file
    "frees-outputs-text": _plan_edit(lambda d: d.update(frees_outputs="yes")),  # a review: read as a string before
}
_SHOW_TOO = {"missing", "not-json", "microbatches-text", "microbatches-million", "microbatch-size-negative",
             "schedule-unknown", "stage-forward-negative", "predicted-step-nan"}
for _name, _setup in PLANS.items():
    CASES.append(Case(f"run:{_name}", lambda env: ["run", str(env.bad_plan), "--report", str(env.tmp / "r.json")],
                      lambda env: str(env.bad_plan), _setup))
    if _name in _SHOW_TOO:
        CASES.append(Case(f"show:{_name}", lambda env: ["show", str(env.bad_plan), "-o", str(env.tmp / "t.png")],
                          lambda env: str(env.bad_plan), _setup))


def _partial_report(env: Env) -> None:
    """What `autopp run` writes when a rank fails before any measurement came back (no per-rank entries)."""
    from autopp.data.layout import Layout
    from autopp.run.report import RunReport
    RunReport(plan_path=str(env.plan), model_path="examples/mlp.py", fingerprint="abc", schedule="1F1B",
              layout=Layout(pp=2), num_microbatches=2, microbatch_size=2, steps=1, lr=0.01, backend="gloo",
              grad_rtol=1e-4, loss_rtol=1e-5, predicted_step_time_s=0.1,
              error="rank 0 failed: RuntimeError: boom\n(also rank 1 failed)").save(env.tmp / "r.json")


def _batch_norm_plan(env: Env) -> None:
    """A plan of tests/models/bncnn.py in four microbatches, at env.bad_plan."""
    from .run.conftest import pipeline_plan
    pipeline_plan(ROOT / "tests" / "models" / "bncnn.py", ["blocks.2"], num_microbatches=4).save(env.bad_plan)


# Issue 26, points 10 and 11: refused before any rank starts, with the way out.
CASES += [
    # a tester's: the partial report a failed run writes and names was a 21-line traceback under `autopp show`
    Case("show:a-partial-report", lambda env: ["show", str(env.tmp / "r.json"), "-o", str(env.tmp / "t.png")],
         lambda env: f"{env.tmp / 'r.json'}: the report has no per-rank measurements, so there is no timeline to "
                     "draw (the run stopped early: rank 0 failed: RuntimeError: boom); `autopp run` the plan again",
         _partial_report),
    Case("run:gpu-plan-without-cuda-devices", lambda env: ["run", str(env.bad_plan)],
         lambda env: "the plan is for h100-sxm (one GPU per rank) but this node has 0 CUDA devices for its 2 ranks: "
                     "run it on those machines, or give --backend gloo to run it on CPU here",
         _plan_edit(lambda d: d.update(device="h100-sxm"))),
    Case("run:backend-nccl-without-cuda-devices", lambda env: ["run", str(env.bad_plan), "--backend", "nccl"],
         lambda env: "--backend nccl needs a CUDA device per rank, but this node has 0 CUDA devices for its 2 ranks: "
                     "run it on GPU machines, or give --backend gloo to run it on CPU here",
         _plan_edit(lambda d: None)),  # a copy here: its default report (PLAN.report.json) must not appear
    Case("run:nodes-without-master-addr", lambda env: ["run", str(env.bad_plan), "--nnodes", "2"],
         lambda env: "--nnodes 2 runs across machines: give --master-addr, node 0's address reachable from every node",
         _plan_edit(lambda d: None)),  # a copy here: its default report (PLAN.report.json) must not appear
    Case("run:nodes-not-sharing-the-ranks",  # a tester: said "starting 2 ranks" and wrote a report first
         lambda env: ["run", str(env.bad_plan), "--nnodes", "3", "--node-rank", "0", "--master-addr", "h0"],
         lambda env: "plan needs 2 ranks, which 3 nodes cannot share evenly: give --nnodes 1 or 2",
         _plan_edit(lambda d: None)),  # a copy here: its default report (PLAN.report.json) must not appear
    Case("run:optimizer-unknown-wording", lambda env: ["run", str(env.bad_plan)],
         lambda env: f"{env.bad_plan}: field 'optimizer' is 'lamb', which autopp does not run (sgd, momentum, adam, "
                     "adamw); give --optimizer to run another", _plan_edit(lambda d: d.update(optimizer="lamb"))),
    Case("run:seq1f1b-model-without-chunks", lambda env: ["run", str(env.bad_plan)],
         lambda env: f"{ROOT / 'examples' / 'mlp.py'}: Seq1F1B runs model files that declare SEQUENCE_CHUNKS = True "
                     "(causal SDPA attention, positions given as inputs; e.g. tests/models/seqlm.py) and HF causal LMs "
                     "of llama, qwen2, qwen3 (docs/sequence-pipelining.md); re-plan with --schedule 1F1B",
         _plan_edit(_seq1f1b)),
    Case("run:seq1f1b-without-chunks", lambda env: ["run", str(env.bad_plan)],
         lambda env: f"{env.bad_plan}: field 'seq_chunks' is missing under schedule 'Seq1F1B': it is set exactly for "
                     "sequence chunks; re-plan with `autopp plan`", _plan_edit(lambda d: d.update(schedule="Seq1F1B"))),
    Case("plan:several-stages-on-one-pipeline-rank",  # issue 26: a looped single rank, which no trainer runs
         lambda env: _plan_args(env, "--dp", "2", "--schedule", "Interleaved1F1B"),
         lambda env: "Interleaved1F1B runs 2 stages per rank, which needs 2 pipeline ranks or more, and --dp 2 on 2 "
                     "devices leaves 1: use a smaller --dp, or a --schedule of 1 stage per rank"),
    Case("plan:v-schedule-another-v",  # a tester: ZBVZeroBubble with --virtual-stages 3 ran 2, silently
         lambda env: _plan_args(env, "--schedule", "ZBVZeroBubble", "--virtual-stages", "3"),
         lambda env: "ZBVZeroBubble runs exactly 2 stages per rank, so --virtual-stages 3 does not apply: give "
                     "--virtual-stages 2, drop --virtual-stages, or use Interleaved1F1B"),
    Case("plan:for-deepspeed-virtual-stages",  # a tester: ignored, a plan of 1 stage per rank
         lambda env: _plan_args(env, "--for", "deepspeed", "--virtual-stages", "2"),
         lambda env: "--virtual-stages 2 with --for deepspeed: none of the schedules it runs (1F1B (its own "
                     "TrainSchedule, one stage per rank)) runs 2 stages per rank; drop --virtual-stages"),
    Case("plan:for-megatron-no-blocks",  # a tester: planned, then refused by the export
         lambda env: _plan_args(env, "--for", "megatron"),
         lambda env: "--for megatron: no unit is a numbered block (like layers.0); trainers count transformer layers"),
    Case("plan:seq1f1b-not-a-causal-lm", lambda env: _plan_args(env, "--schedule", "Seq1F1B"),
         lambda env: "--schedule Seq1F1B splits each sequence of a causal LM by the attention's cost, and the profile "
                     "of "),
    Case("plan:seq1f1b-sequence-too-short",
         lambda env: ["plan", "--profile", str(env.bad_prof), "--devices", "2", "--memory", "1GiB", "--schedule",
                      "Seq1F1B", "-o", str(env.tmp / "out.json")],
         lambda env: "--schedule Seq1F1B cuts sequences into 2 or more chunks on multiples of 128 tokens, and the "
                     "profile's are 8: plan with --seq-len a multiple of 128 from 256, or --schedule auto",
         _meta(lambda d: d["extra"].update(hf_config={
             "seq_len": 8, "task": "causal-lm", "model_type": "llama",
             "attention": {"heads": 2, "kv_heads": 2, "head_dim": 2, "causal": True}}))),
    Case("export:seq1f1b-no-trainer", lambda env: ["export", str(env.bad_plan), "--to", "deepspeed", "-o",
                                                   str(env.tmp / "d.json")],
         lambda env: f"{env.bad_plan}: the plan's schedule is Seq1F1B, but DeepSpeed's PipelineEngine runs only 1F1B "
                     "(its own TrainSchedule, one stage per rank); re-plan with --schedule 1F1B (and no --synthesize), "
                     "or plan with `autopp plan --for deepspeed`, which searches only what deepspeed runs",
         _plan_edit(_seq1f1b)),
    Case("export:whole-stage-recompute", lambda env: ["export", str(env.bad_plan), "--to", "deepspeed", "-o",
                                                      str(env.tmp / "d.json")],
         lambda env: f"{env.bad_plan}: activation policy recompute: DeepSpeed's activation_checkpoint_interval 1 "
                     "checkpoints each layer (per-unit recomputation, `recompute-units`), not a whole stage as one "
                     "checkpoint; a whole stage needs an interval of a stage's layers, which autopp does not export; "
                     "re-plan with --recompute none, or with `autopp plan --for deepspeed`, whose --recompute auto "
                     "gives every stage one of the policies DeepSpeed's PipelineEngine applies (keep, recompute-units)",
         _plan_edit(_every_stage(activation="recompute"))),
    Case("export:bf16-pure-megatron", lambda env: ["export", str(env.bad_plan), "--to", "megatron", "-o",
                                                   str(env.tmp / "m.args")],
         lambda env: f"{env.bad_plan}: precision bf16-pure: Megatron-LM keeps a master copy beside bf16 weights "
                     "(its --main-params-dtype takes fp32 or fp16 only, megatron/training/arguments.py); count the "
                     "profile again with --precision bf16 (the recipe is the profile's), then re-plan",
         _plan_edit(lambda d: d.update(precision="bf16-pure"))),
    Case("plan:for-megatron-bf16-pure-profile",
         lambda env: ["plan", "--profile", str(env.bad_prof), "--devices", "2", "--memory", "1GiB", "--for", "megatron",
                      "-o", str(env.tmp / "out.json")],
         lambda env: "--for megatron: the profile's precision bf16-pure: Megatron-LM keeps a master copy beside bf16 "
                     "weights (its --main-params-dtype takes fp32 or fp16 only, megatron/training/arguments.py); "
                     "count the profile again with --precision bf16 (the recipe is the profile's), then re-plan",
         _meta(lambda d: _megatron_shaped(d, precision="bf16-pure"))),
    Case("export:whole-stage-selective", lambda env: ["export", str(env.bad_plan), "--to", "torchtitan", "-o",
                                                      str(env.tmp / "t.args"), "--profile", str(env.prof)],
         lambda env: f"{env.bad_plan}: activation policy selective: torchtitan's activation_checkpoint:selective wraps "
                     "each transformer block (per-unit selective recomputation, `selective-units`); it has no "
                     "whole-stage checkpoint; re-plan with --recompute none, or with `autopp plan --for torchtitan`, "
                     "whose --recompute auto gives every stage one of the policies torchtitan applies (keep, "
                     "recompute-units, selective-units)",
         _plan_edit(_every_stage(activation="selective"))),
    # review: torchtitan shards over dp_shard x cp whenever cp > 1, so it keeps no whole replicas beside cp
    Case("export:torchtitan-zero-0-beside-cp", lambda env: ["export", str(env.bad_plan), "--to", "torchtitan", "-o",
                                                           str(env.tmp / "t.args"), "--profile", str(env.prof)],
         lambda env: f"{env.bad_plan}: zero 0 with cp 2: torchtitan shards over dp_shard x cp whenever cp > 1 "
                     "(ParallelDims.fsdp_enabled: dp_shard > 1 or cp > 1), so it never keeps whole replicas beside "
                     "cp; re-plan with --zero 1 or 3",
         _plan_edit(lambda d: d.update(cp=2, num_ranks=2 * d["num_ranks"]))),
    Case("run:batch-norm-over-microbatches", lambda env: ["run", str(env.bad_plan)],
         lambda env: "the model normalizes with BatchNorm (stem.1 and 8 more), whose statistics are per microbatch (2 "
                     "samples, not the global batch of 8), so a pipelined step cannot equal the single-process one: "
                     "use GroupNorm or LayerNorm to validate, or run with validation off (`autopp run --no-validate`) "
                     "to measure only", _batch_norm_plan),
]


# ---- cluster and links files: `autopp plan --cluster FILE`, `--links FILE` ----
def _json_file(attr: str, data: Any) -> Callable[[Env], None]:
    return lambda env: getattr(env, attr).write_text(data if isinstance(data, str) else json.dumps(data))


TWO = [{"memory": "1GiB"}, {"memory": "1GiB"}]
LINK = {"latency_s": 1e-5, "bandwidth_bytes_per_s": 1e9}
CLUSTERS: dict[str, Any] = {
    "missing": None,
    "not-json": "{\"devices\": [",
    "a-list": [TWO],
    "no-devices": {"link": LINK},
    "devices-empty": {"devices": []},
    "devices-not-list": {"devices": {"memory": "1GiB"}},
    "device-not-object": {"devices": ["1GiB"]},
    "device-no-memory": {"devices": [{"speed": 1}, {"memory": "1GiB"}]},
    "device-memory-text": {"devices": [{"memory": "lots"}, {"memory": "1GiB"}]},
    "device-memory-bare-number-text": {"devices": [{"memory": "80"}, {"memory": "1GiB"}]},
    "device-memory-negative": {"devices": [{"memory": -1}, {"memory": "1GiB"}]},
    "device-speed-zero": {"devices": [{"memory": "1GiB", "speed": 0}, {"memory": "1GiB"}]},
    "device-speed-bool": {"devices": [{"memory": "1GiB", "speed": True}, {"memory": "1GiB"}]},
    "device-speeds-apart": {"devices": [{"memory": "4GiB", "speed": 1e308}, {"memory": "1GiB"}]},  # an overflow
    "links-empty": {"devices": TWO, "links": []},
    "links-too-many": {"devices": TWO, "links": [LINK, LINK]},
    "link-not-number": {"devices": TWO, "link": {"latency_s": "fast", "bandwidth_bytes_per_s": 1e9}},
    "link-negative": {"devices": TWO, "links": [{"latency_s": -1, "bandwidth_bytes_per_s": 1e9}]},
    "link-no-bandwidth": {"devices": TWO, "data_link": {"latency_s": 1e-5}},
    "unknown-key": {"devices": TWO, "lnks": [LINK]},
}
for _name, _data in CLUSTERS.items():
    CASES.append(Case(f"cluster:{_name}",
                      lambda env: ["plan", "--profile", str(env.prof), "--cluster", str(env.cluster),
                                   "-o", str(env.tmp / "out.json")],
                      lambda env: str(env.cluster),
                      (lambda env: None) if _data is None else _json_file("cluster", _data)))
for _flag, _value in (("--devices", "4"), ("--memory", "4GiB"), ("--bandwidth", "1e9"), ("--latency", "1e-5")):
    CASES.append(Case(f"cluster:with{_flag[1:]}",  # a tester: dropped without a word
                      lambda env, f=_flag, v=_value: ["plan", "--profile", str(env.prof), "--cluster",
                                                      str(env.cluster), f, v, "-o", str(env.tmp / "out.json")],
                      lambda env, f=_flag: f"give --cluster or {f}, not both", _json_file("cluster", {"devices": TWO})))
CASES.append(Case("cluster:with-message-overhead",
                  lambda env: ["plan", "--profile", str(env.prof), "--cluster", str(env.cluster),
                               "--message-overhead", "0.001", "-o", str(env.tmp / "out.json")],
                  lambda env: "--message-overhead", _json_file("cluster", {"devices": TWO})))

LINKS: dict[str, Any] = {
    "missing": None,
    "not-json": "{",
    "version": {"version": 99},
    "no-pairs": {"version": 2, "backend": "gloo"},
    "a-list": [],
}
for _name, _data in LINKS.items():
    CASES.append(Case(f"links:{_name}", lambda env: _plan_args(env, "--links", str(env.links)),
                      lambda env: str(env.links), (lambda env: None) if _data is None else _json_file("links", _data)))


def _split_backward_zero3(env: Env) -> None:
    """A ZBVZeroBubble plan of the shared profile at pp 2 x dp 2 made with ZeRO 1, its `zero` set to 3 (the planner
    no longer makes one), at env.bad_plan."""
    from autopp.data.cluster import Cluster
    from autopp.data.layout import LayoutPins
    from autopp.data.profile import load_profile
    from autopp.data.zero import ZERO
    from autopp.schedule import ScheduleName
    from autopp.solve import PlanRequest, make_plan
    request = PlanRequest(cluster=Cluster(num_devices=4, memory_bytes=2**30), global_batch=8,
                          schedule=ScheduleName.ZBV_ZERO_BUBBLE,
                          pins=LayoutPins(pp=2, dp=2, tp=1, zero=ZERO[1]))
    make_plan(load_profile(env.prof), request).save(env.bad_plan)
    data = json.loads(env.bad_plan.read_text())
    env.bad_plan.write_text(json.dumps({**data, "zero": 3}))


# ---- flags ----
FLAGS: dict[str, tuple[list[str], str]] = {
    "plan-memory-text": (["plan", "--profile", "P", "--devices", "2", "--memory", "lots"], "--memory"),
    "plan-memory-bare-number": (["plan", "--profile", "P", "--devices", "2", "--memory", "80"],
                                "--memory: size '80' has no unit; write 80GiB or 80GB (a bare number would be 80 "
                                "bytes)"),
    "plan-memory-one-letter-unit": (["plan", "--profile", "P", "--devices", "2", "--memory", "80G"],
                                    "--memory: size '80G' is ambiguous; write 80GiB (= 85.9 GB) or 80GB (= 74.5 GiB)"),
    "plan-devices-zero": (["plan", "--profile", "P", "--devices", "0", "--memory", "1GiB"], "--devices"),
    "plan-global-batch-negative": (["plan", "--profile", "P", "--global-batch", "-1"], "--global-batch"),
    "plan-schedule-unknown": (["plan", "--profile", "P", "--schedule", "2F2B"], "--schedule"),
    "plan-microbatches-zero": (["plan", "--profile", "P", "--microbatches", "0"], "--microbatches"),
    "plan-dp-text": (["plan", "--profile", "P", "--dp", "many"], "--dp"),
    "plan-latency-negative": (["plan", "--profile", "P", "--latency", "-1"], "--latency"),
    "plan-bandwidth-zero": (["plan", "--profile", "P", "--bandwidth", "0"], "--bandwidth"),
    "plan-overhead-negative": (["plan", "--profile", "P", "--message-overhead", "-0.1"], "--message-overhead"),
    "plan-progress-delay-inf": (["plan", "--profile", "P", "--progress-delay", "inf"], "--progress-delay"),
    "plan-synth-time-zero": (["plan", "--profile", "P", "--synth-time", "0"], "--synth-time"),
    "plan-judge-budget-negative": (["plan", "--profile", "P", "--judge-budget", "-1"],
                                   "--judge-budget: expected an integer >= 0, got '-1'"),
    "plan-recompute-unknown": (["plan", "--profile", "P", "--recompute", "some"], "--recompute"),
    "profile-repeats-zero": (["profile", "m.py", "--repeats", "0"], "--repeats"),
    "profile-warmup-negative": (["profile", "m.py", "--warmup", "-1"], "--warmup"),
    "profile-sizes-zero": (["profile", "m.py", "--microbatch-sizes", "0,2"], "--microbatch-sizes"),
    "profile-time-budget-zero": (["profile", "m.py", "--time-budget", "0"], "--time-budget"),
    "profile-co-runners-negative": (["profile", "m.py", "--co-runners", "-1"], "--co-runners"),
    "profile-dtype-unknown": (["profile", "m.py", "--dtype", "float8"], "--dtype"),
    "profile-precision-unknown": (["profile", "m.py", "--precision", "fp16"], "--precision"),
    "profile-links-ranks-zero": (["profile-links", "--ranks", "0"], "--ranks"),
    "profile-links-timeout-negative": (["profile-links", "--timeout", "-5"], "--timeout"),
    "run-steps-zero": (["run", "p.json", "--steps", "0"], "--steps"),
    "run-timeout-zero": (["run", "p.json", "--timeout", "0"], "--timeout"),
    "run-timeout-negative": (["run", "p.json", "--timeout", "-1"], "--timeout"),
    "run-optimizer-unknown": (["run", "p.json", "--optimizer", "lion"], "--optimizer"),
    "run-backend-unknown": (["run", "p.json", "--backend", "mpi"], "--backend"),
    "run-lr-text": (["run", "p.json", "--lr", "fast"], "--lr"),
    "run-lr-negative": (["run", "p.json", "--lr", "-0.1"], "--lr"),
    "plan-virtual-stages-zero": (["plan", "--profile", "P", "--virtual-stages", "0"], "--virtual-stages"),
    "profile-optimizer-unknown": (["profile", "m.py", "--optimizer", "lion"], "--optimizer"),
    "profile-device-unknown": (["profile", "m.py", "--device", "tpu"], "--device"),
    "show-no-file": (["show"], "file"),
    "no-command": ([], "command"),
}
for _name, (_argv, _flag) in FLAGS.items():
    CASES.append(Case(f"flag:{_name}", lambda env, a=_argv: list(a), lambda env, f=_flag: f))
CASES += [
    Case("flag:plan-for-megatron-pinned-zbv", lambda env: _plan_args(env, "--for", "megatron", "--schedule",
                                                                     "ZBVZeroBubble"), lambda env: "--for"),
    Case("flag:plan-for-megatron-synthesize", lambda env: _plan_args(env, "--for", "megatron", "--synthesize"),
         lambda env: "--synthesize"),
    Case("flag:plan-for-recompute-stages", lambda env: _plan_args(env, "--for", "torchtitan", "--recompute-stages",
                                                                  "1"), lambda env: "--recompute-stages"),
    Case("flag:plan-for-unknown", lambda env: _plan_args(env, "--for", "nemo"), lambda env: "--for"),
    # a pin the trainer refuses, refused before the search (it planned dp 1, where the pin no longer matters)
    Case("flag:plan-for-torchtitan-zero-2", lambda env: _plan_args(env, "--zero", "2", "--for", "torchtitan"),
         lambda env: "--for torchtitan cannot run --zero 2: torchtitan has no ZeRO stage 2 (its FSDP keeps gradients "
                     "whole under pipeline parallelism); re-plan with --zero 1 or 3"),
    Case("flag:plan-for-deepspeed-recompute-all", lambda env: _plan_args(env, "--recompute", "all", "--for",
                                                                         "deepspeed"),
         lambda env: "--recompute all (activation policy recompute) with --for deepspeed: DeepSpeed's "
                     "activation_checkpoint_interval 1 checkpoints each layer (per-unit recomputation, "
                     "`recompute-units`), not a whole stage as one checkpoint; a whole stage needs an interval of a "
                     "stage's layers, which autopp does not export; give --recompute auto (with --for, each policy it "
                     "applies on every stage) or none"),
    Case("flag:plan-for-megatron-no-configuration",
         lambda env: ["plan", "--profile", str(env.bad_prof), *_plan_args(env, "--for", "megatron", "--pp", "2",
                      "--schedule", "Interleaved1F1B", "--microbatches", "3", "--global-batch", "6")[3:]],
         lambda env: "--for megatron runs none of the 2 configurations the request leaves (Megatron-Core's interleaved "
                     "1F1B runs microbatches in groups of pp (2) and needs their count to be a multiple of it, but it "
                     "is 3; re-plan with --microbatches 4 (or another multiple of 2))", _meta(_megatron_shaped)),
    Case("flag:plan-overlap-none-beside-others", lambda env: _plan_args(env, "--overlap", "none,grad-reduce"),
         lambda env: "--overlap: 'none' is not one of fsdp-prefetch, grad-reduce, async-tp, ep-a2a (comma-separated) "
                     "or none alone"),
    # issue 30: Megatron-Core's combined 1F1B, which torchtitan does not run
    Case("flag:plan-for-torchtitan-ep-a2a", lambda env: _plan_args(env, "--for", "torchtitan", "--overlap",
                                                                   "grad-reduce,ep-a2a"),
         lambda env: "--overlap ep-a2a with --for torchtitan: torch.distributed.pipelining's schedules run each "
                     "forward and backward on its own, and torchtitan's expert parallelism waits for each all-to-all "
                     "(no combined forward-backward step); drop ep-a2a"),
    Case("flag:plan-overlap-unknown", lambda env: _plan_args(env, "--overlap", "fsdp-prefetch,pipelining"),
         lambda env: "--overlap"),
    Case("flag:plan-memory-reserve-all-of-it", lambda env: _plan_args(env, "--memory-reserve", "1GiB"),
         lambda env: "--memory-reserve"),
    Case("flag:plan-memory-reserve-of-a-device", lambda env: ["plan", "--profile", str(env.prof), "--device",
                                                              "h100-sxm", "--devices", "2", "--memory-reserve",
                                                              "80GiB", "-o", str(env.tmp / "out.json")],
         lambda env: "--memory-reserve"),
    Case("flag:export-deepspeed-not-json", lambda env: ["export", str(env.plan), "--to", "deepspeed", "-o",
                                                        str(env.tmp / "x.yaml")],
         lambda env: "-o " + str(env.tmp / "x.yaml")),
    Case("flag:plan-memory-reserve-with-cluster", lambda env: ["plan", "--profile", str(env.prof), "--cluster",
                                                               str(env.tmp / "c.json"), "--memory-reserve", "1GiB",
                                                               "-o", str(env.tmp / "out.json")],
         lambda env: "--memory-reserve"),
    # issue 25: a precision recipe the device, the measurement, --dtype or a given profile cannot take
    Case("flag:profile-fp8-on-a100", lambda env: ["profile", str(env.model), "--analytic", "a100-80gb",
                                                  "--precision", "fp8", "-o", str(env.tmp / "p")],
         lambda env: "device a100-80gb does not have (its catalog entry lists bfloat16, float16, float32, tf32); give "
                     "--precision bf16", lambda env: env.model.write_text(GOOD_MODEL)),
    Case("flag:profile-fp8-measured", lambda env: ["profile", str(env.model), "--precision", "fp8",
                                                   "-o", str(env.tmp / "p")],
         lambda env: "--precision fp8 is counted, not measured: give --analytic DEVICE",
         lambda env: env.model.write_text(GOOD_MODEL)),
    Case("flag:profile-fp8-with-float32", lambda env: ["profile", str(env.model), "--analytic", "h100-sxm",
                                                       "--precision", "fp8", "--dtype", "float32",
                                                       "-o", str(env.tmp / "p")],
         lambda env: "--precision fp8 computes in bfloat16, not --dtype float32; drop --dtype",
         lambda env: env.model.write_text(GOOD_MODEL)),
    Case("flag:profile-kernels-measured", lambda env: ["profile", str(env.model), "--kernels", "fused",
                                                       "-o", str(env.tmp / "p")],
         lambda env: "--kernels fused goes with --analytic DEVICE",
         lambda env: env.model.write_text(GOOD_MODEL)),
    Case("flag:plan-kernels-with-profile", lambda env: _plan_args(env, "--kernels", "fused"),
         lambda env: "times the kernels that ran (measured); count a profile with `autopp profile ... --analytic "
                     "DEVICE --kernels fused`"),
    Case("flag:plan-kernels-measured", lambda env: ["plan", str(env.model), "--kernels", "fused", "--devices", "2",
                                                    "--memory", "1GiB", "-o", str(env.tmp / "out.json")],
         lambda env: "--kernels fused goes with a profile plan counts: give --device NAME of a catalog GPU",
         lambda env: env.model.write_text(GOOD_MODEL)),
    Case("flag:plan-precision-with-profile", lambda env: _plan_args(env, "--precision", "fp8"),
         lambda env: "--precision goes with a profile that plan makes"),
    Case("flag:plan-optimizer-with-profile", lambda env: _plan_args(env, "--optimizer", "adamw"),
         lambda env: "--optimizer goes with a profile that plan makes"),
    Case("flag:plan-model-and-profile", lambda env: ["plan", str(env.model), "--profile", str(env.prof),
                                                     "--devices", "2", "--memory", "1GiB"], lambda env: "--profile"),
    Case("flag:plan-neither-model-nor-profile", lambda env: ["plan", "--devices", "2", "--memory", "1GiB"],
         lambda env: "--profile"),
    Case("flag:plan-devices-without-memory", lambda env: ["plan", "--profile", str(env.prof), "--devices", "2",
                                                          "-o", str(env.tmp / "out.json")], lambda env: "--memory"),
    Case("plan:memory-suggested-as-a-size", lambda env: _plan_args(env)[:6] + ["1MiB", "--global-batch", "8",
                                                                                *ONE_PIPELINE, "-o",
                                                                                str(env.tmp / "o.json")],
         lambda env: "use --memory 33MiB or more"),  # issue 26: was `use --memory 34288435 or more`
    # tester: a stage pin past the last stage was dropped (every stage kept), and --recompute none beside it taken
    Case("plan:recompute-stage-past-the-last",
         lambda env: _plan_args(env, "--pp", "2", "--schedule", "1F1B", "--recompute-stages", "5"),
         lambda env: "--recompute-stages 5: the configurations searched have 2 stages, none a stage 5; pin stages "
                     "below 2"),
    Case("flag:plan-recompute-with-recompute-stages",  # none goes with it: the stages not listed keep
         lambda env: _plan_args(env, "--recompute", "all", "--recompute-stages", "0"),
         lambda env: "--recompute-stages pins each stage's recomputation; drop --recompute all"),
    Case("plan:chimera-odd-microbatches", lambda env: _plan_args(env, "--schedule", "Chimera", "--global-batch", "6",
                                                                 "--microbatches", "3"),
         lambda env: "Chimera needs an even number of microbatches, half per direction (global batch 6 gives [3])"),
    Case("hf-config:no-num-hidden-layers",
         lambda env: ["plan", "--hf-config", str(env.tmp / "c.json"), "--devices", "2", "--memory", "1GiB"],
         lambda env: f'{env.tmp / "c.json"}: no "num_hidden_layers" (or n_layer, num_layers, n_layers): transformers '
                     "would build its default size without a word",
         lambda env: (env.tmp / "c.json").write_text(json.dumps(
             {k: v for k, v in json.loads((ROOT / "examples/configs/tiny-llama.json").read_text()).items()
              if k != "num_hidden_layers"}))),
    # a tester's Mixtral config without its expert count got transformers' 8 experts; top-k above the experts raised
    Case("hf-config:moe-without-its-experts", lambda env: _plan_hf(env, "x.json"),
         lambda env: f'{env.tmp / "x.json"}: no "num_local_experts" for this mixture of experts (mixtral): '
                     "transformers would route with its default without a word",
         lambda env: _tiny_mixtral(env, num_experts_per_tok=2)),
    Case("hf-config:moe-top-k-above-its-experts", lambda env: _plan_hf(env, "x.json"),
         lambda env: f'{env.tmp / "x.json"}: "num_experts_per_tok" 8 is above "num_local_experts" 4: a token '
                     "cannot reach more experts than there are",
         lambda env: _tiny_mixtral(env, num_local_experts=4, num_experts_per_tok=8)),
    # review: a causal LM's sliding window shorter than the sequence would be dropped by autopp's is_causal SDPA
    Case("hf-config:sliding-window-below-seq-len",
         lambda env: ["plan", "--hf-config", str(env.tmp / "m.json"), "--seq-len", "16", "--devices", "2",
                      "--memory", "1GiB"],
         lambda env: f'{env.tmp / "m.json"}: "sliding_window" 8 is shorter than --seq-len 16, and autopp builds '
                     "causal LMs with full causal attention (SDPA is_causal, no mask), which would drop the window; "
                     'give --seq-len 8 or less, or "sliding_window": null for full attention',
         lambda env: (env.tmp / "m.json").write_text(json.dumps(
             {**json.loads((ROOT / "examples/configs/tiny-llama.json").read_text()), "model_type": "mistral",
              "sliding_window": 8}))),
    # issue 27: context parallelism needs the attention's shape (an HF config's profile) and a sequence it shards
    Case("flag:plan-cp-without-attention-shape", lambda env: _plan_args(env, "--cp", "2", "--global-batch", "8"),
         lambda env: "--cp 2: the profile of"),
    Case("flag:plan-cp-sequence-does-not-shard",
         lambda env: ["plan", "--profile", str(env.bad_prof), "--devices", "2", "--memory", "1GiB", "--cp", "2",
                      "--global-batch", "8", "-o", str(env.tmp / "o.json")],
         lambda env: "--cp 2 with --tp 1: context parallelism needs seq % (2 x cp x tp) == 0 for causal load "
                     "balancing, and 6 % 4 = 2",
         lambda env: _with_attention(env, 6)),
    # issue 27: autopp run runs cp for HF Llama-family causal LMs (autopp.run.context_run) and refuses the rest
    Case("run:cp-of-a-model-file", lambda env: ["run", str(env.bad_plan)],
         lambda env: "plan field 'cp' is 2: autopp run runs context parallelism for HF causal LMs given by "
                     f"--hf-config (llama, qwen2, qwen3), not the model file {ROOT / 'examples' / 'mlp.py'}; export "
                     "the plan to torchtitan or megatron, or re-plan with `--cp 1`",
         _plan_edit(lambda d: d.update(cp=2, num_ranks=2 * d["num_ranks"]))),
    # issue 25 item 3: HSDP replicates a sharding ZeRO stage's shards over a divisor of dp
    Case("flag:plan-dp-replicate-with-zero-0", lambda env: _plan_args(env, "--dp", "4", "--zero", "0",
                                                                      "--dp-replicate", "2"),
         lambda env: "--dp-replicate 2 replicates ZeRO's shards, and ZeRO 0 shards nothing: give --zero 1 or 3, or "
                     "--dp-replicate 1"),
    Case("flag:plan-dp-replicate-does-not-divide", lambda env: _plan_args(env, "--dp", "4", "--zero", "1",
                                                                          "--dp-replicate", "3"),
         lambda env: "--dp-replicate 3 must divide dp(4) and be below it"),
    Case("flag:plan-dp-replicate-without-devices-for-it", lambda env: _plan_args(env, "--dp-replicate", "2"),
         lambda env: "--dp-replicate 2 must divide dp and be below it, and the 2 devices leave dp 2 at most: give "
                     "--dp-replicate 1, or more devices"),
    Case("run:cp-sequence-does-not-split", lambda env: ["run", str(env.bad_plan)],
         lambda env: "plan field 'cp' is 2: context parallelism needs seq % (2*cp) == 0 (seq 6, cp 2, causal load "
                     "balancing); export the plan to torchtitan or megatron, or re-plan with `--cp 1`",
         _plan_edit(lambda d: d.update(cp=2, model_path=str(ROOT / "examples" / "configs" / "tiny-llama.json"),
                                       hf_config={"seq_len": 6, "task": "causal-lm"},
                                       num_ranks=2 * d["num_ranks"]))),
    Case("run:cp-with-tp", lambda env: ["run", str(env.bad_plan)],
         lambda env: "plan field 'cp' is 2: autopp run runs context parallelism with tp 1, ep 1 and no vocabulary "
                     "parallelism (plan has tp 2, ep 1, vocab off)",
         _plan_edit(lambda d: d.update(cp=2, tp=2, model_path=str(ROOT / "examples" / "configs" / "tiny-llama.json"),
                                       hf_config={"seq_len": 16, "task": "causal-lm"},
                                       num_ranks=4 * d["num_ranks"]))),
    # a tester's: ZeRO 3 beside a split backward ran and failed validation (gradients 100 % off)
    Case("flag:plan-zero-3-with-a-split-backward", lambda env: ["plan", "--profile", str(env.prof), "--devices", "4",
                                                               "--memory", "1GiB", "--pp", "2", "--dp", "2", "--zero",
                                                               "3", "--schedule", "ZBVZeroBubble", "-o",
                                                               str(env.tmp / "o.json")],
         lambda env: "--zero 3 with ZBVZeroBubble: torch.distributed.pipelining's split backward (input pass, then "
                     "weight pass) beside FSDP2's resharding gives wrong parameter gradients"),
    # a tester's: `--pp 4 --dp 2 --schedule Chimera` on one node was told rank r and pp - 1 - r have other links
    Case("flag:plan-chimera-with-dp", lambda env: ["plan", "--profile", str(env.prof), "--devices", "4", "--memory",
                                                   "1GiB", "--dp", "2", "--schedule", "Chimera", "-o",
                                                   str(env.tmp / "o.json")],
         lambda env: "Chimera runs its two pipelines on pipeline ranks alone (dp 1, no cp, tp, ep or ZeRO: autopp's "
                     "bidirectional runner), and --dp 2 is asked for: give --dp 1"),
    Case("run:zero-3-with-a-split-backward", lambda env: ["run", str(env.bad_plan)],
         lambda env: "plan field 'zero' is 3 beside ZBVZeroBubble's split backward: torch.distributed.pipelining's "
                     "split backward", _split_backward_zero3),
    Case("flag:plan-dp-does-not-divide", lambda env: ["plan", "--profile", str(env.prof), "--devices", "4",
                                                      "--memory", "1GiB", "--dp", "3", "-o", str(env.tmp / "o.json")],
         lambda env: "dp(3)"),
    # issue 30: expert parallelism beside ZeRO 3 under a pipeline, or tensor parallelism, is refused in one line
    # naming the flags (ZeRO 3 beside ep at pp 1 is FSDP2)
    Case("flag:plan-ep-with-zero-3", lambda env: ["plan", "--profile", str(env.prof), "--devices", "4", "--memory",
                                                  "1GiB", "--pp", "2", "--dp", "2", "--ep", "2", "--zero", "3",
                                                  "-o", str(env.tmp / "out.json")],
         lambda env: "--zero 3 with --ep 2 and --pp above 1: autopp plans ZeRO 3 beside expert parallelism only "
                     "without a pipeline"),
    Case("flag:plan-ep-with-tp", lambda env: _plan_args(env, "--dp", "1", "--tp", "2", "--ep", "2"),
         lambda env: "--ep 2 runs with --tp 1 and a --dp it divides"),
    # a pinned ep that does not divide the routed experts (Qwen3-30B-A3B's 128) is refused before planning
    Case("flag:plan-ep-does-not-divide-experts",
         lambda env: ["plan", "--profile", str(ROOT / "profiles" / "qwen3-30b-a3b-h100-sxm-s4096"), "--devices", "3",
                      "--memory", "80GiB",
                      "--dp", "3", "--ep", "3", "-o", str(env.tmp / "out.json")],
         lambda env: "--ep 3 does not divide the model's 128 routed experts per layer"),
    # a new user's: --ep N whose dp cannot divide the devices; the error said only "dp(3) does not divide", then a
    # tester's was told to give an --ep that did not divide the experts
    Case("flag:plan-ep-sets-a-dp-that-does-not-divide",
         lambda env: ["plan", "--profile", str(ROOT / "profiles" / "qwen3-30b-a3b-h100-sxm-s4096"), "--devices", "6",
                      "--memory", "80GiB", "--ep", "4", "-o", str(env.tmp / "out.json")],
         lambda env: "--ep 4 needs a --dp it divides, and dp divides the 6 devices, which 4 does not: give an --ep of "
                     "[2]"),
    # issue 24's proof axis: expert tensor parallelism is carved beside ep from dp
    Case("flag:plan-etp-without-ep", lambda env: _plan_args(env, "--dp", "2", "--etp", "2"),
         lambda env: "--etp 2 shards the experts of an ep group, and ep is 1: give --ep > 1, or --etp 1"),
    # a new user's: without --dp the search found no configuration and said the global batch was the reason
    Case("flag:plan-etp-alone", lambda env: _plan_args(env, "--etp", "2"),
         lambda env: "--etp 2 shards the experts of an ep group, and ep is 1: give --ep > 1, or --etp 1"),
    # the dense profile is refused ep before etp's divisibility is checked (tests/test_layout.py checks that one)
    Case("flag:plan-ep-on-a-dense-profile", lambda env: _plan_args(env, "--dp", "2", "--ep", "2", "--etp", "2"),
         lambda env: "--ep 2: the profile records no stacked experts (a dense model, or one profiled before autopp "
                     "recorded them), so expert parallelism has nothing to shard: plan with --ep 1"),
    Case("flag:plan-etp-with-zero-3", lambda env: ["plan", "--profile", str(env.prof), "--devices", "4", "--memory",
                                                   "1GiB", "--pp", "1", "--dp", "4", "--ep", "2", "--etp", "2",
                                                   "--zero", "3", "-o", str(env.tmp / "out.json")],
         lambda env: "--zero 3 with --etp 2: autopp plans expert tensor parallelism with ZeRO 0, 1 or 2"),
    Case("export:torchtitan-etp", lambda env: ["export", str(env.bad_plan), "--to", "torchtitan", "-o",
                                               str(env.tmp / "t.args"), "--profile", str(env.prof)],
         lambda env: f"{env.bad_plan}: etp 2: torchtitan's expert_tensor_parallel_degree takes only 1 or the "
                     "tensor-parallel degree (torchtitan/config/job_config.py; 0.3 has no such key), and autopp's etp "
                     "is carved from dp at tp 1; re-plan with --etp 1, or export to megatron",
         _plan_edit(lambda d: d.update(dp=4, ep=2, etp=2, num_ranks=4 * d["num_ranks"]))),
    # issue 30: a mixture of experts that picks its tokens by value (DBRX) says MoE and what works, in one line
    Case("hf-config:moe-routing-by-value",
         lambda env: ["profile", "--hf-config", str(env.tmp / "dbrx.json"), "--analytic", "cpu",
                      "--microbatch-size", "1", "-o", str(env.tmp / "p")],
         lambda env: "this mixture of experts picks each expert's tokens by value (a loop over the experts hit), "
                     "which fake tensors cannot run: MoE layers that route with torch._grouped_mm",
         lambda env: (env.tmp / "dbrx.json").write_text(json.dumps(
             {"model_type": "dbrx", "d_model": 16, "n_heads": 2, "n_layers": 2, "max_seq_len": 32, "vocab_size": 64,
              "attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8},
              "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 2, "moe_top_k": 1}}))),
]



def _skip_profile(env: Env) -> None:
    """The shared profile with a long skip: unit 0's output read again by unit 4 (relayed over 1-3)."""
    shutil.copytree(env.prof, env.tmp / "skip")
    meta = json.loads((env.tmp / "skip" / "meta.json").read_text())
    meta["live_values"][1].update(dsts=[1, 4], action="relay", relayed_over=[1, 2, 3])
    (env.tmp / "skip" / "meta.json").write_text(json.dumps(meta))


def _one_stage_zero3(env: Env) -> None:
    """A pp 1 ZeRO 3 plan of the shared profile (dp 2), at env.bad_plan."""
    from autopp.data.cluster import Cluster
    from autopp.data.layout import LayoutPins
    from autopp.data.profile import load_profile
    from autopp.data.zero import ZERO
    from autopp.solve import PlanRequest, make_plan
    request = PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**30), global_batch=8,
                          pins=LayoutPins(pp=1, dp=2, tp=1, zero=ZERO[3]))
    make_plan(load_profile(env.prof), request).save(env.bad_plan)


def _llama_args(env: Env, pin: str) -> list[str]:
    """`autopp plan` of the tiny HF Llama's profile (numbered blocks, which --pin-from needs) with --pin-from PIN."""
    return ["plan", "--profile", str(ROOT / "tests" / "export" / "data" / "hf_llama"), "--devices", "2", "--memory",
            "4GiB", "--pin-from", pin, "-o", str(env.tmp / "out.json")]


# ---- exports and --pin-from (issue 26, points 5 and 6) ----
CASES += [
    Case("export:profile-for-deepspeed", lambda env: ["export", str(env.plan), "--to", "deepspeed", "--profile",
                                                      str(env.prof)],
         lambda env: "--profile applies to --to torchtitan and megatron only; deepspeed exports read the plan alone"),
    # the tester's report: an OLD that matches no profiled module was ignored without a word
    Case("export:rename-matching-nothing", lambda env: ["export", str(env.plan), "--to", "torchtitan", "--profile",
                                                        str(env.prof), "--rename", "layers.3=blocks.3",
                                                        "-o", str(env.tmp / "t.args")],
         lambda env: "--rename layers.3=blocks.3: OLD 'layers.3' matches no profiled module (their names: "),
    # the tester's report: a pp 1 plan was refused for pipeline parallelism it does not have
    Case("export:deepspeed-zero3-at-pp1", lambda env: ["export", str(env.bad_plan), "--to", "deepspeed",
                                                       "-o", str(env.tmp / "d.json")],
         lambda env: f"{env.bad_plan}: zero 3: autopp's DeepSpeed export builds the model as a PipelineModule at pp 1 "
                     "too (one stage), and deepspeed.initialize runs a PipelineModule with its PipelineEngine",
         _one_stage_zero3),
    Case("export:megatron-long-skip", lambda env: ["export", str(env.plan), "--to", "megatron", "--profile",
                                                   str(env.tmp / "skip"), "-o", str(env.tmp / "m.args")],
         lambda env: f"{env.plan}: Megatron-LM's pretrain_gpt.py builds a GPT whose layers pass one hidden state "
                     "each to the next, but unit 4 (4) reads 'submod_pp_0' of unit 0 (0), 3 units back (a skip "
                     "connection: the profile's live values); run it with autopp run, which relays such values",
         _skip_profile),
    Case("pin-from:tp-beyond-the-devices",
         lambda env: _llama_args(env, str(env.tmp / "t.args")),
         lambda env: f"{env.tmp / 't.args'}: 2 devices are not a multiple of pp 2 x tp 2 x replicate 1 "
                     "(data_parallel_shard_degree -1 takes the devices left over); plan with --devices 4",
         lambda env: (env.tmp / "t.args").write_text("--parallelism.pipeline_parallel_degree=2\n"
                                                     "--parallelism.tensor_parallel_degree=2\n")),
    Case("pin-from:megatron-tp-beyond-the-devices",
         lambda env: _llama_args(env, str(env.tmp / "m.args")),
         lambda env: f"{env.tmp / 'm.args'}: 2 devices are not a multiple of --pipeline-model-parallel-size 2 x "
                     "--tensor-model-parallel-size 2 (Megatron's dp = world size / (pp x cp x tp)); plan with "
                     "--devices 4",
         lambda env: (env.tmp / "m.args").write_text("--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 "
                                                     "--num-layers 4\n")),
]


def _seq_cls_plan(env: Env) -> None:
    """The shared plan as the plan of an HF config whose task is sequence classification."""
    data = json.loads(env.plan.read_text())
    (env.tmp / "cls.plan.json").write_text(json.dumps({**data, "hf_config": {"seq_len": 8, "task": "seq-cls"},
                                                       "model_path": str(env.plan.parent / data["model_path"])}))


def _pin_case(name: str, text: str, says: str, suffix: str = ".args") -> Case:
    """`autopp plan --pin-from FILE` of the tiny Llama's profile with FILE holding `text`, refused saying `says`."""
    return Case(f"pin-from:{name}", lambda env: _llama_args(env, str(env.tmp / f"c{suffix}")),
                lambda env: f"{env.tmp / f'c{suffix}'}: {says}",
                lambda env: (env.tmp / f"c{suffix}").write_text(text))


CASES += [
    Case("export:megatron-not-a-causal-lm", lambda env: ["export", str(env.tmp / "cls.plan.json"), "--to", "megatron"],
         lambda env: f"{env.tmp / 'cls.plan.json'}: Megatron-LM's pretrain_gpt.py trains a GPT decoder with a causal "
                     "language-model loss, and the model is a seq-cls model (its HF config's task); export to "
                     "torchtitan or deepspeed, or run it with autopp run", _seq_cls_plan),
    _pin_case("reshard-unknown", "--parallelism.pipeline_parallel_degree=1\n--parallelism.data_parallel_shard_degree=2"
              "\n--parallelism.fsdp_reshard_after_forward=sometimes\n",
              "fsdp_reshard_after_forward must be default, always or never, got 'sometimes'"),
    _pin_case("sp-not-a-switch", "[parallelism]\npipeline_parallel_degree = 2\ntensor_parallel_degree = 1\n"
              "enable_sequence_parallel = 3\n", "parallelism.enable_sequence_parallel must be true or false, got 3",
              ".toml"),
    _pin_case("recompute-granularity-unknown", "--pipeline-model-parallel-size 2 --num-layers 4 "
              "--recompute-granularity some\n", "--recompute-granularity must be full or selective, got 'some'"),
    _pin_case("recompute-chunks-not-modelled", "--pipeline-model-parallel-size 2 --num-layers 4 "
              "--recompute-granularity full --recompute-method block --recompute-num-layers 1\n",
              "--recompute-method block --recompute-num-layers 1 is not modelled (stages of up to 2 layers); autopp "
              "recomputes each layer or whole stages"),
    _pin_case("ep-does-not-divide", "--pipeline-model-parallel-size 2 --num-layers 4 --expert-model-parallel-size 2 "
              "--global-batch-size 8\n", "ep(2) must divide dp(1) * cp(1) * tp(1) = 1"),
    _pin_case("seq-len-not-a-number", "--parallelism.pipeline_parallel_degree=2\n--training.seq_len=long\n",
              "training.seq_len is 'long', not a positive whole number of tokens"),
]


def _llama_profile_at(env: Env, seq: int) -> None:
    """The tiny HF Llama's profile at env.bad_prof, recording that it was made from an HF config at `seq` tokens."""
    shutil.copytree(ROOT / "tests" / "export" / "data" / "hf_llama", env.bad_prof)
    meta = json.loads((env.bad_prof / "meta.json").read_text())
    meta["extra"]["hf_config"] = {"seq_len": seq, "task": "causal-lm", "model_type": "llama"}
    (env.bad_prof / "meta.json").write_text(json.dumps(meta))
    (env.tmp / "c.args").write_text("--parallelism.pipeline_parallel_degree=2\n--training.seq_len=32\n")


# ---- --pin-from's sequence length (issue 26: a TOML of 8192 tokens was judged on a 512-token profile) ----
CASES += [
    Case("pin-from:seq-len-differs",
         lambda env: ["plan", "--hf-config", str(ROOT / "examples" / "configs" / "tiny-llama.json"), "--seq-len", "16",
                      "--devices", "2", "--memory", "4GiB", "--pin-from", str(env.tmp / "c.args")],
         lambda env: f"{env.tmp / 'c.args'}: its sequence length is 32 tokens, --seq-len is 16; give --seq-len 32 "
                     "so both plans train the same sequences",
         lambda env: (env.tmp / "c.args").write_text("--parallelism.pipeline_parallel_degree=2\n"
                                                     "--training.seq_len=32\n")),
    Case("pin-from:profile-seq-len-differs",
         lambda env: ["plan", "--profile", str(env.bad_prof), "--devices", "2", "--memory", "4GiB", "--pin-from",
                      str(env.tmp / "c.args"), "-o", str(env.tmp / "out.json")],
         lambda env: f"{env.tmp / 'c.args'}: its sequence length is 32 tokens, the profile {env.bad_prof} was made "
                     "for 8; profile at 32 (`autopp profile --hf-config C.json --seq-len 32`) or plan with "
                     "--hf-config C.json, which profiles at the configuration's length",
         lambda env: _llama_profile_at(env, 8)),
]

def _with_attention(env: Env, seq: int) -> None:
    """The shipped profile at env.bad_prof, recording an HF config's attention shape at `seq` tokens."""
    shutil.copytree(env.prof, env.bad_prof)
    meta = json.loads((env.bad_prof / "meta.json").read_text())
    meta["extra"]["hf_config"] = {"seq_len": seq, "task": "causal-lm", "model_type": "llama",
                                  "attention": {"heads": 2, "kv_heads": 2, "head_dim": 2, "causal": True}}
    (env.bad_prof / "meta.json").write_text(json.dumps(meta))


def _vocab_plan(env: Env, value: str = "vocab-2") -> None:
    """The shared plan with vocabulary parallelism (`vocab` `value`), its model path absolute, as p.json."""
    data = json.loads(env.plan.read_text())
    env.bad_plan.write_text(json.dumps({**data, "vocab": value, "model_path": str(env.plan.parent /
                                                                                    data["model_path"])}))


# ---- vocabulary parallelism (issue 28): refused at plan time, by the exporters and where the runner cannot ----
CASES += [
    Case("vocab:plan-pinned-without-profile-facts", lambda env: _plan_args(env, "--vocab", "2"),
         lambda env: "--vocab 2: the profile does not record the model's vocabulary layers"),
    Case("vocab:plan-for-trainer", lambda env: _plan_args(env, "--for", "megatron", "--vocab", "1"),
         lambda env: "--vocab 1 with --for megatron: Megatron-LM's --account-for-embedding-in-pipeline-split "
                     "and --account-for-loss-in-pipeline-split only count the embedding and the loss as a layer"),
    *(Case(f"vocab:export-{to}", lambda env, t=to: ["export", str(env.bad_plan), "--to", t, *(
        ["--profile", str(env.prof)] if t == "torchtitan" else [])],
           lambda env, w=why: f"{env.bad_plan}: vocab vocab-2: {w}", _vocab_plan)
      for to, why in (("torchtitan", "torchtitan keeps the embedding and the output layer whole"),
                      ("megatron", "Megatron-LM's --account-for-embedding-in-pipeline-split"),
                      ("deepspeed", "DeepSpeed's PipelineModule places the embedding and the head"))),
    Case("vocab:plan-file-bad-value", lambda env: ["run", str(env.bad_plan)],
         lambda env: f"{env.bad_plan}: field 'vocab' must be null or one of ['vocab-1', 'vocab-2'], got 'v3'",
         lambda env: _vocab_plan(env, "v3")),
    Case("vocab:run-on-nodes", lambda env: ["run", str(env.bad_plan), "--nnodes", "2", "--master-addr", "10.1.2.3"],
         lambda env: "vocabulary parallelism (vocab-2) runs a model file on local gloo ranks only: drop --nnodes",
         _vocab_plan),
]


def _llama_plan(edit: Callable[[dict[str, Any]], None]) -> Callable[[Env], None]:
    """A 2-device 1F1B plan of the tiny HF Llama's profile (numbered blocks, which Megatron's export needs), edited
    by `edit`, at env.bad_plan."""
    def setup(env: Env) -> None:
        from autopp.data.cluster import Cluster
        from autopp.data.profile import load_profile
        from autopp.solve import PlanRequest, make_plan
        profile = load_profile(ROOT / "tests" / "export" / "data" / "hf_llama")
        request = PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=4 * 2**30), global_batch=8)
        make_plan(profile, request).save(env.bad_plan)
        data = json.loads(env.bad_plan.read_text())
        edit(data)
        env.bad_plan.write_text(json.dumps(data))
    return setup


def _synthesized(d: dict[str, Any]) -> None:
    """The plan under a synthesized order (Custom): GPipe's order on rank 0, 1F1B's on rank 1."""
    m = d["num_microbatches"]
    d.update(schedule="Custom", custom_order=[[f"0F{i}" for i in range(m)] + [f"0B{i}" for i in range(m)],
                                              [a for i in range(m) for a in (f"1F{i}", f"1B{i}")]])


def _interleaved_on_one_pipeline_rank(d: dict[str, Any]) -> None:
    """Both stages on rank 0 of each of 2 replicas (pp 1 x dp 2, v 2): what the issue's third re-plan was."""
    d.update(schedule="Interleaved1F1B", pp=1, dp=2, virtual_stages=2, num_microbatches=2)
    for stage in d["stages"]:
        stage["rank"] = 0


# ---- issue 26 (points 1, 2, 4 and 9): the messages it quotes, as they read now ----
CASES += [
    # point 1: the old defaults (1F1B, dp 1, tp 1, ZeRO 0, no recomputation), pinned, still refuse with the way out
    Case("plan:one-pipeline-microbatches-below-stages", lambda env: _plan_args(env, "--global-batch", "1",
                                                                               *ONE_PIPELINE),
         lambda env: "1F1B needs microbatches >= stages (1 < 2): use a global batch of at least 2 (it is 1), fewer "
                     "devices, or another --schedule"),
    Case("plan:one-pipeline-more-stages-than-units",
         lambda env: ["plan", "--profile", str(env.prof), "--devices", "16", "--memory", "1GiB", "--global-batch", "16",
                      *ONE_PIPELINE, "-o", str(env.tmp / "out.json")],
         lambda env: "cannot split 8 units into 16 stages: use at most 8 devices; or --dp auto to use the rest for "
                     "data parallelism; or finer units: SPLIT_POINTS in the model file"),
    # point 2: `plan MODEL.py --tp 2` makes the rows itself, and denies a TP plan only to a model that has none
    Case("plan-model:tp-without-a-tp-plan",
         lambda env: ["plan", str(env.model), "--tp", "2", "--devices", "2", "--memory", "1GiB"],
         lambda env: f"{env.model}: tensor parallelism (tp 2) needs a TP plan, and the model has none (no TP_PLAN in "
                     "the model file, no Hugging Face base_model_tp_plan); define TP_PLAN (README.md) or leave out "
                     "--tp",
         _writer(GOOD_MODEL)),
    # point 4: what Megatron-Core cannot run, refused by its export with the re-plan that it can
    Case("export:megatron-synthesized-order",
         lambda env: ["export", str(env.bad_plan), "--to", "megatron", "-o", str(env.tmp / "m.args")],
         lambda env: f"{env.bad_plan}: the plan's schedule is a synthesized order (Custom), but Megatron-Core runs no "
                     "synthesized order, only 1F1B or Interleaved1F1B; re-plan with --schedule 1F1B (and no "
                     "--synthesize), or plan with `autopp plan --for megatron`, which searches only what megatron runs",
         _llama_plan(_synthesized)),
    Case("export:megatron-some-stages-recompute",
         lambda env: ["export", str(env.bad_plan), "--to", "megatron", "-o", str(env.tmp / "m.args")],
         lambda env: f"{env.bad_plan}: the stages' activation policies differ (keep: stages [1]; recompute: stages "
                     "[0]); Megatron-Core applies one activation-checkpointing policy to every stage; re-plan with "
                     "--recompute none, or with `autopp plan --for megatron`, whose --recompute auto gives every stage "
                     "one of the policies Megatron-Core applies (keep, recompute-units)",
         _llama_plan(_stage(0, activation="recompute"))),
    Case("export:megatron-interleaved-on-one-pipeline-rank",
         lambda env: ["export", str(env.bad_plan), "--to", "megatron", "-o", str(env.tmp / "m.args")],
         lambda env: f"{env.bad_plan}: the plan's schedule is Interleaved1F1B, but Megatron-Core's interleaved 1F1B "
                     "needs more than one pipeline rank (\"pipeline-model-parallel size should be greater than 1 with "
                     "interleaved schedule\"); re-plan with --pp above 1 or --schedule 1F1B, or plan with `autopp "
                     "plan --for megatron`",
         _llama_plan(_interleaved_on_one_pipeline_rank)),
    # point 9: a size without a unit, or with a one-letter one, is refused wherever autopp reads a size
    Case("flag:plan-memory-reserve-bare-number", lambda env: _plan_args(env, "--memory-reserve", "3"),
         lambda env: "--memory-reserve: size '3' has no unit; write 3GiB or 3GB (a bare number would be 3 bytes)"),
    Case("flag:plan-memory-reserve-one-letter-unit", lambda env: _plan_args(env, "--memory-reserve", "3G"),
         lambda env: "--memory-reserve: size '3G' is ambiguous; write 3GiB (= 3.22 GB) or 3GB (= 2.79 GiB)"),
    Case("cluster:device-memory-one-letter-unit",
         lambda env: ["plan", "--profile", str(env.prof), "--cluster", str(env.cluster), "-o", str(env.tmp / "o.json")],
         lambda env: f"{env.cluster}: devices[0]: field 'memory': size '80G' is ambiguous; write 80GiB (= 85.9 GB) or "
                     "80GB (= 74.5 GiB)", _json_file("cluster", {"devices": [{"memory": "80G"}, {"memory": "1GiB"}]})),
]


# ---- output paths ----
OUTPUTS: list[tuple[str, Callable[[Env], list[str]], Callable[[Env], str], Callable[[Env], None]]] = [
    ("profile:-o-in-proc", lambda env: ["profile", str(env.model), "-o", "/proc/autopp-p"], lambda env: "/proc/autopp-p",
     _writer(GOOD_MODEL)),
    ("profile:-o-a-file", lambda env: ["profile", str(env.model), "-o", str(env.tmp / "f.txt")],
     lambda env: str(env.tmp / "f.txt"), lambda env: (_writer(GOOD_MODEL)(env), (env.tmp / "f.txt").write_text("x"))),
    ("profile:-o-foreign-dir", lambda env: ["profile", str(env.model), "-o", str(env.tmp / "d")],
     lambda env: str(env.tmp / "d"), lambda env: (_writer(GOOD_MODEL)(env), (env.tmp / "d").mkdir(),
                                                (env.tmp / "d" / "keep.txt").write_text("mine"))),
    ("profile:-o-under-a-file", lambda env: ["profile", str(env.model), "-o", str(env.tmp / "f.txt" / "p")],
     lambda env: str(env.tmp / "f.txt"), lambda env: (_writer(GOOD_MODEL)(env), (env.tmp / "f.txt").write_text("x"))),
    ("plan:-o-in-proc", lambda env: _plan_args(env)[:-1] + ["/proc/autopp.json"], lambda env: "/proc/autopp.json",
     lambda env: None),
    ("plan:-o-a-directory", lambda env: _plan_args(env)[:-1] + [str(env.tmp)], lambda env: str(env.tmp),
     lambda env: None),
    ("plan:-o-under-a-file", lambda env: _plan_args(env)[:-1] + [str(env.tmp / "f.txt" / "p.json")],
     lambda env: str(env.tmp / "f.txt"), lambda env: (env.tmp / "f.txt").write_text("x")),
    ("plan-model:-o-in-proc", lambda env: ["plan", str(env.model), "--devices", "2", "--memory", "1GiB",
                                           "-o", "/proc/autopp.json"], lambda env: "/proc/autopp.json",
     _writer(GOOD_MODEL)),
    ("show:-o-in-proc", lambda env: ["show", str(env.plan), "-o", "/proc/autopp.png"], lambda env: "/proc/autopp.png",
     lambda env: None),
    ("show:-o-a-directory", lambda env: ["show", str(env.plan), "-o", str(env.tmp)], lambda env: str(env.tmp),
     lambda env: None),
    ("show:-o-not-a-picture", lambda env: ["show", str(env.plan), "-o", str(env.tmp / "t.txt")],
     lambda env: str(env.tmp / "t.txt"), lambda env: None),
    ("show:--trace-in-proc", lambda env: ["show", str(env.plan), "-o", str(env.tmp / "t.png"), "--trace",
                                          "/proc/autopp-trace.json"], lambda env: "--trace", lambda env: None),
    ("profile-links:-o-in-proc", lambda env: ["profile-links", "-o", "/proc/autopp-links.json"],
     lambda env: "/proc/autopp-links.json", lambda env: None),
    ("profile-links:-o-a-directory", lambda env: ["profile-links", "-o", str(env.tmp)], lambda env: str(env.tmp),
     lambda env: None),
    ("run:--report-in-proc", lambda env: ["run", str(env.plan), "--report", "/proc/autopp-r.json"],
     lambda env: "/proc/autopp-r.json", lambda env: None),
]
CASES += [Case(f"output:{name}", argv, names, setup) for name, argv, names, setup in OUTPUTS]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A copy of the shipped mlp profile and a 2-device 1F1B plan made from it."""
    from autopp.data.cluster import Cluster
    from autopp.data.profile import load_profile
    from autopp.solve import PlanRequest, make_plan
    base = tmp_path_factory.mktemp("catalogue")
    profile = load_profile(SHIPPED)
    profile.save(base / "prof")
    plan = make_plan(profile, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=2**30), global_batch=8))
    return base / "prof", plan.save(base / "plan.json")


def _snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def test_catalogue_is_large_enough() -> None:
    assert len(CASES) >= 80 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_written(case: Case, shared: tuple[Path, Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    env = Env(tmp=tmp_path / "w", prof=shared[0], plan=shared[1])
    env.tmp.mkdir()
    monkeypatch.chdir(env.tmp)
    case.setup(env)
    before, shared_before = _snapshot(env.tmp), _snapshot(shared[0].parent)
    try:
        code = main(case.argv(env))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip() and not line.startswith(PROGRESS)]
    assert code == 2, captured.err
    assert len(lines) == 1, captured.err
    assert "error: " in lines[0] and case.names(env) in lines[0], lines[0]
    assert "Traceback" not in captured.err
    assert _snapshot(env.tmp) == before and _snapshot(shared[0].parent) == shared_before
