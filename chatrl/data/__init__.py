"""chatrl's data layer: sources and schemas, prompt formatting, phase split, token cache, collators.

Typical use in a step::

    data = build_phase_data(1, settings.data, tokenizer, seed=seed)
    loader = DataLoader(data.train, collate_fn=SFTCollator(tokenizer.pad_token_id), ...)
"""

from chatrl.data.collate import PairCollator, PromptCollator, SFTCollator
from chatrl.data.formatting import encode_answer, encode_example, encode_prompt, format_answer, format_prompt
from chatrl.data.pipeline import PhaseData, build_phase_data, prompt_batches, ptx_batches
from chatrl.data.report import SkipReport
from chatrl.data.schema import Sample
from chatrl.data.sources import load_samples
from chatrl.data.split import parse_data_split

__all__ = [
    "PairCollator",
    "PhaseData",
    "PromptCollator",
    "SFTCollator",
    "Sample",
    "SkipReport",
    "build_phase_data",
    "encode_answer",
    "encode_example",
    "encode_prompt",
    "format_answer",
    "format_prompt",
    "load_samples",
    "parse_data_split",
    "prompt_batches",
    "ptx_batches",
]
