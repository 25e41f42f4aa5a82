"""Layered settings for any frozen config dataclass: defaults <- TOML <- environment <- flags.

This module owns loading a daemon's configuration and nothing else. The same
loader serves `diloco-server` (prefix ``DILOCO_SERVER_``) and `diloco-worker`.

Keys are the dataclass field names, flat: ``mode = "sync"`` in TOML (at the top
or in one named table such as ``[server]``), ``DILOCO_SERVER_MODE`` in the
environment, ``--mode`` on the command line. Strings from the environment and
the command line are coerced to the field's type (int, float, bool, str,
``Literal`` choices, ``X | None``, ``tuple[X, ...]`` as a comma list); a bool
flag alone means true (``--insecure``).

Every problem (unknown key, bad value, a failed ``__post_init__`` check) is a
`SettingsError` whose one-line message names the source of the value
(``file.toml:key``, ``env VAR``, ``--flag``), the value and what is expected.
(Just over 400 lines: the type coercion and the field comments read for `--help`.)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import logging
import os
import re
import textwrap
import tokenize
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

logger = logging.getLogger(__name__)

DEFAULTS = "defaults"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_NONE = {"", "none", "null"}


class SettingsError(ValueError):
    """A configuration value is unknown, malformed or invalid; the message says which and where."""


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr and exit 2."""

    def error(self, message: str) -> typing.NoReturn:
        """Print `message` in one line naming the command, then exit 2.

        Args:
            message: argparse's description of the bad usage.
        """
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One settable field: its key (the field name), type and help text."""

    key: str
    type: Any
    help: str


def _field_comments(cls: type) -> dict[str, str]:
    """Comments written next to (or just above) each field in the class source.

    Args:
        cls: a dataclass.

    Returns:
        field name -> comment text; empty when the source is not available.
    """
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = tok.string.lstrip("#").strip()
        tree = ast.parse(source)
    except (tokenize.TokenError, SyntaxError):
        return {}
    lines = source.splitlines()
    out: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            text = comments.get(node.end_lineno or node.lineno)
            if text is None:
                above, line = [], node.lineno - 1
                while line in comments and lines[line - 1].strip().startswith("#"):
                    above.insert(0, comments[line])
                    line -= 1
                text = " ".join(above) if above else None
            if text:
                out[node.target.id] = text
    return out


def _leaves(cls: type) -> list[_Leaf]:
    """Every settable field of `cls`."""
    hints = typing.get_type_hints(cls)
    comments = _field_comments(cls)
    return [
        _Leaf(f.name, hints[f.name], f.metadata.get("help") or comments.get(f.name, ""))
        for f in dataclasses.fields(cls)
        if f.init
    ]


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, from_string: bool) -> Any:
    """Convert `value` to type `tp`; raises ValueError when it does not fit.

    Args:
        value: the raw value (a string from env/flags, or a TOML value).
        tp: the field's resolved type annotation.
        from_string: True when `value` came from text (env or command line).

    Returns:
        The value in the field's type.
    """
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if type(None) in args and (
            value is None or (from_string and str(value).strip().lower() in _NONE)
        ):
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, from_string)
            except ValueError:
                continue
        raise ValueError
    if origin is Literal:
        choices = typing.get_args(tp)
        for choice in choices:
            try:
                if _coerce(value, type(choice), from_string) == choice:
                    return choice
            except ValueError:
                continue
        raise ValueError
    if origin is tuple:
        args = typing.get_args(tp)
        if from_string and isinstance(value, str):
            items = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, list | tuple):
            items = list(value)
        else:
            raise ValueError
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], from_string) for v in items)
        if len(args) != len(items):
            raise ValueError
        return tuple(_coerce(v, a, from_string) for v, a in zip(items, args, strict=True))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_string and isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_string and isinstance(value, str):
            return int(value.strip(), 0)
        raise ValueError
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if from_string and isinstance(value, str):
            return float(value.strip())
        raise ValueError
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError
    if tp is Path:
        if isinstance(value, str | Path):
            return Path(value)
        raise ValueError
    if tp is Any:
        return value
    raise ValueError


def _set(
    values: dict[str, tuple[Any, str]], leaf: _Leaf, raw: Any, source: str, from_string: bool
) -> None:
    try:
        values[leaf.key] = (_coerce(raw, leaf.type, from_string), source)
    except (ValueError, TypeError):
        raise SettingsError(
            f"{source}: bad value {raw!r}: expected {_type_name(leaf.type)}"
        ) from None


def read_toml(path: str | Path, section: str | None = None) -> dict[str, Any]:
    """Read a TOML settings file.

    Args:
        path: the file.
        section: if given, only this top-level table is returned (missing -> empty).

    Returns:
        The parsed mapping.

    Raises:
        SettingsError: the file is missing, unreadable, not UTF-8 or not valid TOML.
    """
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise SettingsError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise SettingsError(f"config file {path} cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise SettingsError(
            f"config file {path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
            f"{exc.start}): TOML files are UTF-8; save it as UTF-8"
        ) from None
    if section is not None:
        sub = data.get(section, {})
        if not isinstance(sub, dict):
            raise SettingsError(f"{path}:{section} must be a table")
        return sub
    return data


def load_settings(
    cls: type,
    *,
    file: str | Path | None = None,
    section: str | None = None,
    env: Mapping[str, str] | None = None,
    env_prefix: str | None = None,
    flags: Mapping[str, Any] | argparse.Namespace | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Any:
    """Build a `cls` instance from defaults <- TOML file <- environment <- flags.

    Args:
        cls: a (frozen) dataclass of flat fields.
        file: TOML file, or None.
        section: read only this table of the file (e.g. "server"), or None for the whole file.
        env: environment mapping (default: ``os.environ``); only used with `env_prefix`.
        env_prefix: e.g. "DILOCO_SERVER_"; every variable with this prefix must name a field.
        flags: values given explicitly on the command line, keyed by flat field key
            (a Namespace from a parser built with `add_flags`, or a dict). Entries that
            are not settable fields are ignored, so a whole Namespace may be passed.
        overrides: values set by the program itself (highest precedence, typed, not coerced).

    Returns:
        The validated `cls` instance.

    Raises:
        SettingsError: unknown key, value of the wrong type, or a validation failure.
    """
    leaves = _leaves(cls)
    by_key = {leaf.key: leaf for leaf in leaves}
    values: dict[str, tuple[Any, str]] = {}

    if file is not None:
        data = read_toml(file, section)
        where = f"{file}:{section}." if section else f"{file}:"
        for key, raw in data.items():
            leaf = by_key.get(key)
            if leaf is None:
                raise SettingsError(
                    f"{where}{key}: unknown setting; valid keys: "
                    + ", ".join(lf.key for lf in leaves)
                )
            _set(values, leaf, raw, f"{where}{key}", from_string=False)

    if env_prefix:
        environ = os.environ if env is None else env
        for var in sorted(environ):
            if not var.startswith(env_prefix):
                continue
            key = var[len(env_prefix) :].lower()
            leaf = by_key.get(key)
            if leaf is None:
                raise SettingsError(
                    f"env {var}: unknown setting; valid variables: "
                    + ", ".join(env_prefix + lf.key.upper() for lf in leaves)
                )
            _set(values, leaf, environ[var], f"env {var}", from_string=True)

    if flags is not None:
        given = vars(flags) if isinstance(flags, argparse.Namespace) else dict(flags)
        for key, raw in given.items():
            leaf = by_key.get(key)
            if leaf is None or raw is None:
                continue
            _set(values, leaf, raw, "--" + key.replace("_", "-"), from_string=isinstance(raw, str))

    for key, raw in (overrides or {}).items():
        if key not in by_key:
            raise SettingsError(f"unknown setting {key!r}")
        values[key] = (raw, "--" + key.replace("_", "-"))

    return _build(cls, values)


def _build(cls: type, values: dict[str, tuple[Any, str]]) -> Any:
    kwargs: dict[str, Any] = {}
    sources: dict[str, tuple[Any, str]] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f.name
        if key in values:
            kwargs[f.name] = values[key][0]
            sources[f.name] = values[key]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise SettingsError(
                f"missing required setting {key!r}: set it in the config file, the "
                f"environment or with --{key.replace('_', '-')}"
            )
    try:
        return cls(**kwargs)
    except SettingsError:
        raise
    except (ValueError, TypeError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        named = [name for name in sources if re.search(rf"(?<!\w){name}(?!\w)", message)]
        if len(named) == 1:
            raise SettingsError(f"{sources[named[0]][1]}: {message}") from None
        raise SettingsError(f"invalid {cls.__name__}: {message}") from None


def add_flags(
    parser: argparse.ArgumentParser | Any,
    cls: type,
    *,
    exclude: tuple[str, ...] = (),
    hide: tuple[str, ...] = (),
) -> None:
    """Add one ``--field-name`` option per settable field of `cls`.

    Options default to ``argparse.SUPPRESS`` so the parsed Namespace holds only the
    flags that were given, which is what `load_settings(flags=...)` expects. Values
    stay strings here; `load_settings` coerces and names the flag on error. A bool
    field's flag given without a value means true (``--insecure`` = ``--insecure true``).

    Args:
        parser: an ArgumentParser (or argument group).
        cls: the config dataclass.
        exclude: flat keys not to add (e.g. ones the CLI defines itself).
        hide: flat keys accepted but left out of ``--help`` (settings a command ignores).
    """
    defaults = _defaults(cls)
    for leaf in _leaves(cls):
        if leaf.key in exclude:
            continue
        text = leaf.help or leaf.key.replace("_", " ")
        default = defaults.get(leaf.key, dataclasses.MISSING)
        if default is not dataclasses.MISSING:
            text = f"{text} (default: {default!r})"
        # a bool flag alone means true (`--insecure`); `--insecure false` still works
        alone = {"nargs": "?", "const": "true"} if leaf.type is bool else {}
        parser.add_argument(
            "--" + leaf.key.replace("_", "-"),
            dest=leaf.key,
            default=argparse.SUPPRESS,
            metavar=_metavar(leaf.type),
            help=argparse.SUPPRESS if leaf.key in hide else text.replace("%", "%%"),
            **alone,
        )


def _metavar(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if tp is bool:
        return "BOOL"
    return "VALUE" if typing.get_origin(tp) else getattr(tp, "__name__", "VALUE").upper()


def _defaults(cls: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def setting_keys(cls: type) -> list[str]:
    """The keys of every settable field of `cls`.

    Args:
        cls: a config dataclass.

    Returns:
        The keys in declaration order.
    """
    return [leaf.key for leaf in _leaves(cls)]
