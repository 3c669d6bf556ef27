"""Memory of DPO's reference with LoRA: adapters disabled (no second copy) vs a frozen copy.

Runs ``chatrl.step2_dpo`` for 2 optimizer steps with LoRA (``--only_optimize_lora``) on a tiny Llama
of ~50 MB (fp32), once per set-up, each in its own process, and prints one JSON object:

* ``none``: SimPO (reference-free): the baseline, the policy alone;
* ``adapters_disabled``: DPO whose reference is the policy with its adapters off (chatrl's default
  with LoRA);
* ``copy``: DPO with a frozen copy as reference (forced here; what a LoRA set-up that loads the
  reference twice costs).

For each: the parameter bytes held by the reference model, the resident memory after training
(engines and reference still alive) and the peak (``ru_maxrss``, dominated by data loading and
logits on this small model); the ratios are each run's extra memory over the baseline's, in units
of one model's parameter bytes.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("CHATRL_SHARED", REPO.parent / "shared"))


def child(mode: str, model: str, work: str) -> None:
    from chatrl.step2_dpo import main as dpo_main
    from chatrl.step2_dpo import reference

    if mode == "copy":  # force a frozen copy although the base weights are frozen under LoRA
        reference.reference_kind = lambda settings, lora: "copy"
    hb = SHARED / "data" / "hh-rlhf" / "helpful-base" / "test.jsonl.gz"
    res = dpo_main.run(["--model_name_or_path", model, "--data_path", f"{hb}[0:60]", "--data_split", "0,1,0",
                        "--eval_fraction", "0.1", "--max_seq_len", "128", "--per_device_train_batch_size", "2",
                        "--per_device_eval_batch_size", "2", "--eval_iters", "1", "--max_steps", "2",
                        "--lora_dim", "8", "--lora_module_name", "layers.", "--only_optimize_lora",
                        "--loss_type", "simpo" if mode == "none" else "sigmoid",
                        "--data_output_path", f"{work}/cache", "--output_dir", f"{work}/{mode}",
                        "--disable_progress_bar", "--overwrite_output_dir"])
    ref = res["reference"]
    ref_bytes = 0
    if ref.engine is not None:
        ref_bytes = sum(p.numel() * p.element_size() for p in ref.engine.module.parameters())
    import gc

    gc.collect()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    print("RESULT " + json.dumps({"mode": mode, "kind": ref.kind, "reference_param_bytes": ref_bytes,
                                  "rss_after_training_bytes": rss,
                                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
        return
    from chatrl.models.tiny import TinySpec, make_tiny_model

    work = tempfile.mkdtemp(prefix="chatrl_dpo_mem_")
    model = f"{work}/model"
    m, _ = make_tiny_model("llama", model, TinySpec(hidden=384, layers=6, heads=6, ffn=1536))
    model_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    del m
    env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    runs = {}
    for mode in ("none", "adapters_disabled", "copy"):
        out = subprocess.run([sys.executable, __file__, "--child", mode, model, work], env=env, cwd=REPO,
                             capture_output=True, text=True, check=True)
        line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
        runs[mode] = json.loads(line[len("RESULT "):])
    for key in ("rss_after_training_bytes", "peak_rss_bytes"):
        base = runs["none"][key]
        for r in runs.values():
            r[key.replace("_bytes", "_over_baseline_in_models")] = round((r[key] - base) / model_bytes, 3)
    print(json.dumps({"bench": "dpo_reference_memory", "model_param_bytes": model_bytes, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
