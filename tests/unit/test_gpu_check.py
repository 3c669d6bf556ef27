"""bench/gpu_check.sh on a CPU-only machine skips with one clear line, and the bandwidth arithmetic of
bench/gpu_check.py is the hand-derived one."""

import argparse
import importlib.util
import subprocess
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import REPO


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the whole check instead")
def test_gpu_check_skips_on_cpu_with_one_line(tmp_path):
    proc = subprocess.run(["bash", str(REPO / "bench" / "gpu_check.sh"), str(tmp_path / "summary.json")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["gpu_check: SKIP: no CUDA GPU on this machine (nvidia-smi lists none); "
                                        "nothing checked"]
    assert not (tmp_path / "summary.json").exists()


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bandwidth_arithmetic():
    gc = _gpu_check()
    # H100 SXM: HBM3 at 2619 MHz on a 5120-bit bus, double data rate: 2 × 2.619e9 × 640 B = 3.352 TB/s
    bw, source = gc.nominal_bandwidth(SimpleNamespace(name="NVIDIA H100 80GB HBM3", memory_clock_rate=2_619_000,
                                                      memory_bus_width=5120))
    assert bw == pytest.approx(3.352e12, rel=1e-3) and source.startswith("device properties")
    assert gc.nominal_bandwidth(SimpleNamespace(name="NVIDIA H200"))[0] == 4.8e12
    assert gc.nominal_bandwidth(SimpleNamespace(name="NVIDIA GH200 480GB"))[0] == 4.0e12
    assert gc.nominal_bandwidth(SimpleNamespace(name="NVIDIA A100-SXM4-80GB"))[0] == 2.039e12
    assert gc.nominal_bandwidth(SimpleNamespace(name="Some GPU")) == (None, "unknown device")
    # 1e9 parameters, 2 layers of hidden 1000, batch 2, prompt 10, 20 new tokens: average context 20;
    # per step 2e9 weight bytes + 2 (K, V) · 2 · 1000 · 2 · 20 · 2 bytes = 2e9 + 320000; 20 steps in 4 s
    bench = {"setup": {"params": 1e9, "layers": 2, "hidden": 1000, "batch_per_rank": 2},
             "engine_tp1": {"seconds": 5.0, "timings": {"generate": 4.0}}}
    out = gc.decode_bandwidth(bench, argparse.Namespace(prompt_tokens=10, new_tokens=20))
    assert out["bytes_per_step"] == 2e9 + 320_000
    assert out["bytes_per_s"] == pytest.approx(20 * (2e9 + 320_000) / 4.0)


def test_step3_figures_from_a_metrics_log():
    """Three steps of 16 rollouts; the first (warm-up) left out. Steps 2 and 3 take 16 / 8 = 2 s and
    16 / 4 = 4 s: 32 rollouts in 6 s = 5.333 samples/s. Answers of 200 and 100 tokens, generated in 1 s
    and 3 s: (16 · 200 + 16 · 100) / 4 = 1200 tokens/s; mean answer 150 tokens."""
    gc = _gpu_check()
    rows = [{"samples": 16, "samples_per_s": 1.0, "answer_len": 256.0, "time/generate": 9.0, "time/experience": 1.0,
             "time/train": 5.0},
            {"samples": 32, "samples_per_s": 8.0, "answer_len": 200.0, "time/generate": 1.0, "time/experience": 0.5,
             "time/train": 0.5},
            {"samples": 48, "samples_per_s": 4.0, "answer_len": 100.0, "time/generate": 3.0, "time/experience": 0.5,
             "time/train": 0.5}]
    out = gc.step3_figures(rows)
    assert out["steps"] == 2
    assert out["samples_per_s"] == pytest.approx(32 / 6)
    assert out["generated_tokens_per_s"] == pytest.approx(1200.0)
    assert out["answer_len"] == pytest.approx(150.0)
    assert out["phase_s"] == {"generate": 4.0, "experience": 1.0, "train": 1.0}
