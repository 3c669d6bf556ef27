"""``python -m chatrl.replay OUTPUT --step N``: exact replay of a recorded step-3 training step.

The program lives with step 3 (:mod:`chatrl.step3_ppo.replay`, which documents it); this module is its
command name.
"""

from chatrl.step3_ppo.replay import main

if __name__ == "__main__":
    main()
