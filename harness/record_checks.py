"""Checks a registry record runs on itself when it is built (``__post_init__``), in the manner of
PyTorch's OpInfo: a record with a value outside its field's closed set fails at import, with one
message that names the record, the field, the value, what is allowed and what to do.

The closed sets are ``typing.Literal`` types on the records' fields (``choices(T)`` reads them
back), so the annotation a reader sees is the set the check enforces.

Imports nothing of the project (the component and case registries sit on it).
"""

from __future__ import annotations

import typing


class RecordError(ValueError):
    """A registry record that cannot be: raised while the record is built (at import)."""


def choices(literal) -> tuple:
    """The values of a ``Literal[...]`` type (an ``Optional`` / ``X | None`` of one included)."""
    out: list = []
    for arg in typing.get_args(literal) or (literal,):
        if arg is type(None):
            out.append(None)
        elif typing.get_origin(arg) is typing.Literal:
            out.extend(typing.get_args(arg))
        else:
            out.append(arg)
    return tuple(out)


def fail(record: str, field: str, value, allowed, fix: str) -> typing.NoReturn:
    raise RecordError(f"{record}: {field}={value!r} is not one of {', '.join(map(repr, allowed))}; {fix}")


def one_of(record: str, field: str, value, allowed, fix: str) -> None:
    """``value`` is in ``allowed`` (a ``Literal`` type or a collection), else ``RecordError``."""
    allowed = choices(allowed) if typing.get_origin(allowed) is not None else tuple(allowed)
    if value not in allowed:
        fail(record, field, value, allowed, fix)


def all_of(record: str, field: str, values, allowed, fix: str) -> None:
    """Every item of ``values`` is in ``allowed`` (as ``one_of``)."""
    allowed = choices(allowed) if typing.get_origin(allowed) is not None else tuple(allowed)
    for v in values:
        if v not in allowed:
            fail(record, field, v, allowed, fix)
