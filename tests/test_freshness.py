"""Seals and the replay guard on their own (a fake clock): what is refused, why, that memory of seen
counters stays bounded (by the clock window and by a number of senders), and that what it accepted
is refused after a restart, however soon."""

from __future__ import annotations

import json

import pytest
from tahnode.net.auth import BadMac, Sealer, SwarmKey
from tahnode.net.freshness import (CLOCK_WINDOW_S, TOKEN_ONLY, RefusalReason, ReplayGuard, SealCounter, SealRefused,
                                   SenderKind)
from tahnode.net.sender_table import MAX_SENDERS, REORDER
from tahnode.proto import tahnode_pb2 as pb


class Clock:
    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def refused(guard: ReplayGuard, *args, **kw) -> RefusalReason:
    with pytest.raises(SealRefused) as err:
        guard.check(*args, **kw)
    return err.value.reason


def test_counters_follow_the_clock_and_never_repeat_or_go_back():
    clock = Clock()
    counter = SealCounter(clock)
    first = counter.next()
    assert first == int(clock.t * 1e6)
    assert counter.next() == first + 1  # same microsecond: still increasing
    clock.t -= 30  # the clock steps back
    assert counter.next() == first + 2
    clock.t += 60
    assert counter.next() == int(clock.t * 1e6)


def test_the_guard_refuses_each_kind_of_bad_seal_and_counts_it():
    clock = Clock()
    guard = ReplayGuard("n1", "run-a", clock=clock)
    now = int(clock.t * 1e6)
    guard.check("run-a", "n0", "n1", now)
    assert refused(guard, "run-a", "n0", "n1", now) is RefusalReason.REPLAYED
    assert refused(guard, "run-a", "n0", "n2", now + 1) is RefusalReason.WRONG_RECIPIENT
    assert refused(guard, "run-b", "n0", "n1", now + 2) is RefusalReason.WRONG_RUN
    assert refused(guard, "", "n0", "n1", now + 3) is RefusalReason.WRONG_RUN
    guard.check("", "n0", "n1", now + 3, run_optional=True)  # a join: the run is not known yet
    assert refused(guard, "run-a", "", "n1", now + 4) is RefusalReason.MISSING
    assert refused(guard, "run-a", "n0", "n1", 0) is RefusalReason.MISSING
    late = now + int((CLOCK_WINDOW_S + 1) * 1e6)
    assert refused(guard, "run-a", "n0", "n1", late) is RefusalReason.OFF_CLOCK
    assert dict(guard.refused) == {RefusalReason.REPLAYED: 1, RefusalReason.WRONG_RECIPIENT: 1,
                                   RefusalReason.WRONG_RUN: 2, RefusalReason.MISSING: 2, RefusalReason.OFF_CLOCK: 1}


def test_a_seal_from_before_the_receiver_started_is_refused_within_the_window():
    """A restarted receiver has forgotten what it saw: what was sealed before it started (beyond
    a few seconds of clock skew) is a recording, however recent."""
    clock = Clock()
    guard = ReplayGuard("coordinator", "run-a", clock=clock)
    recorded = int((clock.t - 20) * 1e6)  # 20 s ago: inside the clock window
    assert refused(guard, "run-a", "n0", "coordinator", recorded) is RefusalReason.OFF_CLOCK
    guard.check("run-a", "n0", "coordinator", int((clock.t - 2) * 1e6))  # 2 s of skew is fine


def test_seen_counters_are_forgotten_after_the_window():
    """A sender's last REORDER counters are kept exactly, the older ones as a floor: all of them stay
    refused, and the whole sender goes once its counters are off the clock."""
    clock = Clock()
    guard = ReplayGuard("n1", clock=clock)
    first = int(clock.t * 1e6)
    for k in range(1000):
        guard.check("", "n0", "n1", first + k)
    record = guard.tables[SenderKind.SIGNED].senders["n0"]
    assert len(record.seen) == REORDER and record.floor == first + 1000 - REORDER - 1
    assert all(refused(guard, "", "n0", "n1", first + k) is RefusalReason.REPLAYED for k in (0, 500, 999))
    clock.t += CLOCK_WINDOW_S + 5
    guard.check("", "n2", "n1", int(clock.t * 1e6))
    assert guard.highs() == {"n2": int(clock.t * 1e6)}


