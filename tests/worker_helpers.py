"""Helpers for tests that run real `diloco-worker` processes."""

from __future__ import annotations

import time

import pytest


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    """Poll `predicate` until it returns a truthy value; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    pytest.fail(f"timed out after {timeout_s:g}s waiting for {what}")
