"""The tests behind the certificate (docs/certificate.md), each over 2 gloo ranks, many configurations
per launch:

* batch-shape invariance through the real training loops: micro-batch 4 × accumulation 1, micro-batch
  1 × accumulation 4 (one rank) and 2 ranks × micro-batch 1 × accumulation 2 give the same first-step
  gradients at ZeRO 0, 2 and 3, for SFT, the reward model, DPO, PPO and GRPO under each global loss
  aggregation; DeepSpeed-Chat's micro-batch mean, the control, does not;
* every setting of the table that can change the loss changes it (tests/stages/settings_table.py);
* kill -9 of a rank at a random step of each program, then the same command again: the final weights
  equal an uninterrupted run's bit for bit, and so do the data-accounting totals;
* each certificate property fails on a deliberately broken run with a message naming it and its
  figure, and a recorded step replays exactly (``python -m chatrl.tools.replay``).
"""

import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch

from chatrl.distributed.dist import free_port
from tests.conftest import REPO
from tests.launch import run_ranks

STAGES = REPO / "tests" / "stages"


@pytest.mark.slow
def test_gradients_do_not_depend_on_micro_batches_ranks_or_zero_stage(tmp_path):
    from tests.stages.invariance_worker import CONFIGS
    from tests.stages.loop_runs import max_rel_diff

    result, work = tmp_path / "grads", tmp_path / "work"
    result.mkdir()
    for nprocs in (1, 2):
        run_ranks([str(STAGES / "invariance_worker.py"), str(result), str(work)], nprocs=nprocs, timeout=1200)
    ref_of = {}
    for name, (program, _, zeros) in CONFIGS.items():
        reference = torch.load(result / f"{name}-zero0-mb4xacc1.pt")["grads"]
        ref_of[name] = reference
        assert len(reference) == (2 if program == "ppo" else 1)  # PPO: the actor and the critic
        assert all(g.abs().max() > 0 for grads in reference.values() for g in grads.values()), name
        if name.startswith("control"):
            continue
        for zero in zeros or (0, 2, 3):
            for layout in ("mb4xacc1", "mb1xacc4", "2xmb1xacc2"):
                got = torch.load(result / f"{name}-zero{zero}-{layout}.pt")["grads"]
                for engine, grads in reference.items():
                    diff = max_rel_diff(got[engine], grads)
                    assert diff <= 1e-5, (name, zero, layout, engine, diff)  # float32 sums in another order
    control = "control-ppo-micro-batch-token-mean"
    for layout in ("mb1xacc4", "2xmb1xacc2"):  # the split-dependent mean: the comparison can fail
        got = torch.load(result / f"{control}-zero0-{layout}.pt")["grads"]
        assert max_rel_diff(got[0], ref_of[control][0]) > 1e-3, layout


@pytest.mark.slow
def test_every_setting_that_can_change_the_loss_changes_it(tmp_path):
    from tests.stages.settings_table import TABLE

    out = tmp_path / "settings.json"
    run_ranks([str(STAGES / "settings_worker.py"), str(out), str(tmp_path / "work")], timeout=1800)
    r = json.loads(out.read_text())
    assert r["repeat"] == {"sft": 0.0, "reward": 0.0, "dpo": 0.0, "ppo": 0.0}  # a tiny run repeats bit for bit
    dead = {f"{program} --{flag}": v for program, table in TABLE.items() for flag in table
            for v in [r[program][flag]] if not v["moved"]}
    assert not dead, f"settings that moved nothing (read nowhere, or a table value that cannot act): {dead}"


def _rank_process(root_pid: int, rank: str):
    import psutil

    def rank_of(p):
        try:
            return p.environ().get("RANK")
        except psutil.Error:
            return None

    found = [c for c in psutil.Process(root_pid).children(recursive=True) if rank_of(c) == rank]
    return found[0] if found else None


