"""paramserver.client.shards and the Shards' control / bulk links: pure rules, no sockets."""

import pytest

from paramserver.client.shards import (
    FLOW_WINDOW_BYTES,
    MAX_BULK_LINKS,
    Close,
    Open,
    Send,
    ShardLink,
    Shards,
    bulk_flows,
    flow_buffer_bytes,
    pieces_in_flight,
)
from paramserver.wire import protocol

pytestmark = pytest.mark.timeout(30)
MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("control", "configured", "bdp", "flows"),
    [
        (False, 4, 10**9, 0),  # one connection carries everything
        (True, 3, 0, 3),  # as configured
        (True, 0, 0, 1),  # unknown BDP: one bulk flow
        (True, 0, 4 * MIB, 1),  # fits one flow's autotuned window
        (True, 0, 4 * MIB + 1, 2),
        (True, 0, 15_000_000, 4),  # 2 Gbit/s x 60 ms: ceil(15e6 / 4 MiB) = 4
        (True, 0, 10**9, MAX_BULK_LINKS),
    ],
)
def test_bulk_flows(control, configured, bdp, flows):
    assert bulk_flows(control, configured, bdp) == flows


def test_a_buffer_is_set_only_where_it_beats_autotuning_and_the_kernel_allows_it():
    assert flow_buffer_bytes(0, 1, 10**9) == 0  # unknown BDP
    # 4 MiB plus a quarter: more than autotuning's 4 MiB buffer (whose window is less)
    assert flow_buffer_bytes(FLOW_WINDOW_BYTES, 1, 10**9) == 5 * MIB
    assert flow_buffer_bytes(3 * MIB, 1, 10**9) == 0  # 3.75 MiB: autotuning reaches it
    # 24 MiB over 2 flows: 12 MiB each, plus a quarter = 15 MiB
    assert flow_buffer_bytes(24 * MIB, 2, 10**9) == 15 * MIB
    assert flow_buffer_bytes(24 * MIB, 2, 212992) == 0  # wmem_max's default: capped, so not set
    assert flow_buffer_bytes(8 * MIB, 4, 10**9) == 0  # 2.5 MiB each: autotuning reaches it


def test_one_piece_in_flight_per_bulk_flow_holding_no_more_than_two_full_pieces():
    assert pieces_in_flight(0, 64 * MIB) == (2, 64 * MIB)  # one connection: as before
    assert pieces_in_flight(2, 64 * MIB) == (2, 64 * MIB)
    assert pieces_in_flight(4, 64 * MIB) == (4, 32 * MIB)  # 4 x 32 MiB = 2 x 64 MiB
    assert pieces_in_flight(3, 3000) == (3, 2000)


def _header(effect: Send) -> dict:
    header, _ = protocol.unpack(effect.frames, protocol.REQUEST)
    return header


def test_control_and_bulk_links_of_a_shard():
    net = Shards("isl", "tok", bulk_links=2)
    shard = ShardLink(0, "tcp://s:1", "tcp://s:2")
    net.open(shard, "dealer")
    opened = net.flush()
    assert [(e.role, e.endpoint) for e in opened] == [("dealer", "tcp://s:1")] + [
        ("bulk", "tcp://s:1")
    ] * 2
    control, bulk = shard.dealer, shard.bulk
    assert all(net.owner(link) == ("dealer", shard) for link in [control, *bulk])
    # nothing attached yet: everything goes on the control link
    net.request(shard, "snapshot", 0, fragment=0)
    assert [e.link for e in net.flush()] == [control]
    # a welcome on the control link attaches both bulk links (hello + attach + session)
    assert not net.on_link_reply(shard, control, {"kind": "welcome"})
    attaches = net.flush()
    assert [e.link for e in attaches] == bulk
    for effect in attaches:
        assert _header(effect) | {"id": 0} == {
            "v": 1, "kind": "hello", "island": "isl", "session": "tok", "attach": True, "id": 0
        }  # fmt: skip
    # bulk kinds on the attached bulk link with the fewest bytes in flight (ties in
    # turn); control stays on the control link
    net.send_frames(shard, [b"x" * 1000], key=(0, 1))
    net.send_frames(shard, [b"x" * 500], key=(1, 1))
    net.send_frames(shard, [b"x" * 100], key=(2, 1))  # 500 bytes in flight < 1000
    net.send(shard, {"kind": "heartbeat"})
    assert [e.link for e in net.flush()] == [bulk[0], bulk[1], bulk[1], control]
    assert shard.flows.load == {bulk[0]: 1000, bulk[1]: 600}
    # an ack takes its push's bytes off its link (whatever link the ack came on)
    net.on_link_reply(shard, bulk[1], {"kind": "ack", "fragment": 0, "round": 1})
    net.send_frames(shard, [b"x" * 10], key=(3, 1))
    assert [e.link for e in net.flush()] == [bulk[0]]
    # the attach's welcome is taken here; a refused one leaves the link unused
    rid = _header(attaches[0])["id"]
    assert net.on_link_reply(shard, bulk[0], {"kind": "rejected", "id": rid, "reason": "x"})
    net.send_frames(shard, [b"push"], key=(0, 2))
    assert [e.link for e in net.flush()] == [bulk[1]]
    # an unknown_island on a bulk link: unused until the next welcome re-attaches it
    assert not net.on_link_reply(shard, bulk[1], {"kind": "ack", "reason": "unknown_island"})
    net.send_frames(shard, [b"push"], key=(0, 2))
    assert [e.link for e in net.flush()] == [control]
    net.on_link_reply(shard, control, {"kind": "welcome"})
    assert sorted(e.link for e in net.flush()) == bulk
    # island_in_use on a bulk link (a restarted shard bound the island to the control
    # link's hello): the link is unused until re-attached, and the refusal is not final
    refusal = {"kind": "ack", "outcome": "rejected", "reason": "island_in_use"}
    assert not net.on_link_reply(shard, bulk[0], refusal)
    assert refusal["reason"] == "unknown_island" and bulk[0] not in shard.attached
    net.send_frames(shard, [b"push"], key=(0, 2))
    assert [e.link for e in net.flush()] == [bulk[1]]
    net.on_link_reply(shard, control, {"kind": "welcome"})
    assert [e.link for e in net.flush()] == [bulk[0]]
    # a reconnect replaces the control link and the bulk links
    net.open(shard, "dealer")
    effects = net.flush()
    assert {e.link for e in effects if isinstance(e, Close)} == {control, *bulk}
    assert [e.role for e in effects if isinstance(e, Open)] == ["dealer", "bulk", "bulk"]
    assert shard.attached == set()


