"""Step 1: supervised fine-tuning (``python -m chatrl.step1_sft``)."""
