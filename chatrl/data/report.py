"""Counting what each data source gave and what it lost, and saying so in one paragraph."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

# Reasons a row is skipped (others, such as bad_transcript or no_pair, come from the adaptors).
SKIP_REASONS = ("malformed_json", "non_utf8", "missing_field", "empty_field", "wrong_type",
                "identical_pair", "too_long")


@dataclass
class SourceCounts:
    """Counts for one source: raw ``rows`` read, samples ``used``, ``skipped`` by reason, and
    ``truncated`` (prompts kept but cut from the left)."""

    rows: int = 0
    used: int = 0
    skipped: Counter = field(default_factory=Counter)
    truncated: int = 0


class SkipReport:
    """Per-source counts of rows read, used, skipped (by reason) and truncated.

    Sources appear in the order they are first mentioned. ``str(report)`` is :meth:`summary`.
    """

    def __init__(self):
        self.sources: dict[str, SourceCounts] = {}

    def _get(self, source: str) -> SourceCounts:
        return self.sources.setdefault(source, SourceCounts())

    def add_rows(self, source: str, n: int = 1) -> None:
        """Record ``n`` raw rows read from ``source``."""
        self._get(source).rows += n

    def use(self, source: str, n: int = 1) -> None:
        """Record ``n`` samples of ``source`` kept."""
        self._get(source).used += n

    def skip(self, source: str, reason: str, n: int = 1) -> None:
        """Record ``n`` rows of ``source`` skipped for ``reason``."""
        if n:
            self._get(source).skipped[reason] += n

    def truncate(self, source: str, n: int = 1) -> None:
        """Record ``n`` prompts of ``source`` cut from the left (kept)."""
        self._get(source).truncated += n

    def skipped(self, source: str) -> dict[str, int]:
        """``{reason: count}`` for ``source`` (empty if nothing was skipped or the source is unknown)."""
        counts = self.sources.get(source)
        return dict(counts.skipped) if counts else {}

    def counts(self, source: str) -> SourceCounts:
        """The :class:`SourceCounts` of ``source``. Raises KeyError for an unknown source."""
        return self.sources[source]

    def merge(self, other: SkipReport) -> None:
        """Add ``other``'s counts into this report."""
        for name, c in other.sources.items():
            mine = self._get(name)
            mine.rows += c.rows
            mine.used += c.used
            mine.skipped.update(c.skipped)
            mine.truncated += c.truncated

    def describe(self, source: str) -> str:
        """One clause: ``"helpful-base: 2354 rows, 2352 used, skipped 2 identical_pair"``."""
        c = self.sources[source]
        text = f"{source}: {c.rows} rows, {c.used} used"
        if c.skipped:
            text += ", skipped " + ", ".join(f"{n} {r}" for r, n in sorted(c.skipped.items()))
        if c.truncated:
            text += f", truncated {c.truncated}"
        return text

    def summary(self) -> str:
        """One paragraph: :meth:`describe` of every source, joined by ``"; "``."""
        if not self.sources:
            return "no data sources"
        return "; ".join(self.describe(s) for s in self.sources) + "."

    __str__ = summary

    def to_dict(self) -> dict:
        """A JSON-able form (for the token cache); :meth:`from_dict` inverts it."""
        return {name: {"rows": c.rows, "used": c.used, "skipped": dict(c.skipped), "truncated": c.truncated}
                for name, c in self.sources.items()}

    @classmethod
    def from_dict(cls, data: dict) -> SkipReport:
        """Rebuild a report from :meth:`to_dict` output."""
        report = cls()
        for name, c in data.items():
            report.sources[name] = SourceCounts(c["rows"], c["used"], Counter(c["skipped"]), c["truncated"])
        return report