def test_without_bulk_links_one_dealer_carries_everything():
    net = Shards("isl", "tok", bulk_links=0)
    shard = ShardLink(0, "tcp://s:1", "tcp://s:2")
    net.open(shard, "dealer")
    net.flush()
    net.on_link_reply(shard, shard.dealer, {"kind": "welcome"})
    net.send_frames(shard, [b"push"], key=(0, 1))
    assert [e.link for e in net.flush()] == [shard.dealer]


def _attached_shard(links: int) -> tuple[Shards, ShardLink]:
    """A shard whose control link was welcomed and whose `links` bulk links were attached."""
    net = Shards("isl", "tok", bulk_links=links)
    shard = ShardLink(0, "tcp://s:1", "tcp://s:2")
    net.open(shard, "dealer")
    net.flush()
    net.on_link_reply(shard, shard.dealer, {"kind": "welcome"})
    for attach in net.flush():
        welcome = {"kind": "welcome", "id": _header(attach)["id"]}
        assert net.on_link_reply(shard, attach.link, welcome)
    assert shard.confirmed == set(shard.bulk)
    return net, shard


def test_a_dead_bulk_link_is_replaced_and_what_it_carried_goes_again():
    net, shard = _attached_shard(2)
    first, second = shard.bulk
    big, small = [b"x" * 1000], [b"y" * 10]
    net.send_frames(shard, big, key=(0, 1))  # on the first
    net.request(shard, "snapshot", 0, fragment=0)  # on the second (nothing in flight)
    net.send_frames(shard, small, key=(1, 1))  # on the second (fewer bytes in flight)
    sent = net.flush()
    assert [e.link for e in sent] == [first, second, second]
    snapshot = sent[1]
    # the second one's connection dies: closed, replaced, attached, and then its two
    # messages go again, whole and unchanged (the push under its ledger key, the request
    # under its id), on the link with the fewest bytes in flight: the fresh one
    net.on_link_down(shard, second)
    effects = net.flush()
    assert isinstance(effects[0], Close) and effects[0].link == second
    assert isinstance(effects[1], Open) and effects[1].role == "bulk"
    fresh = effects[1].link
    assert shard.bulk == [first, fresh] and net.owner(second) is None
    attach, again_snapshot, again_push = effects[2:]
    assert attach.link == fresh and _header(attach)["attach"] is True
    assert again_snapshot.link == fresh and again_snapshot.frames is snapshot.frames
    assert again_push.link == fresh and again_push.frames is small and again_push.key == (1, 1)
    assert len(effects) == 5  # the first link's push is not touched
    # the control link's connection is left to liveness; an unknown link is ignored
    net.on_link_down(shard, shard.dealer)
    net.on_link_down(shard, 999)
    assert net.flush() == []


def test_a_bulk_link_that_dies_before_its_attach_was_welcomed_is_replaced_at_the_next_welcome():
    net = Shards("isl", "tok", bulk_links=2)
    shard = ShardLink(0, "tcp://s:1", "tcp://s:2")
    net.open(shard, "dealer")
    net.flush()
    net.on_link_reply(shard, shard.dealer, {"kind": "welcome"})
    net.flush()  # the attaches, not answered yet
    gone = shard.bulk[0]
    net.on_link_down(shard, gone)
    effects = net.flush()
    assert [type(e) for e in effects] == [Close]  # not reopened: the shard may be going away
    assert len(shard.bulk) == 1 and gone not in shard.bulk
    net.on_link_reply(shard, shard.dealer, {"kind": "welcome"})  # e.g. a reconnect's
    effects = net.flush()
    assert [type(e) for e in effects] == [Open, Send] and len(shard.bulk) == 2