def test_made_up_senders_are_forgotten_after_the_window_in_memory_on_disk_and_after_a_restart(tmp_path):
    """Issue 39, finding 5: each sender's highest counter was kept for ever, and saved: 200 k made-up
    sender names in token-sealed pings gave a 7.4 MB file, reloaded after a restart. Once off the
    clock, a sender's counters refuse nothing a clock check would not, so they are dropped."""
    clock, store = Clock(), tmp_path / "seen-counters.json"
    guard = ReplayGuard("coordinator", "run", clock=clock, store=store)
    for k in range(2000):
        guard.check("run", f"made-up-{k}", "coordinator", int(clock.t * 1e6) + k)
    guard.save()
    assert len(guard.highs()) == 2000 and store.stat().st_size > 2000 * 10
    clock.t += CLOCK_WINDOW_S + 5
    guard.check("run", "n0", "coordinator", int(clock.t * 1e6))  # an honest sender, after the window
    guard.save()
    assert set(guard.highs()) == {"n0"}
    assert store.stat().st_size < 300
    stale = {f"made-up-{k}": int((clock.t - 2 * CLOCK_WINDOW_S) * 1e6) for k in range(1000)}
    store.write_text(json.dumps({**stale, "n0": int(clock.t * 1e6)}))  # a file of the older form, saved before
    clock.t += 1
    again = ReplayGuard("coordinator", "run", clock=clock, store=store)
    assert set(again.highs()) == {"n0"}
    assert refused(again, "run", "n0", "coordinator", int((clock.t - 1) * 1e6)) is RefusalReason.REPLAYED


def test_the_guard_keeps_a_bounded_number_of_senders_and_a_forgotten_ones_seals_stay_refused(tmp_path):
    """Issue 60: within one clock window the guard kept every sender it saw: 200 000 made-up senders
    made a 10.8 MB file, saved on the event loop every 2 s (326 ms each) and read back after a restart.
    A table keeps MAX_SENDERS, the least recently seen forgotten first; a forgotten sender's seals stay
    refused (its bucket's eviction floor), in memory and after a restart; a sender seen all along is
    kept; and a forgotten sender whose clock ran 50 s ahead holds back the newcomers of its bucket only."""
    clock, store = Clock(), tmp_path / "seen-counters.json"
    guard = ReplayGuard("coordinator", "run", clock=clock, store=store)
    table, now = guard.tables[SenderKind.SIGNED], int(clock.t * 1e6)
    ahead = now + 50_000_000
    guard.check("run", "ahead", "coordinator", ahead)  # a made-up sender whose clock runs 50 s ahead
    made_up = [name for name in (f"made-up-{k}" for k in range(3 * MAX_SENDERS + 100))
               if table.evicted.bucket(name) != table.evicted.bucket("ahead")][:3 * MAX_SENDERS]
    for k, name in enumerate(made_up):
        guard.check("run", name, "coordinator", now + k)
        if k % 1000 == 0:
            guard.check("run", "member", "coordinator", now + k + 1)  # a member that keeps sealing
    guard.save()
    assert len(table) == MAX_SENDERS and "member" in table.senders and "ahead" not in table.senders
    live = sum(1 for f in table.evicted.floors if f)  # the buckets of the 2 * MAX_SENDERS + 1 forgotten
    assert live <= 2 * MAX_SENDERS + 1 and store.stat().st_size < 40 * MAX_SENDERS + 30 * live + 300
    for name, counter in (("ahead", ahead), (made_up[0], now)):
        assert refused(guard, "run", name, "coordinator", counter) is RefusalReason.REPLAYED
    neighbour = next(n for n in (f"newcomer-{k}" for k in range(10**6))
                     if table.evicted.bucket(n) == table.evicted.bucket("ahead"))
    assert refused(guard, "run", neighbour, "coordinator", now + 10**6) is RefusalReason.REPLAYED
    guard.check("run", "newcomer", "coordinator", now + 10**6)  # one of any other bucket is welcome
    guard.check("run", "member", "coordinator", now + 3 * MAX_SENDERS + 1)
    again = ReplayGuard("coordinator", "run", clock=clock, store=store)
    assert len(again.highs()) == MAX_SENDERS
    for name, counter in (("ahead", ahead), (made_up[0], now), ("member", now + 3 * MAX_SENDERS + 1)):
        assert refused(again, "run", name, "coordinator", counter) is RefusalReason.REPLAYED


