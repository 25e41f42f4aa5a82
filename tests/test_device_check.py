"""diloco-bench device: the accelerator check's JSON, run as the CPU dry run CI gets (real daemons)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from bench import device_check

TOP_KEYS = {
    "dry_run", "device", "jax_version", "jaxlib_version", "install", "sizes",
    "island", "quantize", "join", "ratios", "seconds",
}  # fmt: skip
RATIOS = {
    "island_device_exchange_over_step", "island_host_exchange_over_step",
    "island_device_vs_host_exchange", "island_device_step_vs_host_step",
    "island_device_vs_host_bytes",
    "island_device_exchange_vs_memcpy", "island_host_exchange_vs_memcpy",
    "quantize_vs_memcpy", "join_call_over_step", "join_call_alone_over_step",
    "join_round_call_over_step",
}  # fmt: skip


@pytest.mark.timeout(30)
def test_every_ratio_is_its_figure_over_the_baseline_of_the_same_run():
    island = {
        "device": {"exchange_ms": 2.0, "step_ms": 8.0, "host_device_bytes_per_param": 1.0},
        "host": {"exchange_ms": 5.0, "step_ms": 10.0, "host_device_bytes_per_param": 8.0},
        "memcpy_ms": 0.5,
    }
    quantize = {"quantize_ms": 3.0, "memcpy_ms": 1.5}
    join = {"call_us": 4.0, "call_alone_us": 2.0, "round_call_us": 400.0, "step_us": 100.0}
    assert device_check.ratios(island, quantize, join) == {
        "island_device_exchange_over_step": 0.25,  # 2 / 8
        "island_host_exchange_over_step": 0.5,  # 5 / 10
        "island_device_vs_host_exchange": 0.4,  # 2 / 5
        "island_device_step_vs_host_step": 0.8,  # 8 / 10
        "island_device_vs_host_bytes": 0.125,  # 1 / 8
        "island_device_exchange_vs_memcpy": 4.0,  # 2 / 0.5
        "island_host_exchange_vs_memcpy": 10.0,  # 5 / 0.5
        "quantize_vs_memcpy": 2.0,  # 3 / 1.5
        "join_call_over_step": 0.04,  # 4 / 100
        "join_call_alone_over_step": 0.02,  # 2 / 100
        "join_round_call_over_step": 4.0,  # 400 / 100
    }


@pytest.mark.timeout(60)
def test_without_nvidia_smi_nothing_is_installed_and_jax_is_not_probed(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nvidia-smi on it
    report = device_check.ensure_cuda_jax(True, sys.stderr)
    assert report["gpus_seen"] == []
    assert (report["command"], report["ok"], report["backend"]) == (None, None, None)


@pytest.mark.timeout(30)
def test_the_install_pins_the_installed_jax_version():
    from importlib import metadata

    version = metadata.version("jax")
    command = device_check.install_command("cuda12", "python")
    assert command == ["python", "-m", "pip", "install", f"jax[cuda12]=={version}"]
    assert device_check.install_command("cuda13")[-1] == f"jax[cuda13]=={version}"
    with pytest.raises(ValueError):
        device_check.install_command("cuda11")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_dry_run_writes_one_json_with_every_figure_and_finite_positive_ratios(tmp_path):
    out = tmp_path / "device.json"
    argv = [sys.executable, "-m", "bench.cli", "device", "--dry-run", "--no-install",
            "--out", str(out)]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    result = json.loads(out.read_text())
    assert printed == result
    assert set(result) == TOP_KEYS
    assert result["dry_run"] is True
    assert result["sizes"] == device_check.DRY
    assert {"platform", "kind", "count", "devices"} <= set(result["device"])
    assert result["device"]["count"] == len(result["device"]["devices"]) >= 1
    assert result["install"]["command"] is None  # --no-install
    for path in ("device", "host"):
        row = result["island"][path]
        assert row["params"] > 0 and row["rounds_timed"] == 1, row  # 2 rounds, the first untimed
        assert row["host_device_bytes_per_param"] > 0, row
    assert result["island"]["device"]["exchange"] == "DeviceExchange"
    assert result["island"]["host"]["exchange"] == "HostExchange"
    assert result["quantize"]["elements"] == device_check.DRY["quant_elements"]
    assert result["join"]["calls_timed"] > 0
    assert set(result["ratios"]) == RATIOS
    for name, value in result["ratios"].items():
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, value)
