"""`autopp devices` and `autopp plan --device`: the catalog as a table, and a cluster of catalog devices planned on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import autopp.solve
from autopp.cli import main
from autopp.data.catalog import device_names, load_device

from .conftest import ONE_PIPELINE, SHIPPED


def test_devices_lists_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["device", "memory"]
    assert [line.split()[0] for line in lines[1:1 + len(device_names())]] == device_names()
    h100 = next(line for line in lines if line.startswith("h100-sxm ")).split()
    assert h100[1:11] == ["80", "GB", "=", "74.5", "GiB", "3350", "989.5", "67", "295", "bf16"]
    assert "resources.nvidia.com" in h100  # issue 26: the vendor's GB beside the GiB autopp prints everywhere else
    assert "--memory takes either (80GB or 74.5GiB)" in " ".join(lines)
    cpu = next(line for line in lines if line.startswith("cpu ")).split()
    assert cpu[cpu.index("GiB") + 5] == "fp32"  # review 16.20: a CPU without bf16 units shows its float32 ridge


def test_devices_name_prints_the_entry(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices", "mi300x"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mi300x: AMD Instinct MI300X") and load_device("mi300x").source in out
    assert "bfloat16 1307" in out and "64 GB/s per direction" in out


def test_devices_unknown_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices", "tpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown device 'tpu'" in err[0] and "h100-sxm" in err[0]


def _plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *flags: str) -> tuple[int, Any, dict[str, Any]]:
    """`autopp plan --profile profiles/gpt FLAGS`: exit status, the cluster it planned for, the plan JSON."""
    seen: dict[str, Any] = {}
    real = autopp.solve.make_plan

    def spy(profile: Any, request: Any) -> Any:
        seen["cluster"] = request.cluster
        return real(profile, request)
    monkeypatch.setattr(autopp.solve, "make_plan", spy)
    out = tmp_path / "p.json"
    code = main(["plan", "--profile", str(SHIPPED / "gpt"), *ONE_PIPELINE, *flags, "-o", str(out)])
    return code, seen.get("cluster"), json.loads(out.read_text()) if out.is_file() else {}


def test_plan_on_h100(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, cluster, plan = _plan(tmp_path, monkeypatch, "--device", "h100-sxm", "--devices", "8")
    spec = load_device("h100-sxm")  # the plan may use the memory less the reserve (CUDA context, NCCL, fragments)
    assert code == 0 and plan["memory_limit_bytes"] == 80 * 10**9 - spec.memory_reserve_bytes > 0
    assert plan["num_ranks"] * plan["dp"] == 8
    assert cluster.num_devices == 8 and cluster.link == spec.intra_node_link.link  # one node: NVLink, no overhead
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if not ln.startswith("planning: ")]
    assert len(err) == 2 and err[0].startswith("autopp: warning: the profile was measured on cpu")
    assert "--analytic h100-sxm" in err[0]
    assert err[1].startswith("autopp: note: global batch 64 samples per step (the default: 8 per device); give "
                             "--global-batch N")


def test_plan_across_nodes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    code, cluster, plan = _plan(tmp_path, monkeypatch, "--device", "a100-80gb", "--nodes", "2",
                                "--devices-per-node", "2", "--memory", "1GiB")
    assert code == 0 and cluster.num_devices == 4 and plan["memory_limit_bytes"] == 2**30
    spec = load_device("a100-80gb")
    assert cluster.link == spec.inter_node_link.link  # what code that has not placed a pp x dp grid sees
    assert (cluster.nodes.count, cluster.nodes.devices_per_node, cluster.nodes.device) == (2, 2, "a100-80gb")
    assert (cluster.nodes.intra, cluster.nodes.inter) == (spec.intra_node_link.link, spec.inter_node_link.link)


def test_plan_node_bandwidths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, cluster, _ = _plan(tmp_path, monkeypatch, "--device", "h100-sxm", "--nodes", "2", "--devices-per-node", "2",
                             "--inter-node-bandwidth", "1e9", "--intra-node-bandwidth", "2e11",
                             "--message-overhead", "1e-5")
    assert code == 0 and cluster.nodes.inter.bandwidth_bytes_per_s == 1e9
    assert cluster.nodes.intra.bandwidth_bytes_per_s == 2e11 and cluster.nodes.intra.overhead_s == 1e-5


def test_plan_on_cpu_device_no_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    code, cluster, _ = _plan(tmp_path, monkeypatch, "--device", "cpu", "--devices", "2", "--latency", "1e-3")
    assert code == 0 and cluster.link.latency_s == 1e-3 and cluster.link.progress_s > 0
    assert cluster.memory_bytes == load_device("cpu").memory_bytes // 2  # the host's memory, shared by its 2 ranks
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--device", "h100-sxm", "--devices", "8", "--nodes", "2"], "--devices 8 != --nodes 2 x 8 devices per node (16)"),
    (["--device", "h100-sxm"], "give --devices N or --nodes N with --device h100-sxm"),
    (["--device", "h100-sxm", "--devices", "2", "--cluster", "c.json"], "give --device or --cluster, not both (the "
                                                                         "cluster file names its devices and links)"),
    (["--device", "h100-sxm", "--devices", "2", "--links", "l.json"], "give --device or --links, not both (the "
                                                                       "device's catalog entry gives its links;"),
    (["--devices", "2", "--memory", "1GiB", "--nodes", "2"], "--nodes and --devices-per-node go with --device"),
    (["--device", "v100", "--devices", "2"], "unknown device 'v100'; the catalog has a100-40gb"),
    (["--device", "h100-sxm", "--nodes", "2", "--bandwidth", "1e9"],
     "--latency/--bandwidth set the one link of a flat cluster; 16 devices span 2 nodes: give --intra-node-bandwidth"),
    (["--device", "h100-sxm", "--devices", "12"],  # review 16.8: no silent flat fallback
     "12 devices of h100-sxm leave the last node of 8 partly filled; plan whole nodes: --nodes 2 --devices-per-node 6"),
    (["--devices", "2", "--memory", "1GiB", "--inter-node-bandwidth", "1e9"],
     "--intra-node-bandwidth and --inter-node-bandwidth go with --device NAME"),
])
def test_plan_device_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                            flags: list[str], message: str) -> None:
    code, _, plan = _plan(tmp_path, monkeypatch, *flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not plan and len(err) == 1 and message in err[0], err


@pytest.mark.integration  # starts a Python process (tests/conftest.py)
def test_devices_imports_neither_torch_nor_pandas() -> None:
    import subprocess
    import sys
    code = ("import sys\nfrom autopp.cli import main\n"
            "assert main(['devices']) == 0 and main(['devices', 'h100-sxm']) == 0\n"
            "print(sorted(m for m in ('torch', 'pandas', 'ortools') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_a_memory_above_the_named_devices_is_said(capsys: pytest.CaptureFixture[str]) -> None:
    """A tester: `--device h100-sxm --memory 200GiB` planned for 200 GiB without a word."""
    from autopp.cli import _parser
    from autopp.cli.plan_cluster import plan_cluster
    base = ["plan", "--profile", "p", "--device", "h100-sxm", "--nodes", "1"]
    cluster = plan_cluster(_parser().parse_args([*base, "--memory", "200GiB"]))
    assert cluster.memory_bytes == 200 * 2**30
    assert capsys.readouterr().err == ("autopp: warning: --memory 200 GiB is above h100-sxm's 74.51 GiB (its catalog "
                                       "entry): the plan is for a device with more memory than the one named\n")
    plan_cluster(_parser().parse_args([*base, "--memory", "70GiB"]))
    assert capsys.readouterr().err == ""
