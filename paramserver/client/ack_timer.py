"""The client's adaptive ack timeout: TCP's retransmission timer (RFC 6298), with no clock.

This module owns how long an island waits for a shard's ack before it sends a
delta again. `AckTimer` is an immutable value: it takes measured ack latencies
(`sample`) and timeouts (`timed_out`) and returns a new timer; `timeout_s`
says how long to wait. The ledger (`paramserver.client.ledger`) keeps one and feeds it;
nothing here reads a clock.

The rules (RFC 6298, with its constants alpha = 1/8, beta = 1/4, K = 4):
- before any sample the timeout is `initial_s`;
- the first sample R sets SRTT = R, RTTVAR = R / 2; each later sample R sets
  RTTVAR = 3/4 RTTVAR + 1/4 |SRTT - R|, then SRTT = 7/8 SRTT + 1/8 R;
- the base timeout is SRTT + 4 RTTVAR, clamped to [floor_s, cap_s];
- only a delta acked after its one and only send is a sample (Karn's rule:
  the ack of a re-sent delta may answer either copy);
- a timeout backs the timer off: the wait of every delta is doubled once per
  timeout in a row of the most re-sent delta (`backoff`), until a valid sample
  arrives, so that a latency that jumps above the timeout is still measured
  (without it, every delta would be re-sent and none would be a sample);
- a delta re-sent `attempt` times waits base * 2**max(attempt, backoff), at
  most `cap_s`;
- a re-send found needless (the shard answered `duplicate` to it: the first
  copy had been accepted, and its ack, the first to come back on the one
  connection, measured R) adapts the timer as RFC 4015 (Eifel) does:
  SRTT = max(SRTT, R), RTTVAR = max(RTTVAR, R / 2), no back-off (`spurious`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

ALPHA = 1 / 8  # gain of the smoothed latency
BETA = 1 / 4  # gain of the latency's mean deviation
K = 4  # deviations added to the smoothed latency


def smoothed(srtt: float | None, rttvar: float | None, sample: float) -> tuple[float, float]:
    """RFC 6298's estimators after one more latency sample.

    Args:
        srtt: smoothed latency so far (None before the first sample).
        rttvar: its mean deviation so far (None before the first sample).
        sample: a measured latency, seconds, >= 0.

    Returns:
        (SRTT, RTTVAR) after the sample.
    """
    if srtt is None or rttvar is None:
        return sample, sample / 2
    rttvar = (1 - BETA) * rttvar + BETA * abs(srtt - sample)
    return (1 - ALPHA) * srtt + ALPHA * sample, rttvar


@dataclass(frozen=True)
class AckTimer:
    """The ack timeout of one client: estimates from its samples, and its back-off."""

    initial_s: float  # the timeout before any sample (ClientConfig.ack_timeout_s)
    floor_s: float  # lower bound of the measured timeout
    cap_s: float  # upper bound of every timeout, >= initial_s and floor_s
    srtt_s: float | None = None  # smoothed ack latency; None before the first sample
    rttvar_s: float | None = None  # mean deviation of the ack latency
    backoff: int = 0  # timeouts in a row of one delta since the last valid sample

    def __post_init__(self) -> None:
        for name in ("initial_s", "floor_s", "cap_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"AckTimer.{name}={value!r}: must be a number > 0")
        if self.cap_s < max(self.initial_s, self.floor_s):
            raise ValueError(
                f"AckTimer.cap_s={self.cap_s!r}: must be >= initial_s={self.initial_s} "
                f"and floor_s={self.floor_s}"
            )

    @property
    def base_s(self) -> float:
        """The timeout of a delta sent once, before back-off (seconds)."""
        if self.srtt_s is None or self.rttvar_s is None:
            return self.initial_s
        return min(self.cap_s, max(self.floor_s, self.srtt_s + K * self.rttvar_s))

    def timeout_s(self, attempt: int = 0) -> float:
        """How long to wait for the ack of a delta re-sent `attempt` times so far.

        Args:
            attempt: back-off re-sends of the delta so far, >= 0.

        Returns:
            min(cap_s, base_s * 2**max(attempt, backoff)).
        """
        doublings = max(attempt, self.backoff)
        if doublings >= math.log2(self.cap_s / self.base_s) + 1:  # no float overflow
            return self.cap_s
        return min(self.cap_s, self.base_s * 2.0**doublings)

    def sample(self, latency_s: float) -> AckTimer:
        """The timer after a valid sample (a delta acked after its only send).

        Args:
            latency_s: seconds from that send to its ack (negative counts as 0).

        Returns:
            A timer with updated estimates and no back-off.
        """
        srtt, rttvar = smoothed(self.srtt_s, self.rttvar_s, max(0.0, float(latency_s)))
        return replace(self, srtt_s=srtt, rttvar_s=rttvar, backoff=0)

    def spurious(self, latency_s: float) -> AckTimer:
        """The timer after a re-send proved needless (RFC 4015's response to a spurious timeout).

        Args:
            latency_s: seconds from the first send of the delta to its first ack
                (which answered that first copy).

        Returns:
            A timer whose estimates are at least that latency (and half of it as
            deviation), with no back-off.
        """
        latency = max(0.0, float(latency_s))
        if self.srtt_s is None or self.rttvar_s is None:
            return self.sample(latency)
        srtt, rttvar = max(self.srtt_s, latency), max(self.rttvar_s, latency / 2)
        return replace(self, srtt_s=srtt, rttvar_s=rttvar, backoff=0)

    def timed_out(self, attempt: int) -> AckTimer:
        """The timer after a delta's ack did not come in time (it is re-sent).

        Args:
            attempt: the delta's back-off re-sends before this one, >= 0.

        Returns:
            A timer backed off to at least attempt + 1 doublings (many deltas
            timing out together back it off once, not once each).
        """
        return replace(self, backoff=max(self.backoff, attempt + 1))
