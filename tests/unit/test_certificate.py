"""The certificate's parts on one process, with hand-derived figures: the value loss as a share of the
step's token mean, per-token clip flags, the weight fingerprint read from a LoRA training module and
from its merged (and tensor-parallel) copy, the weight-version check, the data accounting against the
sampler's order (a skipped batch, a resume), the loss-scale probe, the certificate file, the rollout
records and the replay's first differing quantity."""

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

from chatrl.evidence.certificate import (
    Certificate,
    DataAccounting,
    LossScaleProbe,
    Property,
    agreement_property,
    read_certificate,
)
from chatrl.evidence.weight_version import (
    WeightFingerprint,
    WeightStamp,
    WeightVersionCheck,
    WeightVersionError,
)
from chatrl.rl import core
from chatrl.rl.loss import PolicyLossSettings, policy_loss


def test_critic_loss_with_the_step_normaliser_is_a_share_of_the_step_mean():
    values = torch.tensor([[1.0, 2.0, 0.0], [0.5, 0.0, 0.0]], requires_grad=True)
    returns = torch.tensor([[0.0, 2.0, 9.0], [1.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # unclipped (old = values): 0.5 * (1, 0, 1) over 3 tokens; as a share of a 6-token step: 1 / 6
    mean, _ = core.critic_loss(values, values.detach(), returns, mask, None)
    share, _ = core.critic_loss(values, values.detach(), returns, mask, None, normalizer=6.0)
    assert mean.item() == pytest.approx(1 / 3) and share.item() == pytest.approx(1 / 6)
    share.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[1 / 6, 0.0, 0.0], [-1 / 6, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        core.critic_loss(values, values.detach(), returns, mask, None, normalizer=0.0)


def test_policy_loss_reports_each_token_s_ratio_and_clip_side():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 2.0]]))  # ratios 1.5, 0.5, 1.1, 2.0
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    stats: dict = {}
    policy_loss(logp, old, adv, mask, 3.0, PolicyLossSettings(cliprange_low=0.2), token_stats=stats)
    torch.testing.assert_close(stats["ratio"], torch.tensor([[1.5, 0.5, 1.1, 1.0]]))  # 1 where masked
    # A > 0 and ratio 1.5 > 1.2: the upper clip removes the gradient; A < 0 and 0.5 < 0.8: the lower one
    assert stats["clip"].tolist() == [[1, -1, 0, 0]]


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg).float().eval()


def test_fingerprint_of_a_lora_actor_equals_its_merged_copy_and_sees_one_step():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # a trained adapter (peft starts B at 0)
    fp = WeightFingerprint(model)
    assert len(fp) == 4 * 4  # the 4 LoRA layers (2 per decoder layer), 4 elements each
    assert all(e.module.endswith(("q_proj", "down_proj")) for e in fp.elements)
    checksum, bound = fp.training()
    merged = copy.deepcopy(model).merge_and_unload()  # what the hybrid engine's copy holds
    assert abs(fp.of_copy(merged) - checksum) <= bound and 0 < bound < 1e-5
    with torch.no_grad():  # one optimizer step's worth on the adapters only
        for n, p in model.named_parameters():
            if "lora_A" in n:
                p.add_(1e-4)
    assert abs(fp.training()[0] - checksum) > 100 * bound


def test_fingerprint_of_a_tensor_parallel_copy_is_the_sum_of_its_shards():
    from torch.distributed.tensor import Replicate, Shard

    model = _tiny_llama()
    fp = WeightFingerprint(model)
    full, bound = fp.training()
    assert bound == 0.0 and fp.of_copy(model) == full  # a plain copy: bit for bit
    placements, shards = {}, [copy.deepcopy(model) for _ in range(2)]
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "layers" in name:
            dim = 0 if name.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")) else 1
            placements[f"{name}.weight"] = (Shard(dim),)
            for r, shard in enumerate(shards):
                w = shard.get_submodule(name).weight
                size = w.shape[dim] // 2
                shard.get_submodule(name).weight = torch.nn.Parameter(w.narrow(dim, r * size, size).clone())
    placements["model.embed_tokens.weight"] = (Replicate(),)
    parts = [fp.of_copy(shard, placements, tp_rank=r, tp_size=2) for r, shard in enumerate(shards)]
    assert sum(parts) == pytest.approx(full, rel=1e-12, abs=1e-12)


