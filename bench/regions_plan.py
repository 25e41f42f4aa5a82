"""The regions bench's plan: the default regions and links, and the scaling rule (pure functions).

The default deployment is four US regions, one island each, of mixed speeds
(a v6e/v5p-like 1.0 / 0.55 mix), over links whose round-trip times follow
the distances between the regions:

    link                      rate Gbit/s   RTT ms   jitter ms   loss
    us-east    - us-central       5.0          30       1.0        0
    us-east    - us-west          2.0          80       2.0        0.1%
    us-east    - us-south         4.0          40       1.0        0
    us-central - us-west          3.0          50       1.5        0
    us-central - us-south         5.0          30       1.0        0
    us-west    - us-south         2.5          60       1.5        0

(us-east: Virginia, us-central: Iowa, us-west: Oregon, us-south: Texas.)
Rates are per direction. A userspace relay on this machine does not carry
Gbit/s, so every rate is multiplied by one factor, `scale` (0.01: 2 Gbit/s is
emulated as 20 Mbit/s); round-trip times, jitter and loss are not scaled.

Scaling rule (`rescale`): each link is probed at its scaled rate, alone and
with every link streaming at once, and counts with the lower of the two. When the
worst link carries less than `THRESHOLD` (90%) of its rate, the scale is
multiplied by that link's achieved / configured ratio, so that link is
emulated at what it carried and every other link keeps its ratio to it; the
links are then probed again. The report states every such step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

THRESHOLD = 0.9
RTT_TOLERANCE = 0.10


@dataclasses.dataclass(frozen=True)
class Region:
    """A region: its name and the speed of its island (1.0 = the fastest chips)."""

    name: str
    island_speed: float


@dataclasses.dataclass(frozen=True)
class Link:
    """A WAN link between regions a and b, at its real (unscaled) rate."""

    a: int
    b: int
    gbit: float
    rtt_ms: float
    jitter_ms: float = 0.0
    loss: float = 0.0


REGIONS: tuple[Region, ...] = (
    Region("us-east", 1.0),
    Region("us-central", 0.55),
    Region("us-west", 1.0),
    Region("us-south", 0.55),
)

LINKS: tuple[Link, ...] = (
    Link(0, 1, 5.0, 30.0, 1.0),
    Link(0, 2, 2.0, 80.0, 2.0, 0.001),
    Link(0, 3, 4.0, 40.0, 1.0),
    Link(1, 2, 3.0, 50.0, 1.5),
    Link(1, 3, 5.0, 30.0, 1.0),
    Link(2, 3, 2.5, 60.0, 1.5),
)


def emulated_mbit(link: Link, scale: float) -> float:
    """The rate a link is emulated at: Gbit/s x 1000 x scale, in Mbit/s.

    Args:
        link: the link.
        scale: the run's scale factor.

    Returns:
        Mbit/s per direction.
    """
    return link.gbit * 1000.0 * scale


@dataclasses.dataclass(frozen=True)
class Rescale:
    """What one probe round decided."""

    scale: float  # the scale for the next round (== the old one when every link held)
    factor: float  # new / old scale (1.0: unchanged)
    short: tuple[
        tuple[int, int, float], ...
    ]  # (a, b, achieved/configured) of links under THRESHOLD


def rescale(
    scale: float,
    configured_mbit: dict[tuple[int, int], float],
    achieved_mbit: dict[tuple[int, int], float],
    threshold: float = THRESHOLD,
) -> Rescale:
    """The scaling rule: the worst link under `threshold` sets the scale of all.

    Args:
        scale: the scale this round was probed at.
        configured_mbit: (a, b) -> the rate the link was emulated at.
        achieved_mbit: (a, b) -> the rate the probe measured.
        threshold: share of its rate a link must carry.

    Returns:
        The next scale (scale x worst ratio when a link fell short, else unchanged)
        and the links that fell short, worst first.
    """
    ratios = {key: achieved_mbit[key] / configured_mbit[key] for key in configured_mbit}
    short = sorted(((a, b, r) for (a, b), r in ratios.items() if r < threshold), key=lambda t: t[2])
    if not short:
        return Rescale(scale, 1.0, ())
    factor = short[0][2]
    return Rescale(scale * factor, factor, tuple(short))


def rtt_within(configured_ms: float, achieved_ms: float, tolerance: float = RTT_TOLERANCE) -> bool:
    """Whether a measured round-trip time is within `tolerance` of the configured one."""
    return abs(achieved_ms - configured_ms) <= tolerance * configured_ms


def parse_regions_list(text: str, regions: int) -> list[int]:
    """Parse `--shard-regions` ("0", "0,2", or region names).

    Args:
        text: comma-separated indices or names.
        regions: how many regions the run has.

    Returns:
        The region indices, in order, without repeats.

    Raises:
        ValueError: an entry is unknown or out of range.
    """
    names = {r.name: i for i, r in enumerate(REGIONS[:regions])}
    out: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        index = names[part] if part in names else int(part)
        if not 0 <= index < regions:
            raise ValueError(f"region {part!r} is not one of 0..{regions - 1}")
        if index not in out:
            out.append(index)
    if not out:
        raise ValueError("no region given")
    return out


def link_report(
    link: Link, configured: float, probe: dict[str, Any], together_mbit: float | None = None
) -> dict[str, Any]:
    """One link's line of the report: configured against achieved.

    Args:
        link: the link.
        configured: the Mbit/s it was emulated at.
        probe: the probe's figures with the link alone.
        together_mbit: what it carried while every link streamed at once (None: not probed).

    Returns:
        A JSON-ready dict; `rate_ratio` is the lower of alone and together.
    """
    achieved = probe["mbit_s"] if together_mbit is None else min(probe["mbit_s"], together_mbit)
    ratio = achieved / configured if configured > 0 else 0.0
    return {
        "a": REGIONS[link.a].name,
        "b": REGIONS[link.b].name,
        "gbit": link.gbit,
        "configured_mbit": round(configured, 3),
        "achieved_mbit": round(probe["mbit_s"], 3),
        "achieved_mbit_together": None if together_mbit is None else round(together_mbit, 3),
        "rate_ratio": round(ratio, 4),
        "rate_held": ratio >= THRESHOLD,
        "rtt_ms": link.rtt_ms,
        "rtt_ms_achieved_median": round(probe["rtt_ms_median"], 3),
        "rtt_ms_achieved_min": round(probe["rtt_ms_min"], 3),
        "rtt_held": rtt_within(link.rtt_ms, probe["rtt_ms_median"]),
        "jitter_ms": link.jitter_ms,
        "loss": link.loss,
    }