def test_the_guard_writes_its_snapshot_off_the_callers_thread_and_only_when_something_changed(tmp_path, monkeypatch):
    """Issue 60: the guard wrote its whole file from `check`, on the event loop, every 2 s. Now a
    thread replaces the snapshot (temp file, os.replace), and only when counters were written since."""
    import os
    import threading

    from tahnode.net.counter_journal import SAVE_S

    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: replaced.append(threading.current_thread()) or real_replace(a, b))
    clock, store = Clock(), tmp_path / "seen-counters.json"
    guard = ReplayGuard("coordinator", "run", clock=clock, store=store)
    for k in range(3):
        clock.t += SAVE_S + 1
        guard.check("run", "n0", "coordinator", int(clock.t * 1e6))
        if guard.journal.writer is not None:
            guard.journal.writer.join()
    assert len(replaced) == 3 and threading.current_thread() not in replaced
    for k in range(3):  # replays only: nothing new to write
        clock.t += SAVE_S + 1
        refused(guard, "run", "n0", "coordinator", int((clock.t - 3 * (SAVE_S + 1)) * 1e6))
    assert len(replaced) == 3
    assert [p.name for p in tmp_path.iterdir()] == ["seen-counters.json"]  # the journals folded into it are gone


def test_a_seal_accepted_just_before_a_restart_is_refused_after_it(tmp_path):
    """Issue 60: a seal accepted but not yet saved (the guard saved every 2 s) and replayed to the
    restarted receiver within START_SLACK_S was accepted again. Its counter is written down before
    it is accepted, and read back by the next process, whenever it restarts."""
    now = [1000.0]
    store = tmp_path / "seen-counters.json"
    first = ReplayGuard("b", "run", clock=lambda: now[0], store=store)
    first.check("run", "a", "b", int((now[0] - 0.5) * 1e6))  # saved long ago: nothing since
    sealed = int(now[0] * 1e6)
    first.check("run", "a", "b", sealed)
    first.check("run", TOKEN_ONLY + "p", "b", sealed)
    now[0] += 1  # b is killed and back within a second; nothing was saved in between
    again = ReplayGuard("b", "run", clock=lambda: now[0], store=store)
    assert refused(again, "run", "a", "b", sealed) is RefusalReason.REPLAYED
    assert refused(again, "run", TOKEN_ONLY + "p", "b", sealed) is RefusalReason.REPLAYED
    again.check("run", "a", "b", sealed + 1)


def test_a_seal_the_guard_cannot_write_down_is_refused(tmp_path, monkeypatch):
    from tahnode.net.counter_journal import CounterJournal

    def full(self, sender, counter):
        raise OSError(28, "No space left on device")

    clock = Clock()
    guard = ReplayGuard("b", "run", clock=clock, store=tmp_path / "seen-counters.json")
    sealed = int(clock.t * 1e6)
    with monkeypatch.context() as m:
        m.setattr(CounterJournal, "append", full)
        assert refused(guard, "run", "a", "b", sealed) is RefusalReason.UNRECORDED
    guard.check("run", "a", "b", sealed)  # not counted as seen: once it can be written, it is accepted
    assert ReplayGuard("b", "run", clock=clock, store=tmp_path / "seen-counters.json").highs() == {"a": sealed}


def test_a_sealed_message_is_checked_mac_first_then_seal_then_speaker():
    key = SwarmKey("t")
    alice, coordinator = Sealer(key, "alice", "run-a"), Sealer(key, "coordinator", "run-a")
    msg = alice.seal(pb.HeartbeatRequest(node_id="alice"), "coordinator")
    assert coordinator.check(msg, speaks_for="alice") == "alice"
    tampered = pb.HeartbeatRequest()
    tampered.CopyFrom(msg)
    tampered.node_id = "bob"
    with pytest.raises(BadMac):
        coordinator.check(tampered, speaks_for="bob")
    bob_speaks_for_alice = Sealer(key, "bob", "run-a").seal(pb.HeartbeatRequest(node_id="alice"), "coordinator")
    with pytest.raises(SealRefused) as err:
        coordinator.check(bob_speaks_for_alice, speaks_for="alice")
    assert err.value.reason is RefusalReason.WRONG_SENDER
    assert coordinator.guard.refused[RefusalReason.BAD_MAC] == 1


