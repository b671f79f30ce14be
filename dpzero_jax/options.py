"""Option groups: frozen dataclasses whose fields carry their check, help text and flag.

A group is a frozen dataclass deriving from :class:`OptionGroup` whose fields are declared with :func:`option`. The
field's :class:`Check` is the one place the option's values are validated: the group's ``__post_init__`` runs it
(and the group's own cross-field rules, ``_check_group``), :class:`~dpzero_jax.train_config.TrainConfig` (which
inherits every group) runs it once for each of its fields, and the ``dpzero train`` flag built from the field
(:func:`add_flags`) parses its text and runs the same check (free text -- paths, field names -- is passed on as
typed, and the configuration's check reports it). A runtime configuration that takes the same value
(:class:`~dpzero_jax.config.DPConfig`'s ``max_grad_norm``, :class:`~dpzero_jax.sketch.RMMConfig`'s ``rate``) calls
the same :class:`Check` object.

Errors name the option as ``OWNER.NAME`` (``TrainConfig.rmm_rate``, ``DPConfig.clip_fn``, ``--rmm-rate``) and, for a
group inside ``TrainConfig``, the group it is defined in. No JAX here: groups are declared in their home modules
(:mod:`dpzero_jax.config`, :mod:`dpzero_jax.sketch`, :mod:`dpzero_jax.peft`, :mod:`dpzero_jax.mesh_options`,
:mod:`dpzero_jax.train_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any, ClassVar

from dpzero_jax.validation import short_repr

INVALID = object()   # returned by a Check's ``accept`` for "not an accepted value" (the generic message)


def _no_parse(text: str) -> str:
    return text


@dataclasses.dataclass(frozen=True)
class Check:
    """One option's validator.

    expected: what the option takes, as in ``"... must be {expected}, got {value}"``.
    accept: ``(value, name) -> value`` (normalised: a list becomes a tuple, ...); returns :data:`INVALID` for the
        generic message or raises ``ValueError`` with its own (which names ``name``).
    parse: a flag's text -> value (the check runs after it, unless ``at_flag`` is False); raises ``ValueError`` if
        the text is not of the type.
    choices: the accepted values (a tuple, or a function returning one: resolved when used, so a choice list from
        a heavy module is imported only then); a flag shows them as ``{a,b}``.
    """

    expected: str
    accept: Callable[[Any, str], Any]
    parse: Callable[[str], Any] = _no_parse
    choices: tuple | Callable[[], tuple] | None = None
    flag_expected: str | None = None   # what the flag's text takes, if not ``expected`` (``uniform:K``, ...)
    at_flag: bool = True   # False: a flag passes its text on unchecked (free text: the run's config checks it)

    def __call__(self, value, name: str = "value"):
        """``value``, normalised, if the option accepts it; else ``ValueError`` naming ``name``."""
        try:
            out = self.accept(value, name)
        except (TypeError, ArithmeticError):
            out = INVALID
        if out is INVALID:
            raise ValueError(f"{name} must be {self.describe()}, got {short_repr(value)}")
        return out

    def describe(self, flag: bool = False) -> str:
        """``expected`` (``flag``: what a flag's text takes), with ``{choices}`` replaced by the choices."""
        text = self.flag_expected if flag and self.flag_expected else self.expected
        return text.replace("{choices}", str(self.values))

    @property
    def values(self) -> tuple | None:
        return self.choices() if callable(self.choices) else self.choices

    def or_none(self, expected: str | None = None) -> Check:
        """The same check, with ``None`` also accepted (``expected`` replaces the text; default ``"... or None"``)."""
        return dataclasses.replace(self, expected=expected or f"{self.expected} or None",
                                   accept=lambda v, name: None if v is None else self.accept(v, name),
                                   flag_expected=self.flag_expected or self.expected)

    def after(self, normalise: Callable[[Any], Any]) -> Check:
        """The same check on ``normalise(value)`` (e.g. a list made a tuple first)."""
        return dataclasses.replace(self, accept=lambda v, name: self.accept(normalise(v), name))


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _same_kind(a, b) -> bool:
    """Both strings, or both numbers and neither a bool (``True == 1``, but ``True`` is no ZeRO stage)."""
    return all(isinstance(a, t) == isinstance(b, t) for t in (str, bool, numbers.Number))


def _parse_float(text: str) -> float:
    return float(text)


def choice(values: tuple | Callable[[], tuple], parse: Callable[[str], Any] = _no_parse) -> Check:
    """One of ``values`` (a tuple, or a function returning it)."""
    def accept(v, name):
        options = values() if callable(values) else values
        return v if any(_same_kind(v, o) and v == o for o in options) else INVALID
    return Check("one of {choices}", accept, parse, values)


def number(low: float = 0.0, *, low_open: bool = True, high: float | None = None, high_open: bool = False,
           expected: str | None = None) -> Check:
    """A finite real number in the interval (``low`` excluded unless ``low_open=False``; no upper end by default)."""
    if expected is None:
        lower = f"{'>' if low_open else '>='} {low:g}"
        expected = f"a finite number {lower}" if high is None else \
            f"a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def accept(v, name):
        if not _real(v) or v < low or (low_open and v == low):
            return INVALID
        if high is not None and (v > high or (high_open and v == high)):
            return INVALID
        return v
    return Check(expected, accept, _parse_float)


def integer(low: int = 0, expected: str | None = None) -> Check:
    """An integer (not a bool) ``>= low``."""
    return Check(expected or f"an integer >= {low}", lambda v, name: v if _integer(v) and v >= low else INVALID, int)


def boolean() -> Check:
    """A real boolean: ``"false"`` is no ``False`` (:func:`dpzero_jax.validation.check_bool`'s rule)."""
    return Check("true or false (a boolean; strings such as 'false' are not accepted)",
                 lambda v, name: v if isinstance(v, bool) else INVALID)


def text(expected: str = "a non-empty string") -> Check:
    """A non-empty (not blank) string; a flag passes it on as typed (``dpzero train`` then reports the
    configuration's error, exit status 2)."""
    return Check(expected, lambda v, name: v if isinstance(v, str) and v.strip() else INVALID, at_flag=False)


def _parse_patterns(text: str) -> tuple[str, ...]:
    if text.strip().lower() == "none":
        return ()
    return tuple(item.strip() for item in text.split(","))


def patterns() -> Check:
    """A tuple of non-empty path patterns (a string is one pattern, a list a tuple); a flag takes them
    comma-separated, ``none`` for the empty tuple."""
    def accept(v, name):
        v = (v,) if isinstance(v, str) else v
        if not isinstance(v, (list, tuple)) or not all(isinstance(p, str) and p for p in v):
            return INVALID
        return tuple(v)
    return Check("a tuple of path patterns", accept, _parse_patterns,
                 flag_expected="comma-separated path patterns, or none")


@dataclasses.dataclass(frozen=True)
class Option:
    """A field's metadata: its check, help text and flag.

    flag: the ``dpzero train`` flag (default ``--`` + the name with dashes); ``cli=False``: Python / ``--config``
        only. metavar: the flag's placeholder. exclusive: flags of fields sharing this tag are mutually exclusive.
    """

    check: Check
    help: str | None = None
    flag: str | None = None
    metavar: str | None = None
    cli: bool = True
    exclusive: str | None = None


def option(default, check: Check, help: str | None = None, **flag) -> Any:
    """A dataclass field with default ``default`` validated by ``check`` (metadata :class:`Option`; ``flag``:
    ``flag``, ``metavar``, ``cli``, ``exclusive`` as there)."""
    return dataclasses.field(default=default, metadata={"option": Option(check, help, **flag)})


def option_of(field: dataclasses.Field) -> Option | None:
    return field.metadata.get("option")


def check_fields(cls, obj, owner: str, where: str = "") -> None:
    """Run the check of each :func:`option` field of ``cls`` on ``obj`` (storing the normalised value); errors are
    ``OWNER.NAME must be ...``, followed by ``where``."""
    for field in dataclasses.fields(cls):
        spec = option_of(field)
        if spec is None:
            continue
        value = getattr(obj, field.name)
        try:
            normalised = spec.check(value, f"{owner}.{field.name}")
        except ValueError as error:
            raise ValueError(f"{error}{where}") from None
        if normalised is not value:
            object.__setattr__(obj, field.name, normalised)


class OptionGroup:
    """Base of the option groups (frozen dataclasses of :func:`option` fields). ``GROUP``: the group's name, as in
    errors and in ``dpzero train --help`` (``HELP``: a line under it there). A subclass may define
    ``_check_group(self, owner)`` for rules between its own fields (errors ``OWNER.NAME ...``)."""

    GROUP: ClassVar[str] = ""
    HELP: ClassVar[str | None] = None   # a line under the group's title in ``--help``

    def __post_init__(self):
        type(self).validate(self, type(self).__name__)

    @classmethod
    def validate(cls, obj, owner: str) -> None:
        """Check ``cls``'s options on ``obj`` (an instance of ``cls`` or of a configuration composed of it)."""
        where = "" if owner == cls.__name__ else f" (option group {cls.GROUP!r}: {cls.__module__}.{cls.__name__})"
        check_fields(cls, obj, owner, where)
        try:
            cls._check_group(obj, owner)
        except ValueError as error:
            raise ValueError(f"{error}{where}") from None

    def _check_group(self, owner: str) -> None:
        """Rules between this group's options (none by default)."""

    @classmethod
    def of(cls, config) -> OptionGroup:
        """This group's options taken from ``config`` (any object with these attributes: a ``TrainConfig``)."""
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def group_default(cls, name: str):
    """The default of field ``name`` of dataclass ``cls``."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def flag_name(field: dataclasses.Field) -> str:
    spec = option_of(field)
    return spec.flag if spec is not None and spec.flag else "--" + field.name.replace("_", "-")


def _flag_type(check: Check, flag: str):
    def parse(value: str):
        try:
            parsed = check.parse(value)
            accepted = check.accept(parsed, flag)   # a check's own message (naming the flag) passes through
        except (TypeError, ArithmeticError):   # ValueError: text not of the type (or the check's own message)
            accepted = INVALID
        except ValueError as error:
            if flag not in str(error):
                accepted = INVALID
            else:
                raise argparse.ArgumentTypeError(str(error)) from None
        if accepted is INVALID:
            raise argparse.ArgumentTypeError(f"{flag} must be {check.describe(flag=True)}, got {value!r}")
        return accepted
    parse.__name__ = flag   # argparse names the type in some messages
    return parse


def add_flags(parser, cls, exclusive: dict | None = None) -> None:
    """One flag per :func:`option` field of group ``cls`` with ``cli`` set, in an argument group named ``cls.GROUP``
    of ``parser``: a bool defaulting to False is ``store_true``, one defaulting to True a ``store_false`` (its
    ``flag`` says ``--no-...``); choices are shown as ``{a,b}``; other values are parsed and checked by the field's
    :class:`Check`. Fields sharing an ``exclusive`` tag go into one mutually exclusive group (``exclusive``: tag ->
    group, shared between calls). The help ends with the default unless it is None or the help mentions one."""
    exclusive = {} if exclusive is None else exclusive
    section = parser.add_argument_group(cls.GROUP, cls.HELP)
    for field in dataclasses.fields(cls):
        spec = option_of(field)
        if spec is None or not spec.cli:
            continue
        flag = flag_name(field)
        target = section
        if spec.exclusive is not None:
            if spec.exclusive not in exclusive:
                exclusive[spec.exclusive] = section.add_mutually_exclusive_group()
            target = exclusive[spec.exclusive]
        kwargs: dict[str, Any] = {"dest": field.name, "help": spec.help}
        if isinstance(field.default, bool):
            kwargs["action"] = "store_false" if field.default else "store_true"
        else:
            if spec.check.at_flag:
                kwargs["type"] = _flag_type(spec.check, flag)
            if spec.check.choices is not None:
                kwargs["choices"] = spec.check.values
            if spec.metavar:
                kwargs["metavar"] = spec.metavar
            if field.default is not None and not (spec.help and "default" in spec.help):
                shown = ",".join(map(str, field.default)) if isinstance(field.default, tuple) else str(field.default)
                kwargs["help"] = f"{spec.help or ''} (default: {shown.replace('%', '%%')})".strip()
        target.add_argument(flag, **kwargs)
