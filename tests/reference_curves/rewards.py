"""The rule reward of the reference-curve set-ups: how much an answer writes the letter "e"."""


def letter_e(prompts, answers, metadata):
    """``10 × (share of the answer's characters that are "e" or "E")``: about 1 for English text, 0 for an
    empty answer or one without the letter."""
    return [10.0 * sum(c in "eE" for c in a) / max(len(a), 1) for a in answers]
