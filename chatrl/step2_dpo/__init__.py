"""Step 2, alternative: direct preference optimisation (``python -m chatrl.step2_dpo``).

The loss maths is in :mod:`chatrl.step2_dpo.loss`, the reference model in
:mod:`chatrl.step2_dpo.reference`, batches in :mod:`chatrl.step2_dpo.batch`.
"""
