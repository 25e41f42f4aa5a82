"""The one set of setting validators every config dataclass uses.

`ShardConfig`, `PolicyConfig`, `ClientConfig`, `IslandConfig` and `InnerConfig`
check their fields with a `Checks` bound to the class name and its error type,
so every rule (an int at least some bound, a finite number in a range, a
choice, a ZeroMQ endpoint, an island id, a pair of CURVE key files) is written
once and every message has one form: ``Owner.field=value: what to do``.
The loaders (`paramserver.plumbing.settings`) name the file, variable or flag
the value came from in front of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from paramserver.wire.protocol import ISLAND_ID_MAX, is_island_id

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def endpoint_problem(value: object, schemes: tuple[str, ...] = ENDPOINT_SCHEMES) -> str | None:
    """What is wrong with `value` as a ZeroMQ endpoint, or None when it is one.

    A tcp endpoint needs a host and a port in 1..65535 (``tcp://HOST:PORT``, an
    IPv6 host in brackets, ``*`` for every interface); ipc and inproc need a name.

    Args:
        value: anything.
        schemes: accepted prefixes, e.g. ("tcp://", "ipc://").

    Returns:
        None for e.g. "tcp://127.0.0.1:5555"; else a short phrase ("no port", ...).
    """
    if not isinstance(value, str):
        return "not a string"
    scheme = next((s for s in schemes if value.startswith(s)), None)
    if scheme is None:
        return f"the scheme must be {' or '.join(s.rstrip('/:') for s in schemes)}"
    address = value[len(scheme) :].rsplit(";", 1)[-1]  # tcp://SOURCE;HOST:PORT
    if not address:
        return "no address after the scheme"
    if scheme != "tcp://":
        return None
    host, colon, port = address.rpartition(":")
    if not colon or not host or host == "[]" or "]" in port:
        return "no port"
    if not port.isdigit():
        return f"port {port!r} is not a number"
    if not 1 <= int(port) <= 65535:
        return f"port {port} is out of range 1..65535"
    return None


def is_finite_number(value: object) -> bool:
    """An int or float (not a bool) that is finite."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Checks:
    """Validators bound to one config class: each raises `error` naming field, value and rule.

    Attributes:
        owner: the config class name, e.g. "ShardConfig".
        error: the exception type to raise (a ValueError subclass).
    """

    owner: str
    error: type[Exception] = ValueError

    def fail(self, field: str, value: object, rule: str) -> Exception:
        """The error for `field` holding `value` against `rule` (to raise)."""
        return self.error(f"{self.owner}.{field}={value!r}: {rule}")

    def require(self, ok: bool, field: str, value: object, rule: str) -> None:
        """Raise unless `ok`."""
        if not ok:
            raise self.fail(field, value, rule)

    def integer(self, field: str, value: object, low: int, high: int | None = None) -> None:
        """An int (not a bool) in [low, high]."""
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
        if high is None:
            self.require(ok, field, value, f"must be an int >= {low}")
        else:
            ok = ok and value <= high
            self.require(ok, field, value, f"must be an int in [{low}, {high}]")

    def number(
        self,
        field: str,
        value: object,
        *,
        low: float | None = None,
        above: float | None = None,
        below: float | None = None,
        high: float | None = None,
    ) -> None:
        """A finite number with optional bounds: >= low, > above, < below, <= high."""
        ok = is_finite_number(value)
        rules = []
        for bound, text, holds in (
            (low, ">=", lambda v, b: v >= b),
            (above, ">", lambda v, b: v > b),
            (below, "<", lambda v, b: v < b),
            (high, "<=", lambda v, b: v <= b),
        ):
            if bound is not None:
                rules.append(f"{text} {bound:g}")
                ok = ok and holds(value, bound)
        what = "must be a finite number" + (" " + " and ".join(rules) if rules else "")
        self.require(ok, field, value, what)

    def choice(self, field: str, value: object, choices: Iterable[object]) -> None:
        """One of `choices`."""
        options = tuple(choices)
        self.require(
            value in options, field, value, "must be one of " + ", ".join(map(str, options))
        )

    def boolean(self, field: str, value: object) -> None:
        """True or False."""
        self.require(isinstance(value, bool), field, value, "must be true or false")

    def text(
        self, field: str, value: object, what: str = "give a path", empty: bool = True
    ) -> None:
        """A string (non-empty unless `empty`)."""
        self.require(isinstance(value, str) and (empty or value != ""), field, value, what)

    def endpoint(
        self, field: str, value: object, schemes: tuple[str, ...] = ENDPOINT_SCHEMES
    ) -> None:
        """A ZeroMQ endpoint such as tcp://127.0.0.1:5555."""
        problem = endpoint_problem(value, schemes)
        self.require(
            problem is None,
            field,
            value,
            f"give a ZeroMQ endpoint such as tcp://127.0.0.1:5555 ({problem})",
        )

    def island_id(self, field: str, value: object) -> None:
        """An island id: a string of 1-128 characters."""
        self.require(
            is_island_id(value), field, value, f"give a string of 1-{ISLAND_ID_MAX} characters"
        )

    def log_level(self, field: str, value: object) -> None:
        """DEBUG, INFO, WARNING or ERROR (any case)."""
        ok = isinstance(value, str) and value.upper() in LOG_LEVELS
        self.require(ok, field, value, "must be DEBUG, INFO, WARNING or ERROR")

    def together(self, first: str, first_value: str, second: str, second_value: str) -> None:
        """Two settings given together or not at all (e.g. a CURVE key pair)."""
        for name, value in ((first, first_value), (second, second_value)):
            self.text(name, value)
        if bool(first_value) != bool(second_value):
            missing = second if first_value else first
            given = first if first_value else second
            raise self.fail(
                missing, "", f"CURVE needs both {first} and {second} (or neither); {given} is set"
            )
