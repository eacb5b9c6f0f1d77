"""The CLI: profile and plan end to end in-process; bad input is one line on stderr, exit 2, nothing written."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from autopp.cli import main

from .conftest import EXAMPLES, MODELS, ONE_PIPELINE


def test_profile_then_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof, plan = tmp_path / "prof", tmp_path / "p.json"
    assert main(["profile", str(MODELS / "linrelu.py"), "--microbatch-sizes", "1,2", "--repeats", "1",
                 "-o", str(prof)]) == 0
    assert sorted(p.name for p in prof.iterdir()) == ["edges.csv", "graph.json", "meta.json", "units.csv"]
    assert main(["plan", "--profile", str(prof), "--devices", "2", "--memory", "1GiB", "--global-batch", "4",
                 *ONE_PIPELINE, "-o", str(plan)]) == 0
    out = capsys.readouterr().out
    assert "autopp" in out and "even" in out and "bubble" in out
    assert json.loads(plan.read_text())["num_ranks"] == 2


def _fails(args: list[str], capsys: pytest.CaptureFixture[str], pattern: str) -> None:
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("autopp: error: ") and pattern in err[-1], err
    assert "Traceback" not in "\n".join(err)


def test_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["profile", str(tmp_path / "nope.py"), "-o", str(tmp_path / "out")], capsys, "nope.py: no such file")
    assert not (tmp_path / "out").exists()


def test_too_few_units(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "prof"
    assert main(["profile", str(MODELS / "linrelu.py"), "--microbatch-size", "2", "--repeats", "1", "-o", str(prof)]) == 0
    _fails(["plan", "--profile", str(prof), "--devices", "6", "--memory", "1GiB", *ONE_PIPELINE, "-o",
            str(tmp_path / "p.json")], capsys, "cannot split 5 units into 6 stages: use at most 5 devices")
    assert not (tmp_path / "p.json").exists()


def test_memory_too_small(shipped_gpt, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    prof = tmp_path / "prof"
    shipped_gpt.save(prof)
    _fails(["plan", "--profile", str(prof), "--devices", "2", "--memory", "1MiB", *ONE_PIPELINE, "--global-batch",
            "8", "-o", str(tmp_path / "p.json")], capsys, "the smallest that works is")
    assert not (tmp_path / "p.json").exists()


def test_memory_too_small_beside_a_reserve_names_the_memory_that_works_with_it(
        shipped_gpt, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """The tester's report: beside --memory-reserve, the remedy named a --memory that still did not fit (the reserve
    is taken from it); now also the memory that works with the reserve kept, and both plan."""
    prof = tmp_path / "prof"
    shipped_gpt.save(prof)
    base = ["plan", "--profile", str(prof), "--devices", "2", *ONE_PIPELINE, "--global-batch", "8"]
    _fails([*base, "--memory", "40MiB", "--memory-reserve", "39MiB", "-o", str(tmp_path / "p.json")], capsys,
           "the smallest that works is")
    assert main([*base, "--memory", "40MiB", "--memory-reserve", "39MiB", "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    found = re.search(r"use --memory (\S+) or more \((\S+) or more beside --memory-reserve 39MiB, or a smaller "
                      r"reserve\)", err)
    assert found is not None, err
    alone, kept = found.groups()
    assert main([*base, "--memory", alone, "-o", str(tmp_path / "a.json")]) == 0
    assert main([*base, "--memory", kept, "--memory-reserve", "39MiB", "-o", str(tmp_path / "k.json")]) == 0


def test_plan_needs_model_or_profile(capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["plan", "--devices", "2", "--memory", "1GiB"], capsys, "give either MODEL.py or --profile")


def test_bad_memory_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", str(EXAMPLES / "gpt.py"), "--devices", "2", "--memory", "lots"])
    assert info.value.code == 2 and "cannot read 'lots' as a size" in capsys.readouterr().err


def test_bad_model_file_in_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "m.py").write_text("def build_model(:\n")
    _fails(["plan", str(tmp_path / "m.py"), "--devices", "2", "--memory", "1GiB"], capsys, "m.py:1: syntax error")


@pytest.mark.integration
def test_run_validates_and_refuses_a_changed_model(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default profile directory is ./profiles/MODEL
    model = tmp_path / "m.py"
    model.write_text((MODELS / "linrelu.py").read_text())
    plan, report = tmp_path / "p.json", tmp_path / "r.json"
    assert main(["plan", str(model), "--devices", "2", "--memory", "1GiB", "--global-batch", "4", *ONE_PIPELINE,
                 "-o", str(plan)]) == 0
    assert main(["run", str(plan), "--steps", "2", "--report", str(report)]) == 0
    assert json.loads(report.read_text())["passed"] is True
    assert "PASSED" in capsys.readouterr().out
    assert main(["show", str(report), "-o", str(tmp_path / "r.png")]) == 0
    assert "wrote measured and predicted timelines" in capsys.readouterr().out
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"
    model.write_text(model.read_text().replace("nn.Linear(16, 4)", "nn.Linear(16, 4, bias=False)"))
    _fails(["run", str(plan)], capsys, "re-plan")
    assert (tmp_path / "profiles" / "m" / "meta.json").is_file()


@pytest.mark.integration  # several plans through the CLI (~2 s)
def test_plan_flags_and_cluster_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from autopp.data.synthetic_profile import synthetic_profile
    prof, plan = tmp_path / "prof", tmp_path / "p.json"
    synthetic_profile(12).save(prof)
    assert main(["plan", "--profile", str(prof), "--devices", "8", "--memory", "80GiB", "--global-batch", "32",
                 "--schedule", "auto", "--dp", "auto", "--recompute", "auto", "-o", str(plan)]) == 0
    data = json.loads(plan.read_text())
    assert data["pp"] * data["dp"] == data["num_ranks"] == 8 and "ideal" in capsys.readouterr().out
    assert main(["plan", "--profile", str(prof), "--devices", "4", "--memory", "80GiB", "--global-batch", "16",
                 *ONE_PIPELINE, "--schedule", "Interleaved1F1B", "--virtual-stages", "2", "--microbatches", "8", "-o", str(plan)]) == 0
    data = json.loads(plan.read_text())
    assert data["virtual_stages"] == 2 and len(data["stages"]) == 8 and data["num_microbatches"] == 8
    assert main(["plan", "--profile", str(prof), "--devices", "4", "--memory", "80GiB", "--pp", "2",
                 "--global-batch", "16", "-o", str(plan)]) == 0
    assert json.loads(plan.read_text())["dp"] == 2
    assert main(["plan", "--profile", str(prof), "--devices", "2", "--memory", "80GiB", "--global-batch", "8",
                 *ONE_PIPELINE, "--message-overhead", "0.001", "--progress-delay", "0.002", "-o", str(plan)]) == 0
    assert [s["overhead_s"] for s in json.loads(plan.read_text())["stages"]] == [0.001, 0.001]
    assert [s["progress_s"] for s in json.loads(plan.read_text())["stages"]] == [0.002, 0.0]
    cluster = tmp_path / "c.json"
    cluster.write_text(json.dumps({"devices": [{"memory": "80GiB", "speed": 1}, {"memory": "80GiB", "speed": 2}]}))
    assert main(["plan", "--profile", str(prof), "--cluster", str(cluster), "--global-batch", "8", *ONE_PIPELINE,
                 "-o", str(plan)]) == 0
    stages = json.loads(plan.read_text())["stages"]
    assert stages[1]["units"][1] - stages[1]["units"][0] > stages[0]["units"][1] - stages[0]["units"][0]
    capsys.readouterr()
    assert main(["plan", "--profile", str(prof), "--cluster", str(cluster), "--global-batch", "8",
                 "--message-overhead", "0.001", "-o", str(tmp_path / "q.json")]) == 2
    assert "--message-overhead applies to --devices" in capsys.readouterr().err
    assert main(["plan", "--profile", str(prof), "--cluster", str(cluster), "--global-batch", "8",
                 "--progress-delay", "0", "-o", str(tmp_path / "q.json")]) == 2
    err = capsys.readouterr().err
    assert "--progress-delay applies to --devices; with --cluster give each link's progress_s" in err
    assert not (tmp_path / "q.json").exists()


@pytest.mark.integration  # two plans through the CLI (~3 s)
def test_plan_judge_budget_0_plans_from_the_short_list_alone(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # --judge-budget reaches the request; 0 skips the branch and bound (the plan says nothing of stopping early)
    from autopp.data.synthetic_profile import synthetic_profile
    from autopp.solve import PlanRequest
    prof, plan = tmp_path / "prof", tmp_path / "p.json"
    synthetic_profile(12).save(prof)
    for budget in ("0", "1"):
        assert main(["plan", "--profile", str(prof), "--devices", "8", "--memory", "80GiB", "--global-batch", "32",
                     "--schedule", "auto", "--dp", "auto", "--judge-budget", budget, "-o", str(plan)]) == 0
        out = " ".join(capsys.readouterr().out.split())
        assert json.loads(plan.read_text())["num_ranks"] == 8
        # 1: it judges one configuration and says how many it left; 0: no branch and bound, so nothing to say
        assert ("search stopped early: 1 configurations judged" in out) == (budget == "1"), out[-600:]
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    assert f"(default {PlanRequest.judge_budget}, `PlanRequest.judge_budget`" in \
        " ".join(capsys.readouterr().out.split())


def test_plan_bad_dp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["plan", "--profile", str(tmp_path), "--devices", "4", "--memory", "1GiB", "--dp", "3"], capsys,
           "dp(3) does not divide the 4 devices")


def test_show_draws_timeline_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from .conftest import ROOT
    plan, png, trace = tmp_path / "p.json", tmp_path / "t.png", tmp_path / "t.json"
    assert main(["plan", "--profile", str(ROOT / "profiles" / "gpt"), "--devices", "2", "--memory", "1GiB",
                 "--global-batch", "8", *ONE_PIPELINE, "--schedule", "ZBVZeroBubble", "-o", str(plan)]) == 0
    assert main(["show", str(plan), "-o", str(png), "--trace", str(trace)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e.get("ph") == "X"} == {0, 1}
    assert "wrote timeline" in capsys.readouterr().out
    _fails(["show", str(tmp_path / "missing.json")], capsys, "no such plan or report file")


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--devices", "0", "--memory", "1GiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and "expected a positive integer, got '0'" in err[0]


def test_output_that_is_a_directory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from .conftest import ROOT
    _fails(["plan", "--profile", str(ROOT / "profiles" / "gpt"), "--devices", "2", "--memory", "1GiB",
            "-o", str(tmp_path)], capsys, "is a directory")
    (tmp_path / "keep.txt").write_text("mine")
    _fails(["profile", str(MODELS / "linrelu.py"), "--microbatch-size", "1", "--repeats", "1", "-o", str(tmp_path)],
           capsys, "exists and is not a profile directory")
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_written_files_respect_the_umask(tmp_path: Path) -> None:
    from .conftest import ROOT
    plan = tmp_path / "p.json"
    assert main(["plan", "--profile", str(ROOT / "profiles" / "gpt"), "--devices", "2", "--memory", "1GiB",
                 "--global-batch", "8", *ONE_PIPELINE, "-o", str(plan)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert plan.stat().st_mode & 0o777 == 0o666 & ~umask


CHECK_BEFORE_TORCH = '''
import sys
from autopp.cli import main
for argv in {argvs!r}:
    code = main(argv)
    assert code == 2, (argv, code)
    assert "torch" not in sys.modules, argv
print("torch-free")
'''


@pytest.mark.integration
def test_bad_paths_are_reported_before_torch_is_imported(tmp_path: Path) -> None:
    # issue 13.8: every command imported torch (6-20 s) before saying that a path was misspelt
    import subprocess
    import sys
    missing = str(tmp_path / "nope.py")
    argvs = [["profile", missing], ["plan", missing, "--devices", "2", "--memory", "1GiB"],
             ["plan", str(MODELS / "linrelu.py"), "--devices", "2", "--memory", "1GiB", "-o", "/proc/x.json"],
             ["profile", str(MODELS / "linrelu.py"), "-o", "/proc/p"], ["run", str(tmp_path / "nope.json")],
             ["show", str(tmp_path / "nope.json")], ["profile-links", "-o", "/proc/l.json"]]
    done = subprocess.run([sys.executable, "-c", CHECK_BEFORE_TORCH.format(argvs=argvs)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "torch-free", done.stderr
    assert len(done.stderr.strip().splitlines()) == len(argvs) and "nope.py: no such file" in done.stderr


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_plan_tp_and_zero_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from autopp.data.synthetic_profile import synthetic_profile
    profile = synthetic_profile(10, hidden=256, seq=64, tp_degrees=(2,)).save(tmp_path / "prof")
    out = tmp_path / "p.json"
    assert main(["plan", "--profile", str(profile), "--device", "h100-sxm", "--nodes", "2", "--devices-per-node", "4",
                 "--pp", "2", "--dp", "2", "--tp", "2", "--zero", "3", "--global-batch", "8", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(pp 2 x dp 2 x tp 2, ZeRO 3," in text and "on 8 ranks" in text
    data = json.loads(out.read_text())
    assert (data["tp"], data["zero"], data["num_ranks"]) == (2, 3, 8)
    assert main(["plan", "--profile", str(profile), "--device", "h100-sxm", "--nodes", "2", "--devices-per-node", "4",
                 "--dp", "auto", "--tp", "auto", "--zero", "auto", "--global-batch", "8", "-o", str(out)]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["plan", "--profile", str(profile), "--devices", "8", "--memory", "1GiB", "--zero", "4"])
    assert "expected a ZeRO stage 0, 1, 2, 3, or auto, got '4'" in capsys.readouterr().err
    _fails(["plan", "--profile", str(profile), "--devices", "8", "--memory", "80GiB", "--tp", "4", "-o",
            str(out)], capsys, "no tensor-parallel rows of degree 4 (it has: 2); profile again with --tp 2,4")


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_plan_sp_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--sp auto (the default) turns sequence parallelism on where the profile counts it; off leaves the plan as
    before; on with a profile that does not count it is one error line naming the flag."""
    from autopp.data.synthetic_profile import synthetic_profile
    new = synthetic_profile(10, hidden=256, seq=64, tp_degrees=(2,), sp=True).save(tmp_path / "new")
    old = synthetic_profile(10, hidden=256, seq=64, tp_degrees=(2,)).save(tmp_path / "old")
    out = tmp_path / "p.json"
    flags = ["--device", "h100-sxm", "--nodes", "1", "--devices-per-node", "4", "--pp", "2", "--tp", "2",
             "--global-batch", "8", "-o", str(out)]
    assert main(["plan", "--profile", str(new), *flags]) == 0
    assert "(pp 2 x dp 1 x tp 2 + SP," in capsys.readouterr().out and json.loads(out.read_text())["sp"] is True
    assert main(["plan", "--profile", str(new), *flags, "--sp", "off"]) == 0
    assert "tp 2 + SP" not in capsys.readouterr().out and "sp" not in json.loads(out.read_text())
    assert main(["plan", "--profile", str(old), *flags]) == 0 and "sp" not in json.loads(out.read_text())
    capsys.readouterr()
    out.unlink()
    _fails(["plan", "--profile", str(old), *flags, "--sp", "on"], capsys,
           "--sp on: the profile's tensor-parallel rows do not count what sequence parallelism shards (tp.csv column "
           "sp_sequence_bytes; profiles made before it): profile again, or --sp off")


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_split_keeps_tp_and_zero_and_pin_from_takes_them(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """--split is judged on every axis of the request (plan_split keeps tp and ZeRO); --pin-from, which refused them
    when it read pipeline x data-parallel settings only, takes them now (issue 26, point 6): they narrow autopp's
    search, and the trainer's configuration is judged as it is written."""
    from autopp.data.synthetic_profile import synthetic_profile
    profile = synthetic_profile(10, hidden=256, seq=64, tp_degrees=(2,)).save(tmp_path / "prof")
    out = tmp_path / "p.json"
    assert main(["plan", "--profile", str(profile), "--devices", "8", "--memory", "80GiB", "--dp", "2", "--tp", "2",
                 "--zero", "1", "--split", "3", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "(pp 2 x dp 2 x tp 2, ZeRO 1," in text and "split pinned (--split): evaluated, not searched" in text
    data = json.loads(out.read_text())
    assert (data["pp"], data["dp"], data["tp"], data["zero"], data["num_ranks"]) == (2, 2, 2, 1, 8)
    assert [s["units"] for s in data["stages"]] == [[0, 3], [3, 10]] and data["tp_plan"]
    pin = tmp_path / "megatron.args"
    pin.write_text("--pipeline-model-parallel-size 2 --num-layers 8 --micro-batch-size 1 --global-batch-size 8\n")
    out.unlink()
    for flags, grid in ((["--tp", "2"], "x tp 2"), (["--dp", "2", "--zero", "1"], "pp 4 x dp 2, ZeRO 1")):
        assert main(["plan", "--profile", str(profile), "--devices", "8", "--memory", "80GiB", *flags, "--pin-from",
                     str(pin), "-o", str(out)]) == 0
        text = capsys.readouterr().out
        assert "  yours:  1F1B pp 2 x dp 4, v 1, 2 x 1," in text and grid in text.split("\n")[2], text
    assert out.exists()


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_pin_from_comparison_notes_name_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The tester's report: the --pin-from comparison's notes printed the planning core's `memory_reserve` where the
    command line says --memory-reserve (the plan's own notes were routed through in_flags, these were not)."""
    from autopp.data.synthetic_profile import synthetic_profile
    profile = synthetic_profile(10, hidden=256, seq=64).save(tmp_path / "prof")
    pin = tmp_path / "megatron.args"
    pin.write_text("--pipeline-model-parallel-size 2 --num-layers 8 --micro-batch-size 1 --global-batch-size 8\n")
    assert main(["plan", "--profile", str(profile), "--device", "h100-sxm", "--devices", "8", "--pin-from", str(pin),
                 "-o", str(tmp_path / "p.json")]) == 0
    comparison = capsys.readouterr().out.split("autopp's plan in full:")[0]
    assert "reserve (CUDA context, NCCL buffers, allocator fragmentation; --memory-reserve, docs/devices.md)" \
        in comparison and "`" not in comparison


def test_plans_degree_flags_come_from_the_axes_descriptors(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 24: `autopp plan` makes a flag for each planned axis that has one (autopp.data.axes): an axis filled in
    its descriptor gets its flag, and the pins take it, without cli/plan.py naming it."""
    from dataclasses import replace

    from autopp.cli import plan as cli_plan
    from autopp.data import axes
    assert [a.name for a in cli_plan._flag_axes()] == ["pp", "dp", "cp", "tp", "ep", "etp"]  # cp: since issue 27
    monkeypatch.setitem(axes.AXES, "cp", replace(axes.AXES["cp"], unplanned="issue 27"))  # as before it: no flag
    assert [a.name for a in cli_plan._flag_axes()] == ["pp", "dp", "tp", "ep", "etp"]
    monkeypatch.undo()
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    assert "--cp CP" in out and "--etp ETP" in out  # etp (issue 24's proof axis): its descriptor's Flag alone
    import argparse
    args = argparse.Namespace(pp=None, dp=None, cp=0, tp=2, ep=1, etp=0)
    assert [cli_plan._pin(args, a) for a in cli_plan._flag_axes()] == [None, None, None, 2, 1, None]
    # --ep N without --dp: dp searched (test_ep_leaves_dp_searched_among_its_multiples), as with --ep auto
    dp = cli_plan.AXES["dp"]
    assert cli_plan._pin(argparse.Namespace(pp=None, dp=None, ep=2), dp) is None


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_plan_with_etp_from_the_command_line_and_its_megatron_export(tmp_path: Path) -> None:
    """Issue 24's proof axis through the CLI: `autopp plan --ep 4 --etp 2` on Qwen3-30B-A3B's shipped profile writes
    the plan's `etp`, its note says the experts' GEMMs sharded, and `autopp export --to megatron` writes
    --expert-tensor-parallel-size beside --expert-model-parallel-size; --etp auto searches it."""
    from .conftest import ROOT
    profile, out = ROOT / "profiles" / "qwen3-30b-a3b-h100-sxm-s4096", tmp_path / "p.json"
    assert main(["plan", "--profile", str(profile), "--devices", "16", "--device", "h100-sxm", "--pp", "2", "--dp", "8",
                 "--ep", "4", "--etp", "2", "--zero", "1", "--for", "megatron", "-o", str(out)]) == 0
    data = json.loads(out.read_text())
    assert (data["pp"], data["dp"], data["ep"], data["etp"]) == (2, 8, 4, 2)
    assert any("expert tensor parallelism 2" in n for n in data["notes"])
    assert main(["export", str(out), "--to", "megatron", "-o", str(tmp_path / "m.args")]) == 0
    text = (tmp_path / "m.args").read_text()
    assert "--expert-model-parallel-size 4" in text and "--expert-tensor-parallel-size 2" in text
    assert main(["plan", "--profile", str(profile), "--devices", "16", "--device", "h100-sxm", "--pp", "2", "--dp", "8",
                 "--ep", "auto", "--etp", "auto", "--zero", "1", "-o", str(out)]) == 0
    assert json.loads(out.read_text()).get("etp", 1) in (1, 2, 4, 8)


def test_in_flags_names_the_core_fields_as_flags() -> None:
    """The planning core names its request's fields in backquotes; the CLI's one table says them as flags: phrases
    first ("search `dp`" is --dp auto, not "search --dp"), then each field."""
    from autopp.cli.common import FLAG_TERMS, in_flags
    assert in_flags("give `dp` > 1 (or search `dp`), or `zero` 0") == "give --dp > 1 (or --dp auto), or --zero 0"
    assert in_flags("`recompute_stages` 1 needs `num_microbatches` >= 2; `tp` searched") == \
        "--recompute-stages 1 needs --microbatches >= 2; --tp auto"
    assert in_flags("`recompute` all, `memory_bytes` and `v`") == "--recompute all, --memory and --virtual-stages"
    assert in_flags("dp is 1 and 'dp' too") == "dp is 1 and 'dp' too"  # only backquoted names are fields
    assert in_flags("`activations` keep") == "the activation policies (--recompute) keep"  # no flag of its own
    terms = [term for term, _ in FLAG_TERMS]
    assert len(terms) == len(set(terms))
    for i, term in enumerate(terms):  # a phrase is rewritten before any field it contains
        assert not any(term in later for later in terms[i + 1:]), term
    assert all("`" not in flag for _, flag in FLAG_TERMS)


def test_a_core_refusal_reads_with_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """The Python API refuses ZeRO 1 on one replica naming `dp` and `zero`; the CLI says the same with its flags."""
    from autopp.data.layout import LayoutPins
    from autopp.data.zero import ZERO
    from autopp.errors import LayoutError
    from .conftest import ROOT
    with pytest.raises(LayoutError, match=r"and dp is 1: give `dp` > 1 \(or search `dp`\), or `zero` 0"):
        LayoutPins(dp=1, zero=ZERO[1])
    assert main(["plan", "--profile", str(ROOT / "profiles" / "gpt"), "--devices", "2", "--memory", "1GiB",
                 "--dp", "1", "--zero", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["autopp: error: ZeRO 1 shards over data-parallel replicas, and dp is 1: give --dp > 1 (or --dp "
                   "auto), or --zero 0"], err


def test_plan_of_more_cpu_ranks_than_cores_notes_it_and_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29, item 3: 4 CPU ranks planned for a 2-core host (cores injected: not this machine's count) carry a
    note and one warning line; not when they fit, nor when the profile was timed beside as many busy ranks."""
    import shutil

    from autopp import cores

    from .conftest import ROOT
    prof, plan = tmp_path / "prof", tmp_path / "p.json"
    shutil.copytree(ROOT / "profiles" / "mlp", prof)  # a CPU profile, timed beside 1 co-runner
    args = ["plan", "--profile", str(prof), "--devices", "4", "--memory", "1GiB", "--global-batch", "8",
            *ONE_PIPELINE, "-o", str(plan)]
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    assert main(args) == 0
    err = capsys.readouterr().err.splitlines()
    said = "if run on this machine: 4 ranks share 2 cores, 2.0 per core: compute is serialised"
    assert [e for e in err if "warning" in e] == [f"autopp: warning: {json.loads(plan.read_text())['notes'][-1]}"]
    assert said in err[-1]
    monkeypatch.setattr(cores, "usable_cores", lambda: 4)
    assert main(args) == 0 and "warning" not in capsys.readouterr().err
    assert not any("per core" in n for n in json.loads(plan.read_text())["notes"])
    meta = json.loads((prof / "meta.json").read_text())
    (prof / "meta.json").write_text(json.dumps({**meta, "co_runners": 3}))
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    assert main(args) == 0 and "warning" not in capsys.readouterr().err


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_plan_on_a_gpu_says_its_memory_reserve_and_overlap_and_both_switch(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 25 items 4, 6: on a catalog GPU the plan keeps the reserve and assumes the trainers' overlap, and says
    both; `--memory-reserve 0 --overlap none` plans the device's whole memory with every collective exposed."""
    base = ["plan", "--profile", str(Path(__file__).resolve().parents[1] / "profiles" / "mlp"), "--device",
            "h100-sxm", "--devices", "4", "--pp", "2", "--dp", "2", "--global-batch", "8"]
    assert main([*base, "-o", str(tmp_path / "a.json")]) == 0
    said = capsys.readouterr().out
    plan = json.loads((tmp_path / "a.json").read_text())
    assert "memory limit 71.5 GiB per device" in said and "less a 3 GiB reserve" in said
    assert "overlap: fsdp_prefetch, grad_reduce" in said and "where the step goes" in said
    assert plan["memory_limit_bytes"] == 80 * 10**9 - 3 * 2**30 and "time_breakdown" in plan
    assert main([*base, "--memory-reserve", "0", "--overlap", "none", "-o", str(tmp_path / "b.json")]) == 0
    said = capsys.readouterr().out
    assert "memory limit 74.5 GiB per device" in said and "reserve" not in said and "overlap:" not in said
    whole = json.loads((tmp_path / "b.json").read_text())
    assert whole["predicted"]["allreduce_s"] >= plan["predicted"]["allreduce_s"]


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_plan_cp_is_pinned_or_searched_and_written_to_the_plan(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 27: `autopp plan --cp 2` on a profile that records an attention shape writes `cp` 2 into the plan and a
    note; `--cp auto` searches it (1 or more); the plan loads back with the layout."""
    import shutil

    from autopp.data.plan import load_plan

    from .conftest import ROOT
    prof, plan = tmp_path / "prof", tmp_path / "p.json"
    shutil.copytree(ROOT / "profiles" / "mlp", prof)
    meta = json.loads((prof / "meta.json").read_text())
    meta["extra"]["hf_config"] = {"seq_len": 8, "task": "causal-lm", "model_type": "llama",
                                  "attention": {"heads": 2, "kv_heads": 2, "head_dim": 2, "causal": True}}
    (prof / "meta.json").write_text(json.dumps(meta))
    args = ["plan", "--profile", str(prof), "--devices", "4", "--memory", "1GiB", "--global-batch", "8", "-o",
            str(plan)]
    assert main([*args, "--cp", "2"]) == 0
    out = capsys.readouterr().out
    data = json.loads(plan.read_text())
    assert data["cp"] == 2 and data["pp"] * data["dp"] * data["cp"] == data["num_ranks"] == 4
    assert "cp 2" in out and any(n.startswith("context parallelism 2: each sequence of 8 tokens") for n in data["notes"])
    assert load_plan(plan).layout.cp == 2
    assert main([*args, "--cp", "auto", "--dp", "auto"]) == 0
    assert load_plan(plan).layout.world == 4


def test_plan_writes_its_step_band_and_keeps_ties_by_the_rule(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 29, item 4: `autopp plan` plans with the tie rule (PlanRequest.ties): profiles/gpt's configurations
    (every schedule) inside the band of its spreads are ties, one with the fewest microbatches kept, and said."""
    from autopp.solve.assemble.make import TIE_NOTE

    from .conftest import ROOT
    plan = tmp_path / "p.json"
    assert main(["plan", "--profile", str(ROOT / "profiles" / "gpt"), "--devices", "2", "--memory", "1GiB",
                 "--global-batch", "8", *ONE_PIPELINE, "--schedule", "auto", "--for", "torchtitan",  # Chimera wins outright
                 "-o", str(plan)]) == 0
    out = capsys.readouterr().out
    data = json.loads(plan.read_text())
    low, high = data["step_band_s"]
    assert low < data["predicted"]["step_time_s"] < high and data["tied"] and TIE_NOTE in data["notes"]
    assert "; the margin is inside it: " in out and f"note: {TIE_NOTE}" in out
    assert all(int(t.split(" m=")[1].split("x")[0]) >= data["num_microbatches"] for t in data["tied"])


def test_the_planning_cores_progress_lines_show_on_a_terminal_and_in_a_log(monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """CP-SAT's solves report on the `autopp.progress` logger (issue 26: a time left for CP-SAT); `autopp plan`
    shows them on its progress line while it plans, on a terminal, and leaves the logger as it found it. Into a
    log (a new user's 405B plan sat silent for 100 s there), one line per `LOG_EVERY_S`, not one per message."""
    import logging
    import sys
    from autopp.cli import common
    from autopp.cli.common import shown_progress
    from autopp.progress import PROGRESS_LOG
    logger = logging.getLogger(PROGRESS_LOG)
    before = (logger.level, logger.propagate, list(logger.handlers))
    clock = iter([100.0, 105.0, 111.0])
    monkeypatch.setattr(common.time, "monotonic", lambda: next(clock))
    with shown_progress("planning"):  # not a terminal: a bar's line now, none 5 s later, one 11 s later
        logger.info("short-listing 9 configurations")  # a phase's line: always
        for n in (1, 2, 3):
            logger.info("[#...] %d0%%: bounding configurations: %d of 9", n, n)
    assert capsys.readouterr().err.splitlines() == ["planning: short-listing 9 configurations",
                                                     "planning: [#...] 10%: bounding configurations: 1 of 9",
                                                     "planning: [#...] 30%: bounding configurations: 3 of 9"]
    assert (logger.level, logger.propagate, logger.handlers) == before
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with shown_progress("planning"):
        logger.info("[##########..........] 50%%, about %d s left: CP-SAT", 5)
    assert capsys.readouterr().err == "\r\033[Kplanning: [##########..........] 50%, about 5 s left: CP-SAT"
    assert (logger.level, logger.propagate, logger.handlers) == before


def test_ep_leaves_dp_searched_among_its_multiples(tmp_path: Path) -> None:
    """A tester: `--ep 8` alone pinned dp 8 too (until 2026-12-06), and the pipeline that took the rest of the 64
    devices was 12 % slower than the dp 32 that `--ep auto` found; dp is searched among ep's (x etp's) multiples, as
    beside `--pp`. On 8 devices of a 4-unit MoE profile the search takes dp 4 with ep 2."""
    import json

    from .costmodel.test_parallel import _moe_profile
    _moe_profile().save(tmp_path / "prof")
    for extra in (["--ep", "2"], ["--ep", "2", "--etp", "2"]):
        assert main(["plan", "--profile", str(tmp_path / "prof"), "--devices", "8", "--memory", "1GiB",
                     "--global-batch", "16", *extra, "-o", str(tmp_path / "p.json")]) == 0
        plan = json.loads((tmp_path / "p.json").read_text())
        assert (plan["dp"], plan["ep"]) == (4, 2)


def test_a_restricted_plan_faster_than_the_unrestricted_tie_says_why(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """The tester's gpt on 2 CPU ranks `--for deepspeed`: the unrestricted search keeps ZeRO 3 inside its step band by
    the tie rule (less memory), predicted slower than DeepSpeed's plan; the price line says so, not a bare -3.8 %."""
    from .conftest import SHIPPED
    assert main(["plan", "--profile", str(SHIPPED / "gpt"), "--devices", "2", "--memory", "1GiB", "--global-batch",
                 "8", "--for", "deepspeed", "-o", str(tmp_path / "p.json")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("without --for deepspeed: "))
    assert "the restriction to deepspeed costs -" in line
    assert line.endswith("(the unrestricted choice is a tie inside its step band, kept by the tie rule)")


def test_the_readmes_command_synopsis_lists_every_flag() -> None:
    """A new user's: the README's synopsis lacked --dp-replicate, --latency, --bandwidth, --master-port and --run-dir,
    which `--help` shows; every long flag of every command is in it."""
    import argparse
    from autopp.cli import _parser
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    synopsis = readme.split("## The commands", 1)[1].split("\n- **profile**", 1)[0]
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    def listed(flag: str) -> bool:
        return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", synopsis) is not None
    missing = [f"{name} {action.option_strings}" for name, p in sub.choices.items() for action in p._actions
               if action.option_strings and "--help" not in action.option_strings
               and not any(listed(flag) for flag in action.option_strings)]
    assert not missing, missing


@pytest.mark.integration
def test_planning_from_a_profile_imports_no_torch(tmp_path: Path) -> None:
    """A reviewer: the plan's note of what `autopp run` would refuse imported torch, FSDP2 and DTensor into every
    `autopp plan --profile` (0.5 s -> 2.6 s); the runner's rules are torch-free (autopp.data.runner_rules)."""
    import subprocess
    import sys

    from .conftest import ROOT
    script = ("import sys\nfrom autopp.cli import main\n"
              f"assert main(['plan', '--profile', {str(ROOT / 'profiles' / 'gpt')!r}, '--devices', '2', '--memory', "
              f"'1GiB', '--global-batch', '8', '-o', {str(tmp_path / 'p.json')!r}]) == 0\n"
              "assert 'torch' not in sys.modules\nprint('torch-free')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "torch-free", done.stderr


def test_the_price_of_for_megatron_is_counted_with_its_stages_outputs_freed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A reviewer: `--for megatron` counts each stage's outputs freed once sent, and the unrestricted plan it is
    priced against counted them held, so at this memory it said the restriction "costs -0.7 % (... a tie ...)";
    both now count Megatron's runtime, and the plan's JSON says so."""
    from .conftest import SHIPPED
    assert main(["plan", "--profile", str(SHIPPED / "gpt"), "--devices", "4", "--pp", "4", "--schedule", "1F1B",
                 "--microbatches", "8", "--global-batch", "8", "--recompute", "none", "--for", "megatron",
                 "--memory", "11.65MiB", "-o", str(tmp_path / "p.json")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("without --for megatron: "))
    assert "the restriction to megatron costs +" in line and "tie" not in line
    assert json.loads((tmp_path / "p.json").read_text())["frees_outputs"] is True