def test_a_replay_after_the_receiver_restarted_is_refused(tmp_path):
    """Issue 26, finding 9: the seen counters lived in memory and the start-time slack used the
    sender's clock, so a message recorded shortly before a restart, from a sender whose clock runs
    ahead, was accepted again after it. Each sender's highest counter is now kept on disk."""
    now = [1000.0]
    store = tmp_path / "seen-counters.json"
    first = ReplayGuard("b", "run", clock=lambda: now[0], store=store)
    ahead = int((now[0] + 50) * 1e6)  # the sender's clock runs 50 s ahead (within the window)
    first.check("run", "a", "b", ahead)
    first.save()
    now[0] += 10  # b restarts
    again = ReplayGuard("b", "run", clock=lambda: now[0], store=store)
    with pytest.raises(SealRefused, match="before this process restarted") as refused:
        again.check("run", "a", "b", ahead)
    assert refused.value.reason is RefusalReason.REPLAYED
    again.check("run", "a", "b", ahead + 1)  # what a sends next is fine
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in tmp_path.iterdir())
    store.write_text("not json")  # a damaged file is not fatal: the journal beside it still holds ahead + 1
    assert ReplayGuard("b", "run", clock=lambda: now[0], store=store).highs() == {"a": ahead + 1}


def test_frames_carry_a_keyed_blake3_mac_and_older_hmac_frames_still_verify():
    """A frame's MAC is BLAKE3 keyed by a key derived from the swarm key (as fast as a copy of its
    data); frames of older senders (HMAC-SHA256, no mac_kind) verify; a MAC labelled with the other
    kind, an unknown kind, another token or one changed byte of data do not."""
    key = SwarmKey("t")
    frame = Sealer(key, "alice", "run-a").frame("bob", 7, 0, 1, [b"some ", memoryview(b"data")]).head
    frame.data = b"some data"
    assert frame.mac_kind == pb.BLAKE3_KEYED and key.verify_frame(frame)
    older = pb.Frame()
    older.CopyFrom(frame)
    older.mac_kind, older.mac = pb.HMAC_SHA256, key.frame_mac(frame, kind=pb.HMAC_SHA256)
    assert key.verify_frame(older) and older.mac != frame.mac
    relabelled = pb.Frame()
    relabelled.CopyFrom(frame)
    relabelled.mac_kind = pb.HMAC_SHA256
    assert not key.verify_frame(relabelled)
    relabelled.mac_kind = 7
    assert not key.verify_frame(relabelled)
    assert not SwarmKey("other").verify_frame(frame)
    frame.data = b"some Data"
    assert not key.verify_frame(frame)


def test_the_frame_mac_is_as_docs_wire_format_gives_it():
    """BLAKE3 keyed by BLAKE3-derive_key(context, SHA-256("tahnode-v1\\0" || token)) over
    run 0 sender 0 recipient, 0, seq u64, index u32, count u32 and the data."""
    frame = Sealer(SwarmKey("t"), "alice", "run-a").frame("bob", 7, 0, 1, [b"some data"])
    assert frame.mac.hex() == "1d91a8f49d289f2a39ea17752add6ea8bf547abbb852afe060e431f04aa1f7dd"


def test_a_token_only_message_sealed_as_a_node_never_raises_that_nodes_floor(tmp_path):
    """Issue 39 (low): a token holder's ping sealed as V with a counter 59 s ahead raised V's highest
    counter, kept on disk; after the receiver restarted, V's own frames were refused as replays for
    those 59 s. Messages no node key signed (pings, probes) keep counters of their own."""
    from tahnode.net.identity import NodeKey

    import time

    clock, key, store = Clock(time.time()), SwarmKey("t"), tmp_path / "seen-counters.json"
    victim = Sealer(key, "v", "run", identity=NodeKey.generate())
    forger = Sealer(key, "v", "run")
    forger.counter = SealCounter(lambda: clock.t + 59)  # its clock 59 s ahead
    receiver = Sealer(key, "b", "run", seen_file=store)
    receiver.guard.clock = clock
    ping = forger.seal(pb.PingRequest(nonce=b"x"), "b")
    assert receiver.check(ping) == "v"  # token only: accepted, and counted apart
    with pytest.raises(SealRefused):
        receiver.check(ping)  # a replay of it still is refused
    receiver.guard.save()
    again = Sealer(key, "b", "run", seen_file=store)  # b restarts
    again.guard.clock = clock
    clock.t += 5  # b is back 5 s later; v's next frame carries its own clock
    frame = victim.frame("b", victim.counter.next(), 0, 1, [b"data"]).head
    frame.data = b"data"
    again.check_frame(frame, first=True, signed_by=victim.identity.public)  # before: refused as replayed