def test_weight_version_check_raises_on_a_stale_version_or_checksum():
    check = WeightVersionCheck()
    ok = WeightStamp(3, 0.25, 1e-7)
    check.check(torch.tensor([3, 3]), torch.tensor([0.25, 0.25 + 5e-8], dtype=torch.float64), ok, step=4)
    assert (check.rollouts, check.versions, check.failure) == (2, [3], None) and check.max_gap == pytest.approx(5e-8)
    with pytest.raises(WeightVersionError, match=r"weight version failed at step 5: 1 of 2 rollouts .* version 2"):
        check.check(torch.tensor([3, 2]), torch.tensor([0.25, 0.25], dtype=torch.float64), ok, step=5)
    with pytest.raises(WeightVersionError, match=r"largest checksum gap 0\.001 > bound 1e-07"):
        check.check(torch.tensor([3]), torch.tensor([0.251], dtype=torch.float64), ok, step=6)
    assert "stale" in check.failure


class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return {"x": torch.tensor([i])}


def _loader(batch_size: int = 2):
    from chatrl.distributed.dist import DistInfo, seeded_loader

    def collate(items):
        return {"x": torch.cat([it["x"] for it in items])}

    return seeded_loader(_Rows(), batch_size, collate, DistInfo(0, 1, 0, torch.device("cpu")), seed=3, drop_last=True)


def _train(acc: DataAccounting, loader, steps: range, steps_per_epoch: int, skip: int = 0):
    from chatrl.checkpoint import batches_from

    for step in steps:
        it = batches_from(loader, step, steps_per_epoch, 1)
        for _ in range(skip):
            next(it)
        batch = next(it)
        assert torch.equal(batch["x"], batch["sample_index"])  # the loader's indices are the items'
        acc.record(step // steps_per_epoch, batch)


def test_data_accounting_against_the_sampler_order():
    loader = _loader()
    acc = DataAccounting(loader, steps_per_epoch=5, batches_per_step=1, skipped={"too_long": 3})
    _train(acc, loader, range(7), 5)  # one epoch and 2 steps of the next
    prop = acc.finish(7)
    assert prop.passed and prop.figure == 0.0
    first, second = prop.details["epochs"]
    assert (first["seen"], first["repeated"], first["complete"]) == (10, 0, True)
    assert (second["seen"], second["steps"], second["not_seen"]) == (4, 2, {"not reached (the run ended in this "
                                                                             "epoch)": 6})
    assert prop.details["skipped_by_pipeline"] == {"too_long": 3} and "3 too_long" in prop.message
    # a resume from step 3 whose loader starts one step early: step 3's batch again, the epoch's last never
    acc = DataAccounting(loader, 5, 1)
    _train(acc, loader, range(3), 5)
    resumed = DataAccounting(loader, 5, 1)
    resumed.load_state_dict(acc.state_dict())
    _train(resumed, loader, [2, 3], 5)  # the batches of steps 3 and 4, trained as steps 4 and 5
    bad = resumed.finish(5)
    assert bad.passed is False and bad.figure == 4.0 and "2 example draws missing and 2 extra" in bad.message
    # a resume done right gives the uninterrupted totals
    right = DataAccounting(loader, 5, 1)
    right.load_state_dict(acc.state_dict())
    _train(right, loader, [3, 4], 5)
    straight = DataAccounting(loader, 5, 1)
    _train(straight, loader, range(5), 5)
    assert right.finish(5).details == straight.finish(5).details
    with pytest.raises(ValueError, match="counted 10 examples, this run has 9"):
        DataAccounting(SimpleNamespace(dataset=range(9)), 5, 1).load_state_dict(acc.state_dict())


def test_loss_scale_probe_compares_the_first_step_with_one_micro_batch():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def loss(m, parts):
        idx = torch.cat([torch.cat(p) for p in parts])
        return ((m(x[idx]) - y[idx]) ** 2).mean()

    reference = copy.deepcopy(model)
    loss(reference, [[torch.arange(8)]]).backward()
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in reference.parameters()))
    items = [torch.arange(4), torch.arange(4, 8)]  # two micro-batches of this rank
    good = LossScaleProbe.start(model, "fp32", True, False).check(norm * (1 + 1e-5), items, loss)
    assert good.passed and good.figure == pytest.approx(1e-5, rel=1e-2) and good.bound == 1e-3
    bad = LossScaleProbe.start(model, "fp32", True, False).check(norm / 2, items, loss)
    assert bad.passed is False and bad.details["ratio"] == pytest.approx(0.5) and "ratio 0.5" in bad.message
    dropped = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Dropout(0.1))
    skipped = LossScaleProbe.start(dropped, "fp32", True, False)
    assert not skipped.active and "dropout 0.1 is on" in skipped.property_unchecked().message
    assert LossScaleProbe.start(model, "fp32", True, True).property_unchecked().passed is None  # resumed


