"""The pure rules of multi-process islands: who is in the group, the fsdp layout, liveness."""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import PartitionSpec

from codec.coded import Coded
from paramserver.client import Update
from worker import device_layout, process_group
from worker.config import IslandConfig, IslandConfigError
from worker.leader_sync import LeaderSync, travelling_codes
from worker.process_group import GroupError, GroupSpec, resolve_group

pytestmark = pytest.mark.timeout(60)

ENV = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2"}


def test_group_comes_from_jax_variables_when_no_setting_is_given():
    assert resolve_group("", 0, -1, ENV) == GroupSpec("10.0.0.1:1234", 4, 2)


def test_settings_win_over_jax_variables():
    assert resolve_group("h:9", 2, 1, ENV) == GroupSpec("h:9", 2, 1)
    assert resolve_group("", 0, 3, ENV) == GroupSpec("10.0.0.1:1234", 4, 3)


def test_no_setting_and_no_variable_is_one_process():
    spec = resolve_group("", 0, -1, {})
    assert spec == GroupSpec("", 1, 0) and not spec.multi and spec.leader


@pytest.mark.parametrize(
    ("coordinator", "count", "index", "env", "says"),
    [
        ("", 2, 0, {}, "--coordinator HOST:PORT"),
        ("h:1", 2, 2, {}, "process_id must be in [0, 1]"),
        ("", 0, -1, {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES must be an integer"),
    ],
)
def test_bad_groups_say_what_to_change(coordinator, count, index, env, says):
    with pytest.raises(GroupError, match=said(says)):
        resolve_group(coordinator, count, index, env)


def said(text: str) -> str:
    import re

    return re.escape(text)


def test_island_config_checks_the_new_fields():
    assert IslandConfig(param_sharding="fsdp").param_sharding == "fsdp"
    with pytest.raises(
        IslandConfigError, match="param_sharding='zero3': must be one of replicated, fsdp"
    ):
        IslandConfig(param_sharding="zero3")
    with pytest.raises(IslandConfigError, match="process_id=-2: must be an int >= -1"):
        IslandConfig(process_id=-2)


@pytest.mark.parametrize(
    ("shape", "devices", "spec"),
    [
        ((256, 64), 4, PartitionSpec("data")),  # largest divisible dim: 256
        ((64, 256), 4, PartitionSpec(None, "data")),
        ((2, 64, 192), 4, PartitionSpec(None, None, "data")),
        ((64, 6), 4, PartitionSpec("data")),  # 6 is not divisible, 64 is
        ((3, 5), 4, PartitionSpec()),  # nothing divisible: replicated
        ((), 4, PartitionSpec()),  # a scalar (AdamW's count)
        ((256, 64), 1, PartitionSpec()),
        ((8, 8), 4, PartitionSpec("data")),  # equal sizes: the first
    ],
)
def test_fsdp_cuts_the_largest_divisible_dimension(shape, devices, spec):
    assert device_layout.fsdp_spec(shape, devices) == spec


def test_replicated_layout_never_cuts():
    assert device_layout.leaf_spec((256, 64), 4, "replicated") == PartitionSpec()
    with pytest.raises(ValueError, match="param sharding must be one of"):
        device_layout.leaf_spec((4,), 4, "zero3")


def test_a_process_is_gone_once_silent_for_longer_than_the_liveness_timeout():
    last = {1: 10.0, 2: 7.9, 3: 8.0}
    assert process_group.silent_processes(10.0, last, 2.0) == [2]
    assert process_group.silent_processes(12.5, last, 2.0) == [1, 2, 3]
    assert process_group.silent_processes(9.9, last, 2.0) == []


def test_liveness_timeout_is_the_clients_rule():
    assert process_group.liveness_timeout_s(0.5) == pytest.approx(2.5)


def test_the_gone_line_names_the_missing_process():
    line = process_group.gone_line("isl", [1], 2, 2.5)
    assert line.startswith("island isl: process 1 of 2 is gone (no heartbeat for 2.5 s)")
    assert "coordinator" in process_group.gone_line("isl", [0], 3, 5.0)
    assert "\n" not in line


class _Device:
    def __init__(self, process_index: int) -> None:
        self.process_index, self.platform = process_index, "cpu"


def test_mesh_info_shows_processes_devices_and_the_per_device_batch():
    devices = [_Device(0), _Device(0), _Device(1), _Device(1)]
    info = process_group.mesh_info(GroupSpec("h:1", 2, 1), devices, 16, "fsdp")
    assert info["processes"] == {"count": 2, "index": 1, "coordinator": "h:1"}
    assert info["mesh"]["devices"] == 4 and info["mesh"]["local_devices"] == 2
    assert info["mesh"]["per_device_batch"] == 4 and info["mesh"]["param_sharding"] == "fsdp"


def test_a_one_process_island_shares_decisions_without_collectives():
    sync = LeaderSync(multi=False, leader=True)
    update = Update(1, 7, np.ones(3, np.float32))
    assert sync.share_updates([update], True, [2, 3]) == ([update], True)
    leaves = [np.zeros(2)]
    assert sync.gather(leaves) is leaves


def test_a_chain_of_increments_travels_as_codes_each_following_the_one_before():
    def inc(fragment: int, version: int) -> Update:
        codes = Coded("int8", 4, 3, np.zeros(3, np.int8), np.zeros(1, np.float32))
        return Update(fragment, version, None, codes)

    snapshot = Update(1, 9, np.ones(3, np.float32))
    updates = [inc(0, 5), inc(0, 6), inc(0, 8), inc(1, 8), snapshot, inc(1, 10)]
    out = travelling_codes(updates, {0: 4, 1: 7})
    # 0: 5 follows 4, 6 follows 5, 8 skips 7; 1: 8 follows 7, 9 is values, 10 follows 9
    assert [c is not None for c in out] == [True, True, False, True, False, True]
    assert all(c is u.increment for c, u in zip(out, updates, strict=True) if c is not None)
    assert travelling_codes(updates, None) == [None] * len(updates)  # the host exchange
