"""Checks shared by the ``dpzero`` command line, config files and :class:`~dpzero_jax.train.TrainConfig`.

The rules that keep a configuration from silently weakening privacy live here, so that a flag, a key of a JSON /
YAML ``--config`` file and a keyword of ``TrainConfig`` meet the same check:

* boolean options (:data:`dpzero_jax.train_config.BOOL_OPTIONS`, derived from ``TrainConfig``'s fields) take only
  real booleans -- JSON ``true`` / ``false``, YAML ``true`` / ``false`` (YAML 1.1 also reads ``yes`` / ``no`` /
  ``on`` / ``off`` unquoted as booleans). A *string* such as ``"false"`` or ``"no"`` is an error, never "true
  because it is non-empty".
* ``noise_multiplier`` and ``epsilon`` are exclusive (a file may set one of them), and neither goes with
  ``no_dp: true``.
* ``noise_multiplier: 0`` (no noise, epsilon infinite) is refused: ``no_dp`` is the explicit non-private switch.
* ``delta`` above ``1 / n`` (``n`` training examples) is refused unless ``allow_large_delta`` is set, which the
  run's summary records (:func:`check_delta`).

Files are read with :func:`read_text`, whose errors name the file and, for undecodable bytes, the line.
"""

from __future__ import annotations

import importlib
from pathlib import Path

REPR_LIMIT = 80


def import_optional(module: str, extra: str, purpose: str):
    """``importlib.import_module(module)`` for a dependency of an extra (``pip install 'dpzero_jax[extra]'``).
    Missing, it is a ``ModuleNotFoundError`` saying what needs it and which extra installs it; installed but broken,
    the original error."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        top = module.split(".")[0]
        if (error.name or "").split(".")[0] != top:
            raise
        raise ModuleNotFoundError(f"{purpose} needs {top!r}, which is not installed: pip install "
                                  f"'dpzero_jax[{extra}]'", name=error.name) from None


def short_repr(value) -> str:
    """``repr(value)``, cut to one short line (a module's repr can be dozens of lines)."""
    text = repr(value)
    if "\n" in text or len(text) > REPR_LIMIT:
        first = text.splitlines()[0] if text.strip() else text
        text = f"<{type(value).__name__}: {first[:REPR_LIMIT - 10]}...>"
    return text


def check_bool(owner: str, name: str, value) -> None:
    if not isinstance(value, bool):
        where = f"{owner}.{name}" if owner == "TrainConfig" else f"{owner}: {name}"
        raise ValueError(f"{where} must be true or false (a boolean; strings such as 'false' are not "
                         f"accepted), got {short_repr(value)}")


def check_privacy_options(values: dict, source: str = "TrainConfig", bool_fields=()) -> None:
    """The exclusive privacy options in a mapping of explicitly given options (a config file, ``from_dict``), and
    real booleans for ``bool_fields`` (``TrainConfig``'s: :data:`dpzero_jax.train_config.BOOL_OPTIONS`)."""
    for name in bool_fields:
        if name in values:
            check_bool(source, name, values[name])
    sigma_given = values.get("noise_multiplier") is not None
    epsilon_given = values.get("epsilon") is not None
    if sigma_given and epsilon_given:
        raise ValueError(f"{source}: noise_multiplier ({short_repr(values['noise_multiplier'])}) and epsilon "
                         f"({short_repr(values['epsilon'])}) are exclusive: give the noise multiplier (epsilon is "
                         f"then reported) or the target epsilon (sigma is then calibrated), not both")
    if values.get("no_dp") is True and (sigma_given or epsilon_given):
        other = "noise_multiplier" if sigma_given else "epsilon"
        raise ValueError(f"{source}: no_dp=true trains without privacy; it cannot go with {other}="
                         f"{short_repr(values[other])}")


def check_noise(noise_multiplier) -> None:
    """Zero noise is a non-private run: only ``no_dp`` asks for it."""
    if noise_multiplier is not None and noise_multiplier == 0:
        raise ValueError("noise_multiplier=0 adds no noise (epsilon is infinite); for a non-private baseline use "
                         "no_dp=true (--no-dp)")


def check_delta(delta: float, dataset_size: int, allowed: bool) -> None:
    """``delta > 1/n`` allows a mechanism that publishes one example outright with probability ``delta * n``."""
    if delta > 1.0 / dataset_size and not allowed:
        raise ValueError(f"delta={delta:g} is above 1/n = {1.0 / dataset_size:.3g} for the {dataset_size} training "
                         f"examples: such a guarantee permits revealing whole examples; use delta < 1/n (e.g. "
                         f"{_suggest(dataset_size):g}) or set allow_large_delta (--allow-large-delta), which the "
                         f"summary records")


def _suggest(n: int) -> float:
    value = 1.0
    while value >= 1.0 / n:
        value /= 10.0
    return value


def read_text(path, what: str = "file") -> str:
    """The UTF-8 text of ``path``; errors name the file (and the line of an undecodable byte)."""
    file = Path(path)
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{what}: no such file {str(path)!r}") from None
    except IsADirectoryError:
        raise ValueError(f"{what}: {str(path)!r} is a directory, not a file") from None
    except OSError as error:
        raise ValueError(f"{what}: cannot read {str(path)!r}: {error.strerror or error}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise ValueError(f"{what}: {str(path)!r} is not UTF-8 text: byte 0x{data[error.start]:02x} at line {line}, "
                         f"column {column}") from None
