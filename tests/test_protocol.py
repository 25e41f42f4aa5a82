"""paramserver.wire.protocol: framing, version and schema checks, reasons."""

import msgpack
import pytest

from paramserver.wire import protocol
from paramserver.wire.protocol import PUB, REPLY, REQUEST, ProtocolError, pack, unpack

PUSH = {
    "kind": "push",
    "id": 7,
    "island": "a",
    "round": 3,
    "fragment": 1,
    "base_version": 0,
    "tokens": 4096,
    "steps": 10,
    "plan_hash": "abc",
}


def test_round_trip_keeps_header_and_payload_frames():
    payload = [b"codec-header", memoryview(b"\x00\x01\x02")]
    frames = pack(PUSH, payload)
    header, got = unpack(frames)
    assert header["v"] == protocol.PROTOCOL_VERSION
    assert {k: header[k] for k in PUSH} == PUSH
    assert got == payload
    assert got[1] is payload[1]  # passed through, not copied


def test_unknown_fields_are_ignored():
    header, _ = unpack(pack({**PUSH, "future_field": [1, 2]}))
    assert header["future_field"] == [1, 2]


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([], "malformed"),
        ([b"\xc1\xff garbage"], "malformed"),
        ([msgpack.packb([1, 2])], "malformed"),
        ([msgpack.packb({"v": 2, "kind": "push"})], "bad_version"),
        ([msgpack.packb({"kind": "push"})], "bad_version"),
        ([msgpack.packb({**PUSH, "v": True})], "bad_version"),  # a bool is never an int
        ([msgpack.packb({**PUSH, "v": 1.0})], "bad_version"),
        ([msgpack.packb({"v": 1, "kind": "explode"})], "unknown_kind"),
        ([msgpack.packb({"v": 1, "kind": 5})], "unknown_kind"),
        ([msgpack.packb({"v": 1, "kind": "hello"})], "malformed"),
        ([msgpack.packb({"v": 1, "kind": "hello", "island": ""})], "malformed"),
        ([msgpack.packb({**PUSH, "v": 1, "round": -1})], "malformed"),
        ([msgpack.packb({**PUSH, "v": 1, "round": True})], "malformed"),
        ([msgpack.packb({**PUSH, "v": 1, "steps": 0})], "malformed"),
        ([msgpack.packb({**PUSH, "v": 1, "id": "x"})], "malformed"),
        ([b"\x00" * (protocol.MAX_HEADER_BYTES + 1)], "malformed"),
    ],
)
def test_bad_messages_raise_with_a_reason(frames, reason):
    with pytest.raises(ProtocolError) as info:
        unpack(frames)
    assert info.value.reason == reason
    assert info.value.reason in protocol.REASONS
    assert info.value.detail


def test_error_carries_the_header_when_decoded_so_replies_can_echo_the_id():
    with pytest.raises(ProtocolError) as info:
        unpack([msgpack.packb({**PUSH, "v": 1, "tokens": "many"})])
    assert info.value.header["id"] == 7
    reply = protocol.reply_header(info.value.header, "rejected", reason="malformed", detail="x")
    assert reply["id"] == 7


def _oversize(fields: dict) -> bytes:
    frame = msgpack.packb(fields, use_bin_type=True)
    assert len(frame) > protocol.MAX_HEADER_BYTES
    return frame


PAD = "x" * protocol.MAX_HEADER_BYTES


@pytest.mark.parametrize(
    ("frame", "rid"),
    [
        (_oversize({"v": 1, "kind": "init", "plan": {"pad": PAD}, "id": 9}), 9),  # id after it
        (_oversize({"id": -3, "pad": PAD}), -3),
        (_oversize({"id": True, "pad": PAD}), None),  # not an int: nothing to echo
        (_oversize({"id": "9", "pad": PAD}), None),
        (
            _oversize(
                {**{f"k{i}": 0 for i in range(protocol.OVERSIZE_ID_KEYS)}, "id": 9, "pad": PAD}
            ),
            None,
        ),  # past the keys looked at  # fmt: skip
        (_oversize([9, PAD]), None),  # not a map
        (b"\x81\xa2id\xc1" + b"\x00" * protocol.MAX_HEADER_BYTES, None),  # garbage for a value
    ],
)
def test_a_header_over_the_limit_is_malformed_and_keeps_its_int_id(frame, rid):
    with pytest.raises(ProtocolError) as info:
        unpack([frame])
    assert info.value.reason == "malformed" and "limit" in info.value.detail
    assert info.value.header == (None if rid is None else {"id": rid})


def test_bytes_after_the_header_map_are_malformed_with_its_id():
    with pytest.raises(ProtocolError) as info:
        unpack([msgpack.packb({**PUSH, "v": 1}) + b"\x00"])
    assert info.value.reason == "malformed" and info.value.header["id"] == 7


def test_roles_pick_the_table():
    hb_pub = pack({"kind": "heartbeat", "shard": 0, "seq": 4})
    assert unpack(hb_pub, role=PUB)[0]["seq"] == 4
    assert unpack(hb_pub, role=REPLY)[0]["shard"] == 0
    with pytest.raises(ProtocolError) as info:
        unpack(hb_pub, role=REQUEST)  # a request heartbeat needs `island`
    assert info.value.reason == "malformed"
    with pytest.raises(ProtocolError) as info:
        unpack(pack({"kind": "update", "shard": 0, "seq": 1}), role=REQUEST)
    assert info.value.reason == "unknown_kind"
    with pytest.raises(ValueError, match="role"):
        unpack(hb_pub, role="sideways")


def test_every_schema_type_name_is_known():
    for table in protocol.SCHEMAS.values():
        for fields in table.values():
            assert set(fields.values()) <= set(protocol._CHECKS)


def test_pack_needs_a_kind():
    with pytest.raises(ProtocolError):
        pack({"island": "a"})


def test_versions_wire_round_trip_and_message_bytes():
    assert protocol.versions_to_wire({2: 5, 0: 3}) == {"0": 3, "2": 5}
    assert protocol.message_bytes([b"abc", memoryview(b"de")]) == 5


WELCOME = {
    "kind": "welcome",
    "shard": 0,
    "num_shards": 1,
    "num_fragments": 2,
    "endpoints": [["tcp://a:1", "tcp://a:2"]],
    "initialized": False,
    "plan_hash": None,
    "heartbeat_interval_s": 1.0,
    "liveness": 5,
    "seq": 0,
}


def test_optional_fields_of_this_round_are_checked_when_present():
    assert "storage_error" in protocol.REASONS and "island_in_use" in protocol.REASONS
    welcome, _ = unpack(pack({**WELCOME, "max_message_bytes": 4096}), role=REPLY)
    assert welcome["max_message_bytes"] == 4096
    assert "max_message_bytes" not in unpack(pack(WELCOME), role=REPLY)[0]  # older shards
    hello, _ = unpack(pack({"kind": "hello", "island": "a", "session": "f00d"}))
    assert hello["session"] == "f00d"
    ack = {"kind": "ack", "round": 1, "fragment": 0, "outcome": "rejected", "version": 0}
    assert unpack(pack({**ack, "reason": "storage_error", "detail": "disk full"}), role=REPLY)
    for frames, role in [
        (pack({**WELCOME, "max_message_bytes": 0}), REPLY),
        (pack({**WELCOME, "max_message_bytes": True}), REPLY),
        (pack({"kind": "hello", "island": "a", "session": ""}), REQUEST),
        (pack({**ack, "reason": "storage_error", "detail": 3}), REPLY),
    ]:
        with pytest.raises(ProtocolError) as info:
            unpack(frames, role=role)
        assert info.value.reason == "malformed"
