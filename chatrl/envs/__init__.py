"""Environments for step 3's multi-turn episodes (``docs/multi_turn.md``): the interface
(:mod:`chatrl.envs.base`), the built-ins (:mod:`chatrl.envs.calculator`, :mod:`chatrl.envs.guess`)
and the episode loop that runs them inside the hybrid engine with token-in/token-out ids
(:mod:`chatrl.envs.rollout`)."""

from __future__ import annotations

import json

from chatrl.envs.base import BUILTIN_ENVS, EnvError, EnvFactory, Environment, check_messages_out, check_step
from chatrl.errors import UsageError
from chatrl.plugins import import_object

__all__ = ["BUILTIN_ENVS", "EnvError", "EnvFactory", "Environment", "check_messages_out", "check_step",
           "load_environment"]


def load_environment(spec: str, env_args: str | dict | None = None) -> EnvFactory:
    """A factory of episodes' environments: the class ``spec`` names (``module:Class``,
    ``file.py:Class`` or a built-in, :data:`BUILTIN_ENVS`) bound to ``env_args`` (``--env_args``,
    a JSON object or a dict). One environment is built now, to fail at start-up.

    Raises:
        UsageError: a spec that does not import, ``env_args`` that are not a JSON object, or a
            class that refuses them (names the flag).
    """
    try:
        cls = import_object(spec, "--env", BUILTIN_ENVS, what="class")
    except (ValueError, ImportError, AttributeError, TypeError) as exc:
        raise UsageError(str(exc)) from None
    if isinstance(env_args, str):
        try:
            env_args = json.loads(env_args) if env_args.strip() else {}
        except ValueError as exc:
            raise UsageError(f"--env_args {env_args!r}: not JSON ({exc})") from None
    kwargs = dict(env_args or {}) if isinstance(env_args, (dict, type(None))) else None
    if kwargs is None:
        raise UsageError(f"--env_args must be a JSON object, got {type(env_args).__name__}")
    try:
        cls(**kwargs)
    except Exception as exc:  # noqa: BLE001 - any failure of user code means the same: bad arguments
        raise UsageError(f"--env {spec} --env_args {json.dumps(kwargs)}: {type(exc).__name__}: {exc}") from None

    def make() -> Environment:
        return cls(**kwargs)

    make.spec = spec
    return make