@pytest.mark.slow
def test_killed_rank_then_the_same_command_ends_with_bitwise_equal_weights(tmp_path):
    from safetensors.torch import load_file

    from tests.stages.resume_worker import STEPS

    seed = int(os.environ.get("CHATRL_KILL_SEED") or random.SystemRandom().randrange(10**6))
    rng = random.Random(seed)
    print(f"kill steps drawn with CHATRL_KILL_SEED={seed}")
    out, straight, work = tmp_path / "killed", tmp_path / "straight", tmp_path / "work"
    run_ranks([str(STAGES / "resume_worker.py"), str(straight), str(work)], timeout=900)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}

    def command():
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                str(free_port()), str(STAGES / "resume_worker.py"), str(out), str(work)]

    killed_at = {}
    for name in ("sft", "reward", "dpo", "ppo"):
        step = rng.randint(1, STEPS - 1)
        proc = subprocess.Popen(command(), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        marker, t0 = out / name / "checkpoints" / f"step_{step}" / "complete.json", time.time()
        while not marker.exists():
            assert proc.poll() is None, f"{name}: the run ended before step {step}: {proc.stderr.read()[-3000:]}"
            assert time.time() - t0 < 600, f"{name}: no checkpoint of step {step} within 600 s"
            time.sleep(0.05)
        victim = _rank_process(proc.pid, "1")
        assert victim is not None
        victim.kill()  # SIGKILL
        proc.communicate(timeout=300)
        assert proc.returncode != 0
        assert not (out / name / "chatrl_run.json").exists()
        killed_at[name] = step
    final = subprocess.run(command(), env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert final.returncode == 0, final.stderr[-4000:]
    for name, weights in (("sft", "model.safetensors"), ("reward", "model.safetensors"), ("dpo", "model.safetensors"),
                          ("ppo", "actor/model.safetensors"), ("ppo", "critic/model.safetensors")):
        a, b = load_file(out / name / weights), load_file(straight / name / weights)
        assert a.keys() == b.keys()
        differ = [k for k in a if not torch.equal(a[k], b[k])]
        assert not differ, f"{name}/{weights} (killed after step {killed_at[name]}): {differ[:5]} differ"
        certificate = json.loads((out / name / "certificate.json").read_text())
        reference = json.loads((straight / name / "certificate.json").read_text())
        assert certificate["passed"] and reference["passed"], (name, certificate)
        account = {p["key"]: p for p in certificate["properties"]}["data_accounting"]
        assert account == {p["key"]: p for p in reference["properties"]}["data_accounting"]  # the totals too
        assert account["passed"] and account["details"]["epochs"][0]["seen"] > 0
    for name in ("sft", "reward", "dpo", "ppo"):  # every program was killed and resumed
        log = (out / name / "logs").glob("metrics.before-resume-*.jsonl")
        assert list(log), name


@pytest.mark.slow
def test_each_property_fails_on_a_broken_run_and_a_recorded_step_replays_exactly(tmp_path):
    out, work = tmp_path / "result.json", tmp_path / "work"
    run_ranks([str(STAGES / "certificate_worker.py"), str(out), str(work)], timeout=1200)
    r = json.loads(out.read_text())

    def props(case):
        return {p["key"]: p for p in r[case]["certificate"]["properties"]}

    healthy = props("records")  # hybrid engine, LoRA merged into a TP-2 copy, ZeRO-3: all four pass
    assert r["records"]["certificate"]["passed"] and r["records"]["error"] is None
    assert {k: p["passed"] for k, p in healthy.items()} == {"agreement": True, "weight_version": True,
                                                            "data_accounting": True, "loss_scale": True}
    assert healthy["weight_version"]["details"]["rollouts_checked"] == 3 * 2 * 2
    assert set(healthy["loss_scale"]["details"]) == {"actor", "critic"}
    plain = props("plain")["weight_version"]  # no hybrid engine: the training module (LoRA unmerged) samples
    assert plain["passed"] and plain["figure"] == 0.0 and plain["details"]["rollouts_checked"] == 2 * 2 * 2

    stale = props("stale")["weight_version"]  # caught at step 2, the first step with stale rollouts
    assert stale["passed"] is False and stale["figure"] > stale["bound"]
    assert "weight version failed at step 2" in r["stale"]["error"] and "checksum gap" in r["stale"]["error"]
    dropped = props("dropped_flag")["agreement"]
    assert dropped["passed"] is False and dropped["figure"] > 0.1
    assert "sampler/trainer agreement failed" in dropped["message"] and f"{dropped['figure']:.3g}" in dropped["message"]
    ok, twice = props("sft_ok")["loss_scale"], props("loss_twice")["loss_scale"]
    assert ok["passed"] and ok["details"]["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert twice["passed"] is False and twice["details"]["ratio"] == pytest.approx(0.5, abs=1e-5)
    assert "loss scale (model) failed" in twice["message"] and "ratio 0.5" in twice["message"]
    skipped = props("skipped_data")["data_accounting"]
    assert skipped["passed"] is False and skipped["figure"] == 8.0  # one micro-batch of 2 per rank, missing + extra
    assert "data accounting failed: 4 example draws missing and 4 extra" in skipped["message"]
    assert props("skipped_data")["loss_scale"]["passed"]  # the other properties still hold

    records = work / "records"
    proc = subprocess.run([sys.executable, "-m", "chatrl.tools.replay", str(records), "--step", "2"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"},
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "chatrl.tools.replay: step 2 replayed exactly" in proc.stdout
    replay = json.loads((records / "replay" / "step_2" / "replay.json").read_text())
    assert replay["ok"] and replay["metrics"]["actor_loss"] == replay["figures"]["actor_loss"]

    pytest.importorskip("plotly")
    from chatrl.tools.inspector import write_inspector

    html = write_inspector(records, 2).read_text()
    assert html.count('"rank":') == 2 * 2  # every rollout of the step: 2 prompts on each of 2 ranks
    assert html.count('"rank":1') == 2 and "sampler − trainer log-prob" in html