def test_loss_scale_probe_borrows_the_engines_zeroed_gradient_buffer():
    """The probe's copy puts its gradients in the trained engine's flat gradient buffer when that holds
    zeros (between an optimizer step and the next backward): the same figure to the bit as with
    gradients of its own, no gradient left on the copy, the buffer zero again; a buffer that holds
    gradients, or of another size, is left alone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def loss(m, parts):
        idx = torch.cat([torch.cat(p) for p in parts])
        return ((m(x[idx]) - y[idx]) ** 2).mean()

    items = [torch.arange(4), torch.arange(4, 8)]
    own = LossScaleProbe.start(model, "fp32", True, False).check(1.0, items, loss)
    size = sum(p.numel() for p in model.parameters())
    probe = LossScaleProbe.start(model, "fp32", True, False)
    copy_ = probe.copy
    buffer = torch.zeros(size)
    probe.use_gradient_buffer(buffer)
    assert probe._gradients_in_buffer(copy_)
    seen = [p.grad.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr() for p in copy_.parameters()]
    copy_.zero_grad(set_to_none=True)
    borrowed = probe.check(1.0, items, loss)
    assert all(seen)
    assert borrowed.details["one_micro_batch_grad_norm"] == own.details["one_micro_batch_grad_norm"] > 0
    assert not buffer.any() and all(p.grad is None for p in copy_.parameters())
    busy = LossScaleProbe.start(model, "fp32", True, False)
    busy.use_gradient_buffer(torch.ones(size))  # gradients accumulating: not borrowed, not zeroed
    assert not busy._gradients_in_buffer(busy.copy) and busy.gradient_buffer.sum() == size
    busy.use_gradient_buffer(torch.zeros(size + 1))
    assert not busy._gradients_in_buffer(busy.copy)


def test_certificate_file_and_agreement_bounds(tmp_path):
    c = Certificate(tmp_path, "step 3 (ppo)")
    c.add(agreement_property(8e-6, "fp32", steps=40))
    c.add(Property("data_accounting", 0.0, 0, True, "data accounting passed"))
    c.write()
    d = read_certificate(tmp_path)
    assert d["passed"] and [p["name"] for p in d["properties"]] == ["sampler/trainer agreement", "data accounting"]
    assert d["properties"][0]["bound"] == 1e-4 and "8e-06 nats" in d["properties"][0]["message"]
    failed = agreement_property(0.3, "fp32", steps=2)
    assert failed.passed is False and "0.3 nats (> the fp32 bound 0.0001)" in failed.message
    assert agreement_property(0.3, "bf16").passed  # bf16's declared bound is 0.5
    c.add(failed)
    assert not c.passed and read_certificate(tmp_path / "none") is None


def _experience(seed: int = 0):
    from chatrl.step3_ppo.trainer import Experience

    g = torch.Generator().manual_seed(seed)
    B, P, A = 2, 3, 4
    action = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    exp = Experience(torch.randint(3, 30, (B, P + A), generator=g), torch.ones(B, P + A, dtype=torch.long), P, action,
                     -torch.rand(B, A, generator=g), torch.tensor([0.5, -0.25]), {"reward/score_fn": torch.tensor([1.0, 2.0])},
                     [{"id": 0}, {"id": 1}], weight_version=torch.tensor([4, 4]),
                     weight_checksum=torch.tensor([0.125, 0.125], dtype=torch.float64))
    for name in ("ref_logp", "logp", "entropy", "kl", "advantages"):
        setattr(exp, name, torch.randn(B, A, generator=g) * action)
    return exp


def test_rollout_record_round_trip_and_the_first_differing_quantity(tmp_path):
    from chatrl.evidence.rollout_records import (
        compare_figures,
        compare_rank,
        read_step,
        recorded_steps,
        write_step,
    )
    from chatrl.step3_ppo.replay import recorded_experience

    exp = _experience()
    trace = {"ratio": [torch.ones(2, 4)], "clip": [torch.zeros(2, 4, dtype=torch.int8)], "actor_grad_norm": [0.5]}
    index = {"args": {}, "tokenizer": None, "figures": {"actor_loss": 0.1, "actor_grad_norm": [0.5]}}
    write_step(tmp_path, 6, 0, 1, exp, trace, index)
    assert recorded_steps(tmp_path) == [6]
    got_index, ranks = read_step(tmp_path, 6)
    assert got_index["step"] == 6 and ranks[0]["metadata"] == [{"id": 0}, {"id": 1}]
    back = recorded_experience(ranks[0], "cpu")
    assert torch.equal(back.sequences, exp.sequences) and back.weight_version.tolist() == [4, 4]
    assert compare_rank(ranks[0], exp, trace, 0.0) == []  # the same numbers: nothing differs
    replayed = copy.deepcopy(exp)
    replayed.logp[1, 1] += 1e-6
    replayed.advantages[0, 0] += 1.0
    diffs = sorted(compare_rank(ranks[0], replayed, trace, 0.0))
    assert diffs[0][1].startswith("logp on rank 0 at (1, 1) (1 of 8 elements differ): recorded ")  # computed first
    assert "advantages" in diffs[1][1]
    assert compare_rank(ranks[0], replayed, trace, 1e-5)[0][1].startswith("advantages")  # --atol 1e-5
    assert compare_figures(got_index["figures"], {"actor_grad_norm": [0.5]}, {"actor_loss": 0.1}, 0.0) == []
    assert compare_figures(got_index["figures"], {"actor_grad_norm": [0.25]}, {"actor_loss": 0.1}, 0.0)[0][1] == \
        "actor_grad_norm of optimizer step 1: recorded 0.5, replayed 0.25"
    with pytest.raises(FileNotFoundError, match="recorded steps: 6"):
        read_step(tmp_path, 7)


def test_inspector_page_of_a_record_and_a_diff(tmp_path):
    pytest.importorskip("plotly")
    from chatrl.evidence.rollout_records import write_step
    from chatrl.tools.inspector import build_html
    from tests.conftest import STORIES

    for run, seed in (("a", 0), ("b", 1)):
        exp = _experience(seed)
        trace = {"ratio": [torch.full((2, 4), 1.1)], "clip": [torch.tensor([[1, 0, 0, 0], [0, -1, 0, 0]], dtype=torch.int8)]}
        write_step(tmp_path / run, 2, 0, 1, exp, trace, {"args": {}, "tokenizer": str(STORIES), "ppo_epochs": 1,
                                                         "figures": {"actor_loss": 0.1, "metrics": {"kl": 0.01}}})
    page = build_html(tmp_path / "a", 2, tmp_path / "b")
    data = json.loads(page.split('id="inspector-data">')[1].split("</script>")[0])
    assert len(data["runs"]) == 2 and [len(r["samples"]) for r in data["runs"]] == [2, 2]
    s = data["runs"][0]["samples"][0]
    assert s["tokens"]["mask"] == [1, 1, 1, 0] and s["tokens"]["clip"] == [[1, 0, 0, 0]]  # the answer and one pad
    assert s["parts"] == {"score_fn": 1.0} and (s["version"], s["checksum"]) == (4, 0.125) and s["length"] == 3
    assert {c[0] for c in data["colourings"]} >= {"mask", "advantages", "logp_gap", "ratio", "clip", "kl"}
    assert page.count("Plotly.newPlot") >= 4  # histograms of the per-token quantities


def test_loss_scale_reference_in_parts_has_the_one_piece_gradient(tiny_llama):
    """Step 1's and step 2's probe references come in parts of a few sequences (a real model's global
    batch never holds its activations at once): the parts' summed gradient is the one-piece loss's."""
    from transformers import AutoModelForCausalLM

    from chatrl.data.collate import PairCollator, SFTCollator
    from chatrl.models.causal_lm import load_tokenizer
    from chatrl.models.reward_model import load_reward_model, pairwise_losses
    from chatrl.step1_sft.loss import token_nll
    from chatrl.step1_sft.main import one_batch_loss as sft_reference
    from chatrl.step2_reward.main import one_batch_loss as reward_reference
    from chatrl.step2_reward.main import split_pairs

    g = torch.Generator().manual_seed(0)
    sft_rows = [{"input_ids": torch.randint(3, 250, (int(n),), generator=g), "prompt_len": int(n) // 3}
                for n in torch.randint(6, 20, (10,), generator=g)]
    pair_rows = [{"chosen_input_ids": torch.randint(3, 250, (int(n),), generator=g),
                  "rejected_input_ids": torch.randint(3, 250, (int(n) + 2,), generator=g)}
                 for n in torch.randint(6, 20, (9,), generator=g)]
    parts = [[torch.arange(0, 3), torch.arange(3, 5)], [torch.arange(5, len(sft_rows) - 1)]]  # two ranks' micro-batches

    def grads(model, loss):
        model.zero_grad(set_to_none=True)
        total = sum(part for part in loss)  # noqa: C419 (tensors)
        total.backward()
        return float(total), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    lm = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    sft = SFTCollator(0)
    chunked = sft_reference(sft_rows, sft)(lm, parts)
    assert not isinstance(chunked, torch.Tensor)  # parts: 9 sequences in parts of 4
    loss, grad = grads(lm, chunked)
    b = sft([sft_rows[i] for p in parts for idx in p for i in idx.tolist()])
    nll, n = token_nll(lm(b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
    one_loss, one_grad = grads(lm, [nll / n])
    assert loss == pytest.approx(one_loss, rel=1e-6) and torch.allclose(grad, one_grad, rtol=1e-4, atol=1e-7)

    rm = load_reward_model(str(tiny_llama), load_tokenizer(str(tiny_llama)), require_head=False)
    pairs = PairCollator(0)
    loss, grad = grads(rm, reward_reference(pair_rows, pairs)(rm, [[torch.arange(0, 9)]]))
    b = pairs(pair_rows)
    chosen, rejected = split_pairs(rm(b["input_ids"], b["attention_mask"]).end_scores)
    one_loss, one_grad = grads(rm, [pairwise_losses(chosen, rejected, None).mean()])
    assert loss == pytest.approx(one_loss, rel=1e-6) and torch.allclose(grad, one_grad, rtol=1e-4, atol=1e-7)
