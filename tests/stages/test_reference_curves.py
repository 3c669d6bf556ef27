"""Learning curves CI guards: PPO, GRPO, RLOO, REINFORCE++ and DPO on one seeded tiny set-up each (2 CPU
ranks, 20 steps, from one short step 1), whose reward, KL, EOS rate and win rate over the starting model
at steps 5, 10, 15 and 20 must stay inside the bands stored in ``tests/reference_curves/`` (the range
over three seeds, widened; ``tests/reference_curves/curves.py``). A deliberate change regenerates them
with ``scripts/reference_curves.py`` and shows as a reviewed diff."""

from __future__ import annotations

import pytest

from tests.reference_curves.curves import (
    EVAL,
    SETUPS,
    SFT,
    STEPS,
    band,
    load,
    outside,
    portable,
    run_setup,
    sft_base,
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return sft_base(tmp_path_factory.mktemp("curves"))


def test_band_is_the_seed_range_widened_by_half_plus_the_floor():
    assert band([1.0, 1.2, 1.1], 0.05) == pytest.approx((0.85, 1.35))
    assert band([0.5, 0.5, 0.5], 0.05) == pytest.approx((0.45, 0.55))


def test_outside_names_each_figure_that_leaves_its_band():
    ref = {"setup": "x", "figures": {"kl": {"5": {"value": 1.0, "seeds": [1.0], "low": 0.9, "high": 1.1}}}}
    assert outside(ref, {"kl": {5: 1.05}}) == []
    (line,) = outside(ref, {"kl": {5: 1.2}})
    assert line.startswith("x kl at step 5: 1.2000 outside [0.9000, 1.1000]")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SETUPS))
def test_curve_stays_in_its_band(name, base, tmp_path):
    ref = load(name)
    same = (ref["flags"], ref["sft_flags"], ref["eval_flags"]) == (portable(SETUPS[name]), portable(SFT), portable(EVAL))
    assert same, f"{name}: the set-up changed; regenerate with {ref['regenerate']}"
    assert ref["steps"] == list(STEPS)
    figures = run_setup(name, ref["seeds"][0], tmp_path, base)
    print(name, figures)
    bad = outside(ref, figures)
    assert not bad, "\n".join(bad) + f"\nIf the change is deliberate: {ref['regenerate']}"
