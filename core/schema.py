"""Typed configuration from plain mappings (YAML, cdk.json context), with errors that name the field.

Every configuration object in the project is a frozen dataclass parsed by :func:`parse`. A bad value raises
:class:`ConfigError` naming where it came from, the dotted field path, the value and what is allowed, so
`cdk synth`, `moerl manifests` and the trainer all fail the same way before anything is written.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Mapping, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names source, field, value and what is allowed."""

    def __init__(self, source: str, field: str, value: Any, allowed: str):
        self.source, self.field, self.value, self.allowed = source, field, value, allowed
        where = f"{source}: {field}" if field else source
        super().__init__(f"{where}: {value!r} is not allowed; {allowed}")


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, source: str, path: str) -> Any:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, value, source, path)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(source, path, value, "expected " + " or ".join(_type_name(o) for o in options))
    if origin is Literal:
        if value not in get_args(tp):
            raise ConfigError(source, path, value, "allowed: " + ", ".join(repr(a) for a in get_args(tp)))
        return value
    if dataclasses.is_dataclass(tp):
        return parse(tp, value, source=source, path=path)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(source, path, value, "expected a list")
        (item_tp, *_rest) = get_args(tp)
        return tuple(_convert(item_tp, v, source, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(source, path, value, "expected a mapping")
        key_tp, val_tp = get_args(tp)
        return {_convert(key_tp, k, source, path): _convert(val_tp, v, source, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(source, path, value, "expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(source, path, value, "expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(source, path, value, "expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(source, path, value, "expected a string")
        return value
    if tp is Any:
        return value
    raise TypeError(f"unsupported config type {tp!r} at {path}")


def parse(cls: type[T], data: Any, *, source: str, path: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and missing required fields are errors.

    After construction the dataclass's own ``validate()`` (if any) runs; it raises ConfigError through
    :func:`fail` with field paths relative to this object.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(source, path, data, f"expected a mapping for {cls.__name__}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(source, _join(path, unknown[0]), data[unknown[0]],
                          "unknown field; known fields: " + ", ".join(sorted(fields)))
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], source, _join(path, name))
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(source, _join(path, name), None, f"required field missing ({_type_name(hints[name])})")
    try:
        # A Validated dataclass checks itself on construction; the others are checked here.
        obj = cls(**kwargs)
        validate = getattr(obj, "validate", None)
        if validate is not None and not isinstance(obj, Validated):
            validate()
    except _FieldProblem as problem:
        raise ConfigError(source, _join(path, problem.field), problem.value, problem.allowed) from None
    return obj


def dump(obj: Any) -> Any:
    """Plain YAML/JSON data from a parsed config: the inverse of :func:`parse` (``parse(type(x), dump(x)) == x``)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: dump(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [dump(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: dump(v) for k, v in obj.items()}
    return obj


class _FieldProblem(ConfigError):
    """A ConfigError without a source yet: `parse` adds the source and the path of the enclosing object."""

    def __init__(self, field: str, value: Any, allowed: str):
        self.source, self.field, self.value, self.allowed = "", field, value, allowed
        ValueError.__init__(self, f"{field}: {value!r} is not allowed; {allowed}")


class Validated:
    """Mixin for config dataclasses built in code as well as parsed: ``__post_init__`` runs ``validate()``, so
    constructing one directly (a construct's props) is checked exactly like one read from a file."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        pass


def fail(field: str, value: Any, allowed: str) -> typing.NoReturn:
    """Raise from a dataclass ``validate()``: ``parse`` turns it into a ConfigError with the full path."""
    raise _FieldProblem(field, value, allowed)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
