"""Objects named on the command line: ``module:name``, ``path/to/file.py:name`` or a built-in's short
name (``--reward_fn exact_match``, ``--env calculator``)."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from chatrl.errors import UsageError


class PluginImportError(UsageError, ImportError):
    """The module or file a flag names cannot be imported (a usage error: printed alone)."""


class PluginAttributeError(UsageError, AttributeError):
    """The module a flag names has no such attribute (a usage error: printed alone)."""


class PluginTypeError(UsageError, TypeError):
    """The object a flag names is not callable (a usage error: printed alone)."""


def import_object(spec: str, flag: str, builtins: dict[str, str], what: str = "function"):
    """The object ``spec`` names: ``package.module:name``, ``path/to/file.py:name``, or a key of
    ``builtins`` (short name → ``module:name``).

    Args:
        spec: the flag's value. flag: its name, for the messages (``--reward_fn``).
        builtins: the built-in short names. what: what the object must be, for the messages.

    Raises:
        UsageError: ``spec`` is not of the form ``X:name``; :class:`PluginImportError` (an ``ImportError``):
            the module or file cannot be imported (names the spec and why); :class:`PluginAttributeError`:
            the module has no such attribute; :class:`PluginTypeError`: the attribute is not callable.
            Each is printed alone by the step programs, naming the flag.
    """
    target = builtins.get(spec, spec)
    module_name, sep, name = target.rpartition(":")
    if not sep or not module_name or not name:
        raise UsageError(f"{flag} {spec!r}: expected module:{what}, path/to/file.py:{what} or one of "
                         f"{sorted(builtins)}")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            mod_spec = importlib.util.spec_from_file_location(f"chatrl_plugin_{path.stem}", path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:
        raise PluginImportError(f"{flag} {spec!r}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    obj = getattr(module, name, None)
    if obj is None:
        raise PluginAttributeError(f"{flag} {spec!r}: module {module_name!r} has no attribute {name!r}")
    if not callable(obj):
        raise PluginTypeError(f"{flag} {spec!r}: {name!r} is a {type(obj).__name__}, not a {what}")
    return obj
