"""Judges for the evaluation tests, loaded by ``--judge tests/unit/eval_judges.py:NAME``."""

COMMON = {"the", "a", "and", "was", "he", "she", "to", "it", "they", "her", "his", "in", "of", "said", "with", "is",
          "i", "you", "on", "that", "day", "time", "little", "big", "there", "very", "happy", "one", "upon", "once",
          "had", "were", "mom", "friend", "play", "saw", "wanted", "not", "so", "but", "we", "can", "what", "are",
          "i'm", "sorry", "for", "your", "me", "my", "go", "let's", "come", "out", "some", "no", "yes", "do", "be",
          "good", "like", "this", "have", "all", "at", "up", "look", "something", "sometimes", "two", "instead"}


def english_words(prompts, answers, metadata):
    """Share of an answer's words that are common English words (a pretrained model writes them, a
    random-init one writes word pieces at random)."""
    out = []
    for a in answers:
        words = [w.strip(".,!?\"'").lower() for w in a.split()]
        out.append(sum(w in COMMON for w in words) / max(len(words), 1))
    return out


def first_position_biased(prompts, first, second):
    """A pairwise judge with a position bias: P(first is better) = 0.8 when both are equally long, 0.9
    when the first is longer, 0.7 when it is shorter (so, asked in both orders: 0.5 ± 0.1)."""
    return [0.8 + 0.1 * ((len(a) > len(b)) - (len(a) < len(b))) for a, b in zip(first, second, strict=True)]


first_position_biased.pairwise = True


def not_numbers(prompts, answers, metadata):
    """A broken judge: returns text."""
    return ["good"] * len(answers)
