"""The on-disk token cache: content-addressed keys and ``datasets`` folders.

A cache entry lives in ``cache_dir/<key>/`` (``train/`` and ``eval/`` written by
``datasets.Dataset.save_to_disk``, plus ``report.json``). An empty split is written as no folder
(``datasets`` cannot read back an empty saved dataset) and read back as an empty dataset, and an
entry is loaded once from its temporary folder before it is renamed into place, so an entry that
cannot be read is never left behind. The key is the sha256 of a canonical
JSON of every input that changes the content (data bytes, slices, tokenizer, formatting version,
lengths, split, seed, phase, evaluation settings), so a stale entry is never read and the key is
the same in every process (no Python ``hash``). Rank 0 builds while the other ranks wait at
:func:`chatrl.distributed.dist.barrier`; the folder is written atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

from chatrl.data.examples import PHASE_COLUMNS
from chatrl.data.report import SkipReport
from chatrl.distributed import dist
from chatrl.distributed.weights import atomic_dir

log = logging.getLogger(__name__)

# Bump when the cached layout or the building rules change.
CACHE_VERSION = 4

Columns = dict[str, list]


def tokenizer_fingerprint(tokenizer) -> dict:
    """What identifies a tokenizer's behaviour: a hash of its full serialisation, special tokens,
    chat template and class.

    A fast tokenizer is serialised with ``backend_tokenizer.to_str()`` (vocabulary, merges,
    normaliser, post-processor, added tokens); a slow one by its vocabulary and vocab file bytes.
    """
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode("utf-8"))
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode("utf-8"))
        vocab_file = getattr(tokenizer, "vocab_file", None)
        if vocab_file and Path(vocab_file).is_file():
            h.update(Path(vocab_file).read_bytes())
    special = {name: [getattr(tokenizer, f"{name}_token", None), getattr(tokenizer, f"{name}_token_id", None)]
               for name in ("bos", "eos", "pad", "unk")}
    return {
        "class": type(tokenizer).__name__,
        "serialisation": h.hexdigest(),
        "special": special,
        "all_special_ids": sorted(tokenizer.all_special_ids),
        "len": len(tokenizer),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }


def cache_key(spec: dict) -> str:
    """sha256 hex digest of ``spec`` as canonical JSON (sorted keys, no spaces, ASCII)."""
    text = json.dumps({"cache_version": CACHE_VERSION, **spec}, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _features(phase: int):
    import datasets

    ids = datasets.List(datasets.Value("int32"))
    kinds = {"prompt_len": datasets.Value("int32"), "metadata": datasets.Value("string"),
             "messages": datasets.Value("string")}
    return datasets.Features({c: kinds.get(c, ids) for c in PHASE_COLUMNS[phase]})


def to_hf_dataset(phase: int, columns: Columns):
    """An in-memory ``datasets.Dataset`` of ``phase``'s columns (empty columns allowed)."""
    import datasets

    return datasets.Dataset.from_dict(columns, features=_features(phase))


@contextlib.contextmanager
def _quiet_datasets():
    """No ``datasets`` progress bars for the block (the previous setting is restored)."""
    from datasets.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    was_disabled = are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            enable_progress_bars()


def load_or_build(phase: int, key: str, cache_dir: str,
                  build: Callable[[], tuple[Columns, Columns, SkipReport]]):
    """``(train, eval, report)`` from ``cache_dir/key``, building it on rank 0 first if absent.

    Every rank must call this. ``build`` runs on rank 0 only; the others wait at the barrier and
    then load the folder. ``train``/``eval`` are ``datasets.Dataset`` s.

    Raises:
        RuntimeError: on ranks other than 0, when rank 0 failed to write the entry (rank 0
            re-raises its own error).
    """
    final = Path(cache_dir) / key
    if dist.is_main() and not (final / "report.json").is_file():
        try:
            train, evals, report = build()
            with atomic_dir(final) as tmp, _quiet_datasets():
                for name, columns in (("train", train), ("eval", evals)):
                    if columns[PHASE_COLUMNS[phase][0]]:
                        to_hf_dataset(phase, columns).save_to_disk(str(tmp / name))
                (tmp / "report.json").write_text(json.dumps(report.to_dict(), indent=1))
                _read_entry(phase, tmp)  # an entry that cannot be read back is not kept
            log.info("wrote data cache %s", final)
        except BaseException:
            dist.barrier()  # release the waiting ranks; they fail on the missing folder
            raise
    dist.barrier()
    if not (final / "report.json").is_file():
        raise RuntimeError(f"data cache {final} was not written: rank 0 failed building it (see its log)")
    return _read_entry(phase, final)


def _read_entry(phase: int, folder: Path):
    """``(train, eval, report)`` of a cache entry folder; a split without a folder is empty."""
    import datasets

    report = SkipReport.from_dict(json.loads((folder / "report.json").read_text()))
    splits = [datasets.load_from_disk(str(folder / name)) if (folder / name).is_dir()
              else to_hf_dataset(phase, {k: [] for k in PHASE_COLUMNS[phase]}) for name in ("train", "eval")]
    return splits[0], splits[1], report
