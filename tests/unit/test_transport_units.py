"""Pure pieces of the transport: codecs, regions, states, error mapping, slot pools, shared memory."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from common.config import TransportKind
from common.errors import ConfigError, HandshakeError, PeerDisconnected, TransportError, TransportUnavailable
from common.transport import (
    NIXL_EXTRA_HINT,
    LandingShape,
    RegionDesc,
    SlotPool,
    TransferState,
    binding_errors,
    decode_release_notification,
    encode_release_notification,
    load_nixl,
    nixl_available,
    resolve_transport_kind,
    shm_allocator,
    sweep_stale_segments,
)
from common.transport import mock_wire as wire
from common.transport.binding import BINDING_ERRORS, is_binding_error
from common.transport.regions import MemoryKind
from common.transport.shm import SHM_DIR, find_segment
from common.wire import pb2

# --- release notifications -------------------------------------------------------------------


@given(st.lists(st.integers(min_value=0, max_value=(1 << 64) - 1), max_size=64))
def test_release_notification_round_trips(leases: list[int]) -> None:
    assert decode_release_notification(encode_release_notification(leases)) == leases


@pytest.mark.parametrize(
    ("msg", "error"),
    [
        (b"", "shorter than"),
        (b"EPDX\x01\x00\x00\x00\x00\x00\x00\x00", "magic"),
        (b"EPDR\x02\x00\x00\x00\x00\x00\x00\x00", "version"),
        (b"EPDR\x01\x00\x00\x00\x02\x00\x00\x00" + b"\x00" * 8, "need exactly 28"),
        (b"EPDR\x01\x00\x00\x00\xff\xff\x00\x00", "at most"),
        ("EPDR", "must be bytes"),
    ],
)
def test_malformed_release_notifications_are_value_errors(msg: bytes, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        decode_release_notification(msg)


def test_release_notification_refuses_bad_lease_ids() -> None:
    with pytest.raises(ValueError, match="-1 is not a uint64"):
        encode_release_notification([-1])
    with pytest.raises(ValueError, match="at most 4096"):
        encode_release_notification(range(4097))


# --- regions ---------------------------------------------------------------------------------------


def test_region_of_a_tensor_and_its_descriptors() -> None:
    buffer = torch.zeros(5, 3, 8, dtype=torch.bfloat16)
    region = RegionDesc.of_tensor(buffer)
    assert (region.base_address, region.stride_bytes, region.count) == (buffer.data_ptr(), 48, 5)
    assert region.memory is MemoryKind.DRAM and region.device_id == 0
    descs = region.descriptors()
    assert descs.dtype == np.uint64 and descs.shape == (5, 3)
    assert descs[:, 0].tolist() == [buffer[i].data_ptr() for i in range(5)]
    assert set(descs[:, 1].tolist()) == {48}
    assert RegionDesc.from_proto(region.to_proto(), "buffer") == region


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"base_address": 0}, "base_address"),
        ({"stride_bytes": 0}, "stride_bytes"),
        ({"count": 0}, "count"),
        ({"base_address": (1 << 64) - 8, "stride_bytes": 8, "count": 2}, "64-bit"),
    ],
)
def test_bad_region_numbers(fields: dict[str, int], error: str) -> None:
    values = {"base_address": 4096, "stride_bytes": 64, "count": 4, **fields}
    with pytest.raises(ValueError, match=error):
        RegionDesc(**values)
    msg = pb2.MemoryRegion(memory_type=pb2.MEMORY_TYPE_DRAM, **values)
    with pytest.raises(HandshakeError, match=f"tag_region: .*{error}"):
        RegionDesc.from_proto(msg, "tag_region")


def test_landing_shape_from_the_producer_layout() -> None:
    shape = LandingShape.from_proto(pb2.CacheLayout(block_size=4, fat_dim=6, dtype=pb2.D_TYPE_FLOAT32))
    assert shape == LandingShape(4, 6, torch.float32) and shape.bytes_per_block == 96
    with pytest.raises(HandshakeError, match="dtype"):
        LandingShape.from_proto(pb2.CacheLayout(block_size=4, fat_dim=6))


# --- states and errors -------------------------------------------------------------------------


def test_transfer_states_parse_the_binding_strings() -> None:
    assert [TransferState.parse(s) for s in ("DONE", "PROC", "ERR")] == [
        TransferState.DONE, TransferState.PROCESSING, TransferState.ERROR]
    with pytest.raises(TransportError, match="'WAT'"):
        TransferState.parse("WAT")


@pytest.mark.parametrize("name", sorted(BINDING_ERRORS))
def test_every_binding_error_maps_into_our_tree_from_the_original(name: str) -> None:
    binding_cls = type(name, (Exception,), {"__module__": "nixl_cu12._bindings"})
    with pytest.raises(TransportError) as info, binding_errors("poll xfer"):
        raise binding_cls("NIXL_ERR_SOMETHING")
    assert type(info.value) is BINDING_ERRORS[name]
    assert isinstance(info.value.__cause__, binding_cls)
    assert f"poll xfer: {name} (NIXL_ERR_SOMETHING)" == str(info.value)
    assert isinstance(info.value, PeerDisconnected) == (name == "nixlRemoteDisconnectError")


def test_other_exceptions_pass_through_and_overrides_apply() -> None:
    impostor = type("nixlNotFoundError", (Exception,), {"__module__": "someone_else"})
    assert not is_binding_error(impostor())
    with pytest.raises(KeyError), binding_errors("x"):
        raise KeyError("k")
    mismatch = type("nixlMismatchError", (Exception,), {"__module__": "nixl._bindings"})
    with pytest.raises(HandshakeError), binding_errors("add agent", {"nixlMismatchError": HandshakeError}):
        raise mismatch("bad metadata")


def test_missing_nixl_names_the_extra() -> None:
    with pytest.raises(TransportUnavailable) as info:
        load_nixl(modules=("no_such_nixl_binding._api",))
    assert NIXL_EXTRA_HINT in str(info.value) and "no_such_nixl_binding._api" in str(info.value)
    with pytest.raises(ConfigError, match="must start with 'UCX_'"):
        load_nixl(ucx_env={"TLS": "tcp"})


def test_transport_kind_resolution() -> None:
    assert resolve_transport_kind("mock") is TransportKind.MOCK
    assert resolve_transport_kind(TransportKind.NIXL) is TransportKind.NIXL
    expected = TransportKind.NIXL if nixl_available()[0] else TransportKind.MOCK
    assert resolve_transport_kind("auto") is expected
    with pytest.raises(ConfigError, match="'rdma'"):
        resolve_transport_kind("rdma")


# --- slot pools and quarantine -----------------------------------------------------------------


def test_slot_pool_hands_out_each_slot_once() -> None:
    pool = SlotPool(4)
    a = pool.acquire(3)
    assert a is not None and a.dtype == np.int32 and sorted(a.tolist()) == [0, 1, 2]
    assert pool.acquire(2) is None  # capacity, not an error
    b = pool.acquire(1)
    assert b is not None and b.tolist() == [3]
    pool.release(a)
    with pytest.raises(ValueError, match="slot 0: it is free"):
        pool.release(a)
    with pytest.raises(ValueError, match="outside 0..3"):
        pool.release([4])
    with pytest.raises(ValueError, match="repeat"):
        pool.release([3, 3])
    with pytest.raises(ValueError, match="n >= 1"):
        pool.acquire(0)
    arr, values = pool.held_ids(np.array([3], dtype=np.int64))  # what a pull checks its landing ids with
    assert arr.dtype == np.int32 and arr.tolist() == values == [3]
    with pytest.raises(ValueError, match="use slot 0: it is free"):
        pool.held_ids([3, 0])
    for bad, message in (([3, 3], "repeat"), ([3, 4], "slot id 4 is outside 0..3"), ([-1], "outside"),
                         ([], "non-empty"), (np.array([3.0]), "integer"), (np.array([[3]]), "1-D")):
        with pytest.raises(ValueError, match=message):
            pool.held_ids(bad)


def test_quarantined_slots_stay_out_until_proven_quiet() -> None:
    now = [0.0]
    pool = SlotPool(3, clock=lambda: now[0], sweep_interval_s=1.0)
    ids = pool.acquire(2)
    assert ids is not None
    quiet = [False]
    calls = [0]

    def probe() -> bool:
        calls[0] += 1
        return quiet[0]

    pool.quarantine(ids, probe)
    assert pool.num_quarantined == 2 and pool.num_free == 1
    pool.release(ids)  # a no-op: the quarantine owns them
    assert pool.num_quarantined == 2 and pool.num_free == 1
    with pytest.raises(ValueError, match="cannot quarantine slot"):
        pool.quarantine(ids, probe)
    for _ in range(20):  # never handed out while unproven
        got = pool.acquire(1)
        assert got is not None and got.tolist() not in ([int(ids[0])], [int(ids[1])])
        pool.release(got)
        assert pool.acquire(2) is None
    probes_so_far = calls[0]
    got = pool.acquire(1)  # enough free slots and within the sweep interval: no probe runs
    assert got is not None and calls[0] == probes_so_far
    pool.release(got)
    quiet[0] = True
    now[0] += 2.0
    assert pool.sweep() == 2 and pool.num_quarantined == 0


def test_a_failing_probe_keeps_the_quarantine() -> None:
    pool = SlotPool(1)
    ids = pool.acquire(1)
    assert ids is not None

    def broken() -> bool:
        raise RuntimeError("probe blew up")

    pool.quarantine(ids, broken)
    assert pool.sweep() == 0 and pool.num_quarantined == 1 and pool.acquire(1) is None


@given(st.lists(st.tuples(st.sampled_from(["acquire", "release", "quarantine", "prove"]),
                          st.integers(1, 3)), max_size=60))
def test_slot_pool_state_machine(ops: list[tuple[str, int]]) -> None:
    pool = SlotPool(6)
    held: list[np.ndarray] = []
    quarantined: dict[int, list[int]] = {}
    proofs: dict[int, bool] = {}
    for op, n in ops:
        if op == "acquire":
            got = pool.acquire(n)
            if got is not None:
                assert not set(got.tolist()) & {i for ids in quarantined.values() for i in ids}
                held.append(got)
        elif op == "release" and held:
            pool.release(held.pop())
        elif op == "quarantine" and held:
            ids = held.pop()
            key = len(proofs)
            proofs[key] = False
            quarantined[key] = ids.tolist()
            pool.quarantine(ids, lambda key=key: proofs[key])
        elif op == "prove" and quarantined:
            key = next(iter(quarantined))
            proofs[key] = True
            pool.sweep()
            del quarantined[key]
        in_use = sum(len(ids) for ids in held) + sum(len(ids) for ids in quarantined.values())
        assert pool.num_free == 6 - in_use


# --- shared memory and the mock's wire -----------------------------------------------------------


def test_shm_allocator_gives_zeroed_shared_tensors_and_unlinks_them() -> None:
    t = shm_allocator((3, 5), torch.float16)
    assert t.shape == (3, 5) and t.dtype == torch.float16 and t.is_contiguous()
    assert bool((t == 0).all())
    seg = find_segment(t.data_ptr(), t.numel() * 2)
    assert seg is not None and seg.offset == 0 and os.path.exists(os.path.join(SHM_DIR, seg.name))
    view = t[1]
    del t
    gc.collect()
    assert os.path.exists(os.path.join(SHM_DIR, seg.name))  # a view keeps the segment
    del view
    gc.collect()
    assert not os.path.exists(os.path.join(SHM_DIR, seg.name))


def test_shm_allocator_maps_at_a_fixed_address() -> None:
    address = 0x3E00_0000_0000
    t = shm_allocator((4096,), torch.uint8, address=address)
    assert t.data_ptr() == address
    with pytest.raises(TransportError, match="cannot map"):
        shm_allocator((4096,), torch.uint8, address=address)  # taken: never replaced


def test_only_abandoned_segments_of_our_pid_namespace_are_swept() -> None:
    namespace = os.stat("/proc/self/ns/pid").st_ino
    abandoned = os.path.join(SHM_DIR, f"epd-mock-{namespace}-999999-0123456789abcdef")
    foreign = os.path.join(SHM_DIR, f"epd-mock-{namespace + 1}-999999-0123456789abcdef")
    for path in (abandoned, foreign):
        with open(path, "wb") as f:
            f.write(b"x")
    live = shm_allocator((8,), torch.uint8)  # its creator (us) holds the lock
    seg = find_segment(live.data_ptr(), 8)
    assert seg is not None
    try:
        assert sweep_stale_segments() >= 1
        assert not os.path.exists(abandoned)  # nobody holds its lock
        assert os.path.exists(foreign)  # another PID namespace's: never ours to judge
        assert os.path.exists(os.path.join(SHM_DIR, seg.name))
    finally:
        os.unlink(foreign)


def test_agent_card_round_trip_and_validation() -> None:
    region = wire.ExportedRegion(4096, 64, 0, "epd-mock-4026531836-1-0123456789abcdef", 0)
    card = wire.AgentCard("prod", 123, 456, (region,))
    assert wire.AgentCard.decode(card.encode()) == card
    for bad, error in [
        (b"\x80\x04pickle", "not JSON"),
        (b'{"format": "other"}', "not a mock NIXL agent card"),
        (card.encode().replace(b'"pid":123', b'"pid":-5'), "pid"),
        (card.encode().replace(b"epd-mock-4026531836-1-0123456789abcdef", b"../secret"), "invalid segment"),
        (card.encode().replace(b'"length":64', b'"length":0'), "empty or out of range"),
    ]:
        with pytest.raises(ValueError, match=error):
            wire.AgentCard.decode(bad)


def test_process_liveness() -> None:
    assert wire.liveness(os.getpid(), wire.process_start_ticks(os.getpid())) is wire.Liveness.RUNNING
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = wire.process_start_ticks(child.pid)
    child.wait()
    assert wire.liveness(child.pid, ticks) is wire.Liveness.GONE
    assert wire.liveness(os.getppid(), 1) is wire.Liveness.GONE  # a reused pid is not the same process


def test_notification_datagrams() -> None:
    assert wire.decode_notif(wire.encode_notif("agent-a", b"\x00\x01")) == ("agent-a", b"\x00\x01")
    with pytest.raises(ValueError):
        wire.decode_notif(b"\x00")
    with pytest.raises(ValueError, match="exceeds"):
        wire.encode_notif("a", b"x" * 70_000)


def test_per_record_values_are_slotted() -> None:
    records = [
        RegionDesc(4096, 64, 4),
        LandingShape(4, 8, torch.bfloat16),
        wire.ExportedRegion(4096, 64, 0, "epd-mock-4026531836-1-0123456789abcdef", 0),
        wire.AgentCard("a", 1, 2, ()),
    ]
    for record in records:
        assert not hasattr(record, "__dict__"), type(record).__name__
