"""The GPU check's measuring part (started by bench/gpu_check.sh once a CUDA GPU and an environment exist).

1. the GPU tier of the tests (``pytest -m gpu tests/gpu``: NCCL, bf16 steps 1–3 on a small OPT and a
   small Llama, the hybrid engine against HF ``generate`` in bf16), counted from its JUnit report;
2. the device's memory bandwidth: nominal (from the device properties or a table of data sheets) and
   reached by a device-to-device copy of 1 GiB;
3. ``bench/hybrid_engine.py`` on the OPT-1.3B configuration (hidden 2048, 24 layers, 32 heads, FFN
   8192, vocab 50272; random weights, bf16, ZeRO-3, one rank): new tokens/s of plain HF generate on the
   ZeRO-3 module and of the hybrid engine, and the share of the memory bandwidth the engine's decoding
   reaches. Decoding one token reads every weight once and the KV cache so far, so
   ``bytes/step = 2·params + 2·layers·hidden·batch·context·2`` (bf16, K and V; ``context`` averaged
   over the steps), and the bandwidth reached is ``steps · bytes/step / generate seconds``.

Writes one JSON summary (``--out``) and prints it. Exit code 0 only when every test passed and the
benchmark ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPT_1_3B = {"hidden": 2048, "layers": 24, "heads": 32, "vocab": 50272}
# Data-sheet peak memory bandwidth (bytes/s) by device name, when the device properties lack the clock.
NOMINAL = {"GH200": 4.0e12, "H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
           "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12,
           "L40": 0.864e12, "L4": 0.3e12, "A10G": 0.6e12, "A10": 0.6e12, "RTX 4090": 1.008e12, "V100": 0.9e12}


def nominal_bandwidth(props) -> tuple[float | None, str]:
    """Peak bytes/s: 2 (double data rate) × memory clock × bus width, else the data-sheet table."""
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8, "device properties (2 × memory clock × bus width)"
    for name, bw in NOMINAL.items():  # longest, most specific names first in the table
        if name in props.name:
            return bw, f"data sheet ({name})"
    return None, "unknown device"


def copy_bandwidth(gib: float = 1.0, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy (each copy reads and writes ``gib`` GiB)."""
    import torch

    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * n * 2 * repeats / (time.perf_counter() - t0)


def run_tests(work: Path, timeout: float) -> dict:
    junit = work / "gpu_tests.xml"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", f"--junitxml={junit}"],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    out = {"exit_code": proc.returncode, "seconds": round(time.time() - t0, 1), "tail": proc.stdout[-1500:]}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        out.update(counts, passed=counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"])
    return out


def run_bench(a, timeout: float) -> dict:
    cmd = [sys.executable, "bench/hybrid_engine.py", "--hidden", str(OPT_1_3B["hidden"]), "--layers",
           str(OPT_1_3B["layers"]), "--heads", str(OPT_1_3B["heads"]), "--vocab", str(OPT_1_3B["vocab"]),
           "--batch", str(a.batch), "--prompt-tokens", str(a.prompt_tokens), "--new-tokens", str(a.new_tokens),
           "--nprocs", "1", "--modes", "plain,engine_tp1", "--dtype", "bf16"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}", "tail": (proc.stdout + proc.stderr)[-3000:]}
    return json.loads(lines[-1])


def decode_bandwidth(bench: dict, a) -> dict:
    """Bytes/s the engine's decoding moves, from the benchmark's generate time and the model's sizes."""
    s = bench["setup"]
    engine = bench["engine_tp1"]
    seconds = engine["timings"].get("generate") or engine["seconds"]
    kv_per_step = 2 * s["layers"] * s["hidden"] * s["batch_per_rank"] * (a.prompt_tokens + a.new_tokens / 2) * 2
    per_step = 2 * s["params"] + kv_per_step
    return {"bytes_per_step": per_step, "weight_bytes": 2 * s["params"], "generate_seconds": seconds,
            "bytes_per_s": a.new_tokens * per_step / seconds}


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--skip-tests", action="store_true")
    a = p.parse_args()
    import deepspeed
    import torch
    import transformers

    if not torch.cuda.is_available():
        print("gpu_check: SKIP: torch sees no CUDA device", flush=True)
        return 0
    props = torch.cuda.get_device_properties(0)
    nominal, source = nominal_bandwidth(props)
    work = Path(os.environ.get("GPU_CHECK_WORK", "/tmp/chatrl_gpu_check"))
    work.mkdir(parents=True, exist_ok=True)
    summary: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "device": {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                                "count": torch.cuda.device_count(), "nominal_bandwidth_gb_s":
                                    nominal and round(nominal / 1e9), "nominal_source": source},
                     "versions": {"torch": torch.__version__, "cuda": torch.version.cuda,
                                  "deepspeed": deepspeed.__version__, "transformers": transformers.__version__}}
    summary["device"]["copy_bandwidth_gb_s"] = round(copy_bandwidth() / 1e9)
    torch.cuda.empty_cache()
    if not a.skip_tests:
        summary["tests"] = run_tests(work, timeout=420)
    bench = run_bench(a, timeout=420)
    summary["hybrid_engine_opt_1.3b_bf16"] = bench
    if "engine_tp1" in bench:
        bw = decode_bandwidth(bench, a)
        bw["fraction_of_nominal"] = nominal and round(bw["bytes_per_s"] / nominal, 3)
        bw["fraction_of_copy"] = round(bw["bytes_per_s"] / (summary["device"]["copy_bandwidth_gb_s"] * 1e9), 3)
        bw["bytes_per_s"] = round(bw["bytes_per_s"])
        summary["decode_bandwidth"] = bw
    Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1), flush=True)
    tests_ok = a.skip_tests or (summary["tests"].get("exit_code") == 0 and summary["tests"].get("passed", 0) > 0)
    return 0 if tests_ok and "engine_tp1" in bench else 1


if __name__ == "__main__":
    sys.exit(main())
