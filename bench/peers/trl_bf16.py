"""Run a TRL harness script with ``bf16=True`` in every trainer config it builds (TRL venv only).

    python trl_bf16.py SCRIPT [ARGS ...]

The script (e.g. ``../shared/baselines/trl/scripts/ppo.py``, which hard-codes ``bf16=False``) runs as
``__main__`` unchanged, except that ``transformers.TrainingArguments.__post_init__`` (which every TRL
config, ``PPOConfig`` included, runs) first sets ``bf16=True`` and ``fp16=False``: HF's mixed precision,
the models' weights in the dtype the script loads them in and their forwards under
``torch.autocast(bfloat16)``, which is what a TRL user's ``bf16=True`` does.
"""

import runpy
import sys

import transformers

_post_init = transformers.TrainingArguments.__post_init__


def _bf16_post_init(self):
    self.bf16, self.fp16 = True, False
    _post_init(self)


transformers.TrainingArguments.__post_init__ = _bf16_post_init

if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
