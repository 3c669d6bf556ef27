"""Every setting of every training program is either in the table of settings that can change the loss
(each with a non-default value that the stage test must see move the loss) or in the commented list
of settings that cannot: enumerated from each program's settings dataclass, so a new setting must be
placed. The table's values parse with the program's own parser."""

import pytest

from chatrl import config
from chatrl.step1_sft.main import Step1Settings
from chatrl.step1_sft.main import build_parser as step1_parser
from chatrl.step2_dpo.main import DPOSettings
from chatrl.step2_dpo.main import build_parser as dpo_parser
from chatrl.step2_reward.main import Step2Settings
from chatrl.step2_reward.main import build_parser as step2_parser
from chatrl.step3_ppo.main import build_parser as step3_parser
from chatrl.step3_ppo.settings import Step3Settings
from tests.stages.settings_table import CANNOT_CHANGE, TABLE
from tests.stages.settings_worker import variant_argv

PROGRAMS = {"sft": (Step1Settings, step1_parser), "reward": (Step2Settings, step2_parser),
            "dpo": (DPOSettings, dpo_parser), "ppo": (Step3Settings, step3_parser)}


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_every_setting_is_in_the_table_or_cannot_change_the_loss(program):
    settings_cls, parser = PROGRAMS[program]
    flags = config.setting_flags(settings_cls)
    assert set(flags) == {a.dest for a in parser()._actions} - {"help"}  # the dataclass is the parser
    table, cannot = set(TABLE[program]), set(CANNOT_CHANGE[program])
    assert not table & cannot, f"in both lists: {sorted(table & cannot)}"
    missing = sorted(set(flags) - table - cannot)
    assert not missing, (f"{program}: settings neither in TABLE (they change the loss: give a value) nor in "
                         f"CANNOT_CHANGE (say why they cannot): {missing}")
    assert not (table | cannot) - set(flags), f"not settings of {program}: {sorted((table | cannot) - set(flags))}"


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_table_values_parse_and_differ_from_the_defaults(program, tmp_path):
    settings_cls, parser = PROGRAMS[program]
    p = parser()
    defaults = {a.dest: a.default for a in p._actions}
    paths = {"perturbed": str(tmp_path), "reward_model": str(tmp_path), "reward_url": "http://127.0.0.1:1/"}
    for flag in TABLE[program]:
        args = p.parse_args(variant_argv(program, flag, tmp_path / "out", tmp_path, paths))
        got = getattr(args, flag)
        assert got != defaults[flag], (flag, got)
        config.read(settings_cls, args)  # the typed blocks accept it
