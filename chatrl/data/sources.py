"""Reading ``--data_path`` entries: hub data sets and local files, rows to :class:`Sample`.

An entry is one of:

- a hub data set name (``Dahoas/rm-static``), loaded with ``datasets.load_dataset(name,
  split="train")`` (needs the network or a warm hub cache);
- a local ``.jsonl``, ``.json`` (a list, or ``{"data": [...]}``) or ``.parquet`` file, each
  optionally ``.gz``-compressed;
- a local folder: every such file below it, in sorted path order;

optionally followed by a row slice ``[a:b]`` (a Python slice of the rows in file order, bad rows
included), e.g. ``../shared/data/hh-rlhf/helpful-base[0:1000]``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from chatrl.data.report import SkipReport
from chatrl.data.schema import (
    KIND_PAIRS,
    RowSkip,
    Sample,
    adapt_row,
    detect_schema,
    is_identical_pair,
    schema_kind,
)

DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
_SLICE = re.compile(r"^(?P<path>.+)\[(?P<a>-?\d*):(?P<b>-?\d*)(?::(?P<c>-?\d*))?\]$")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class _BadRow:
    """A raw row that could not even be parsed (``non_utf8``, ``malformed_json``)."""

    reason: str


@dataclass
class Source:
    """Everything read from one entry.

    Attributes:
        entry: the entry as given (also its name in reports and errors).
        kind: ``"pairs"``, ``"sft"`` or ``"prompts"``: which phases it feeds.
        n_rows: raw rows after the slice, bad ones included.
        samples: the usable samples, in row order.
        sample_rows: for each sample, the index of the raw row it came from (0..n_rows-1).
        row_skips: ``{raw row index: reason}`` for every unusable raw row.
        schemas: the schema used for each file.
    """

    entry: str
    kind: str
    n_rows: int
    samples: list[Sample] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    row_skips: dict[int, str] = field(default_factory=dict)
    schemas: dict[str, str] = field(default_factory=dict)


def split_entry(entry: str) -> tuple[str, slice | None]:
    """Split ``"path[a:b]"`` into ``("path", slice(a, b))``; an existing path is never split.

    Raises:
        ValueError: a slice with step 0.
    """
    if os.path.exists(entry):
        return entry, None
    m = _SLICE.match(entry)
    if not m:
        return entry, None

    def num(s: str | None) -> int | None:
        return int(s) if s not in (None, "") else None

    sl = slice(num(m["a"]), num(m["b"]), num(m["c"]))
    if sl.step == 0:
        raise ValueError(f"{entry!r}: slice step cannot be zero")
    return m["path"], sl


def is_hub_name(path: str) -> bool:
    """True for ``owner/name`` that is not a local path and not a data file name."""
    return (not os.path.exists(path) and bool(_HUB_NAME.match(path))
            and not path.startswith(".") and _data_suffix(path) is None)


def _data_suffix(path: str) -> str | None:
    name = path[:-3] if path.endswith(".gz") else path
    return next((s for s in DATA_SUFFIXES if name.endswith(s)), None)


def data_files(path: str) -> list[Path]:
    """The data files of a local entry: the file itself, or every data file below a folder, sorted.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a file with an unsupported extension, or a folder holding no data file.
    """
    p = Path(path)
    if p.is_file():
        if _data_suffix(p.name) is None:
            raise ValueError(f"{path}: unsupported file type; use .jsonl, .json or .parquet (optionally .gz)")
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and _data_suffix(f.name) is not None
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise ValueError(f"{path}: folder holds no .jsonl/.json/.parquet(.gz) file")
        return files
    raise FileNotFoundError(f"data path not found: {path}")


def _read_bytes(f: Path) -> bytes:
    data = f.read_bytes()
    if f.name.endswith(".gz"):
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as e:
            raise ValueError(f"{f}: not a valid gzip file ({e})") from None
    return data


def _parse_jsonl(data: bytes) -> list:
    rows: list = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            rows.append(_BadRow("non_utf8"))
            continue
        try:
            rows.append(json.loads(text))
        except json.JSONDecodeError:
            rows.append(_BadRow("malformed_json"))
    return rows


def _parse_json(data: bytes, f: Path) -> list:
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{f}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{f}: not valid JSON ({e}); one record per line belongs in a .jsonl file") from None
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        obj = obj["data"]
    if not isinstance(obj, list):
        raise ValueError(f"{f}: a .json data file must hold a list of records or {{\"data\": [...]}}")
    return obj


def _parse_parquet(data: bytes, f: Path) -> list:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(pa.BufferReader(data)).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{f}: not a readable parquet file ({e})") from None


def read_rows(f: Path) -> list:
    """Raw rows of one data file, in file order; unparseable ``.jsonl`` lines become bad-row markers.

    Raises:
        ValueError: an empty file, or a ``.json`` / ``.parquet`` / ``.gz`` file that cannot be read.
    """
    data = _read_bytes(f)
    if not data.strip():
        raise ValueError(f"{f}: empty data file")
    suffix = _data_suffix(f.name)
    if suffix == ".jsonl":
        rows = _parse_jsonl(data)
    elif suffix == ".json":
        rows = _parse_json(data, f)
    else:
        rows = _parse_parquet(data, f)
    if not rows:
        raise ValueError(f"{f}: empty data file (no rows)")
    return rows


def _load_hub(name: str, sl: slice | None, entry: str):
    try:
        import datasets

        ds = datasets.load_dataset(name, split="train")
    except Exception as e:  # any failure means the same to the user: the entry cannot be read
        raise FileNotFoundError(
            f"{entry!r} is neither a local file or folder nor a loadable hub data set "
            f"({type(e).__name__}: {e}). Offline (HF_HUB_OFFLINE=1) a hub name needs a warm cache; "
            f"otherwise give a local path") from None
    if sl is not None:
        ds = ds.select(range(len(ds))[sl])
    return ds


def fingerprint_entry(entry: str, schema: str | None = None) -> dict:
    """A JSON-able description of an entry's content, for cache keys.

    Local files contribute the sha256 of their bytes (and their path relative to the entry),
    hub sets their name and ``datasets`` fingerprint; the slice and a forced schema are included.

    Raises:
        FileNotFoundError / ValueError: as :func:`read_source`.
    """
    path, sl = split_entry(entry)
    desc: dict = {"slice": [sl.start, sl.stop, sl.step] if sl else None, "schema": schema}
    if is_hub_name(path):
        ds = _load_hub(path, sl, entry)
        desc["hub"] = {"name": path, "fingerprint": ds._fingerprint}
        return desc
    root = Path(path)
    desc["files"] = [[str(f.relative_to(root)) if f != root else f.name,
                      hashlib.sha256(f.read_bytes()).hexdigest()] for f in data_files(path)]
    return desc


def _raw_rows(entry: str) -> list[tuple[str, list]]:
    """``[(file name, rows)]`` of an entry, the slice applied over the concatenated rows."""
    path, sl = split_entry(entry)
    if is_hub_name(path):
        return [(path, _load_hub(path, sl, entry).to_list())]
    per_file = [(str(f), read_rows(f)) for f in data_files(path)]
    if sl is None:
        return per_file
    owner = [i for i, (_, rows) in enumerate(per_file) for _ in rows]
    flat = [row for _, rows in per_file for row in rows]
    keep = range(len(flat))[sl]
    if len(keep) == 0:
        raise ValueError(f"{entry!r}: the slice selects no rows (the entry has {len(flat)})")
    out: dict[int, list] = {}
    for i in keep:
        out.setdefault(owner[i], []).append(flat[i])
    return [(per_file[i][0], rows) for i, rows in out.items()]


def read_source(entry: str, schema: str | None = None) -> Source:
    """Read and adapt every row of ``entry`` (see the module docstring for what an entry is).

    Args:
        entry: hub name or local path, optionally with a ``[a:b]`` row slice.
        schema: force a schema (``hh``, ``pairs``, ``alpaca``, ``sharegpt``, ``prompts``,
            ``oasst``) instead of detecting it from each file's keys.

    Raises:
        FileNotFoundError: the path does not exist (or the hub set cannot be loaded).
        ValueError: an empty file, an unknown schema (names the file and the keys it saw), files
            of different kinds in one folder, or no usable row at all (names the entry and reasons).
    """
    files = _raw_rows(entry)
    kinds: dict[str, str] = {}
    schemas: dict[str, str] = {}
    for name, rows in files:
        good = [r for r in rows if not isinstance(r, _BadRow)]
        if schema is not None:
            schemas[name], kinds[name] = schema, schema_kind(schema, good)
        elif good:
            schemas[name], kinds[name] = detect_schema(good, name)
    if len(set(kinds.values())) > 1:
        raise ValueError(f"{entry!r}: files of different kinds in one entry: {kinds}")
    kind = next(iter(kinds.values()), KIND_PAIRS)
    src = Source(entry=entry, kind=kind, n_rows=sum(len(rows) for _, rows in files), schemas=schemas)
    index = 0
    for name, rows in files:
        for row in rows:
            try:
                if isinstance(row, _BadRow):
                    raise RowSkip(row.reason)
                found = adapt_row(row, schemas[name], kind)
            except RowSkip as skip:
                src.row_skips[index] = skip.reason
            else:
                src.samples.extend(found)
                src.sample_rows.extend([index] * len(found))
            index += 1
    if not src.samples:
        report = SkipReport()
        report_rows(src, report, range(src.n_rows))
        raise ValueError(f"{entry!r}: no usable rows ({report.describe(entry)})")
    return src


def report_rows(src: Source, report: SkipReport, rows, label: str | None = None) -> None:
    """Count the raw ``rows`` (indices) of ``src`` into ``report``: rows read and load-time skips."""
    label = label or src.entry
    rows = list(rows)
    report.add_rows(label, len(rows))
    for r in rows:
        reason = src.row_skips.get(r)
        if reason is not None:
            report.skip(label, reason)


def load_samples(entry: str, schema: str | None = None, report: SkipReport | None = None) -> list[Sample]:
    """The usable :class:`Sample` s of one entry, in file order (for scoring tools and tests).

    Pairs whose answers are equal after ``strip()`` carry no preference and are skipped as
    ``identical_pair``. When ``report`` is given, the entry's rows, used samples and skips are
    counted into it.

    Raises:
        FileNotFoundError / ValueError: as :func:`read_source`; also when only identical pairs remain.
    """
    src = read_source(entry, schema)
    samples = [s for s in src.samples if not is_identical_pair(s)]
    if report is not None:
        report_rows(src, report, range(src.n_rows))
        report.skip(entry, "identical_pair", len(src.samples) - len(samples))
        report.use(entry, len(samples))
    if not samples:
        raise ValueError(f"{entry!r}: no usable rows (all {len(src.samples)} pairs are identical)")
    return samples
