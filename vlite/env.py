"""Environment-variable switches (``VLITE_ATTENTION_BACKEND``, ``VLITE_FUSED_OPS``,
``VLITE_CPU_LAYER_LOOP``, ``VLITE_CPU_MALLOC``): read and checked in one place, so a bad value
fails at engine start with one line that names the allowed ones."""

from __future__ import annotations

import os


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """The value of environment variable ``name``, ``default`` when it is unset or empty
    (``VAR= vlite ...`` means "not set", as in most shells' idiom).

    Raises:
        ValueError: the variable holds a value outside ``choices`` (the message lists them).
    """
    value = os.environ.get(name) or default
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


__all__ = ["env_choice"]
