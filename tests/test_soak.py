"""Pure figures of a long chaos run (`bench.soak`): memory slope per daemon, bounded directories."""

from __future__ import annotations

import pytest

from bench import soak

MB = 1e6


@pytest.mark.timeout(10)
def test_rss_slope_is_shared_by_a_daemons_processes_each_at_its_own_level():
    # process 1 grows 100 -> 101 MB over 600 s; killed, process 2 starts lower (50 MB) and
    # grows 50 -> 51 MB over 600 s: 1 MB per 10 minutes in each
    samples = [(0.0, 1, 100 * MB), (300.0, 1, 100.5 * MB), (600.0, 1, 101 * MB)]
    samples += [(1000.0, 2, 50 * MB), (1300.0, 2, 50.5 * MB), (1600.0, 2, 51 * MB)]
    raw = {"warm_s": 0.0, "bucket_s": 0.0}  # every sample as it is (no minute medians)
    assert soak.rss_slope(samples, after=0.0, **raw) == pytest.approx(1.0)
    # one line through all the points would read the restart's drop as shrinking memory
    as_one = [(t, 0, b) for t, _pid, b in samples]
    assert soak.rss_slope(as_one, after=0.0, **raw) < 0
    # only samples after `after` and each process's warm-up: process 2 alone, from 1300
    assert soak.rss_slope(samples, 700.0, warm_s=300.0, bucket_s=0.0) == pytest.approx(1.0)
    assert soak.fitted_s(samples, after=700.0, warm_s=300.0) == 300.0
    assert soak.fitted_s(samples, after=0.0, warm_s=0.0) == 600.0 + 600.0
    assert soak.rss_slope(samples, after=1500.0, **raw) is None  # one sample left
    assert soak.rss_slope([], after=0.0) is None


@pytest.mark.timeout(10)
def test_rss_slope_leaves_out_a_processs_warm_up():
    # 10 MB at start, 100 MB after its first minute (compile, join), flat after
    samples = [(0.0, 7, 10 * MB), (60.0, 7, 100 * MB), (120.0, 7, 100 * MB), (180.0, 7, 100 * MB)]
    assert soak.rss_slope(samples, after=0.0, warm_s=60.0, bucket_s=0.0) == 0.0
    # with the warm-up: points (0, 10) (60, 100) (120, 100) (180, 100): mean t 90, mean y
    # 77.5; sum (t - 90)(y - 77.5) = (-90)(-67.5) + (-30)(22.5) + 30(22.5) + 90(22.5) = 8100;
    # sum (t - 90)^2 = 18000; 0.45 MB/s = 270 MB per 10 minutes
    assert soak.rss_slope(samples, after=0.0, warm_s=0.0, bucket_s=0.0) == pytest.approx(270.0)


@pytest.mark.timeout(10)
def test_rss_slope_ignores_transient_peaks_and_the_shutdown():
    # flat at 100 MB, polled every 5 s for 10 minutes, with one poll at 130 MB near the end
    # (a step's scratch); after the run's end (t = 600) a minute at 200 MB (its shutdown)
    samples = [(float(t), 3, 100 * MB) for t in range(0, 600, 5)]
    samples[118] = (590.0, 3, 130 * MB)
    samples += [(float(t), 3, 200 * MB) for t in range(600, 665, 5)]
    # each minute's median is 100 MB: no growth
    assert soak.rss_slope(samples, after=0.0, end=600.0, warm_s=0.0) == 0.0
    # every poll as it is, the one peak near the end reads as growth
    assert soak.rss_slope(samples, after=0.0, end=600.0, warm_s=0.0, bucket_s=0.0) > 1.0
    assert soak.rss_slope(samples, after=0.0, warm_s=0.0) > 0.0  # the shutdown, without `end`
    # a bucket cut off after less than half a minute is left out (its median is no minute's)
    assert soak.rss_slope(samples[:-12], after=0.0, warm_s=0.0) == 0.0  # 600 alone at 200


@pytest.mark.timeout(10)
def test_growth_tells_a_sawtooth_from_a_leak():
    # a log segment that grows 0.1 MB/s and is cut back every 10 s: peaks 0.9 MB throughout
    saw = [(float(t), (t % 10) * 0.1 * MB) for t in range(101)]
    got = soak.growth(saw, after=0.0, end=100.0)
    assert got["bounded"] is True
    assert (got["peak_first_mb"], got["peak_second_mb"]) == (0.9, 0.9)
    # a shard back from a kill logs the islands' queued deltas at once: a 3-MB peak for
    # five polls, cut back at the next checkpoint. Levels (medians): over t = 0..49 the
    # mean of the 25th and 26th of 50 values, (0.4 + 0.5) / 2; over 50..100 the 26th of
    # 51 values, 0.4 without the peak, 0.5 with it (it replaced 0, .1, .2, .3, .4)
    assert (got["level_first_mb"], got["level_second_mb"]) == (0.45, 0.4)
    catch_up = [(t, 3 * MB if 80.0 <= t < 85.0 else b) for t, b in saw]
    got = soak.growth(catch_up, after=0.0, end=100.0)
    assert got["bounded"] is True and got["peak_second_mb"] == 3.0
    assert (got["level_first_mb"], got["level_second_mb"]) == (0.45, 0.5)
    # never cut back: levels 2.45 MB (t < 50) and 7.5 MB > 1.25 x 2.45 + 1 MB
    leak = [(float(t), t * 0.1 * MB) for t in range(101)]
    got = soak.growth(leak, after=0.0, end=100.0)
    assert got["bounded"] is False
    assert got["slope_mb_per_10min"] == pytest.approx(60.0)
    assert soak.growth(leak, after=200.0, end=300.0)["bounded"] is None


def test_settle_is_ten_minutes_or_a_third_of_a_short_run():
    assert soak.settle_s(3600.0) == 600.0
    assert soak.settle_s(300.0) == 100.0


@pytest.mark.timeout(10)
def test_soak_summary_judges_every_daemon_and_directory():
    t0, duration = 1000.0, 300.0  # settle 100 s: fitted from 1100 on
    flat = [(t0 + t, 11, 200 * MB) for t in range(0, 301, 5)]
    leak = [(t0 + t, 12, 300 * MB + t / 600 * 2 * MB) for t in range(0, 301, 5)]  # 2 MB/10 min
    sizes = {"wal_bytes": 1e5, "checkpoint_bytes": 2e6, "wal_segments": 2, "checkpoints": 2}
    dirs = {"shard-0": [(t0 + t, sizes) for t in range(0, 301, 5)]}
    got = soak.soak_summary({"island-0": flat, "shard-0": leak}, dirs, t0, duration)
    assert got["settle_s"] == 100.0
    assert got["rss"]["island-0"]["met"] is True
    assert got["rss"]["island-0"]["slope_mb_per_10min"] == 0.0
    assert got["rss"]["island-0"]["fitted_s"] == 300.0 - soak.WARM_S  # its first 2 minutes out
    assert got["rss"]["shard-0"]["slope_mb_per_10min"] == pytest.approx(2.0)
    assert got["rss"]["shard-0"]["met"] is False and got["rss_met"] is False
    assert got["dirs"]["shard-0"]["checkpoints_max"] == 2
    assert got["dirs_bounded"] is True
    table = soak.soak_table({"faulted": {"soak": got}})
    assert "shard-0" in table and "+2.000" in table and "0.10 / 0.10" in table
    empty = soak.soak_summary({}, {}, t0, duration)
    assert empty["rss_met"] is None and empty["dirs_bounded"] is None
