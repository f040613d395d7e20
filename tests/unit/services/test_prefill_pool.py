"""The decode worker's prefill pool: address forms, DNS refresh, least-loaded choice, peers left
out while unreachable."""

import asyncio
import time

import pytest

from services.decode import prefill_pool
from services.decode.prefill_pool import NoCompatiblePeer, PrefillPool, resolve
from services.settings import ServiceSettings, parse_prefill_address


@pytest.mark.parametrize("text, expected", [
    ("10.0.0.1:50051", ("static", ["10.0.0.1:50051"])),
    ("a:1, b:2", ("static", ["a:1", "b:2"])),
    ("dns:///rekv-prefill-headless.ns.svc.cluster.local:50051",
     ("dns", ["rekv-prefill-headless.ns.svc.cluster.local:50051"])),
])
def test_address_forms(text, expected):
    assert parse_prefill_address(text) == expected


@pytest.mark.parametrize("text", ["", "nohost", "a:1,b", "dns:///name", "a:99999", "dns:///:5"])
def test_bad_addresses_name_the_field(text):
    with pytest.raises(ValueError, match="prefill_address"):
        parse_prefill_address(text)


def test_settings_need_an_advertised_host_behind_a_wildcard():
    with pytest.raises(ValueError, match="advertise_host"):
        ServiceSettings(role="decode", host="0.0.0.0", prefill_address="p:1")
    ServiceSettings(role="decode", host="0.0.0.0", advertise_host="10.1.2.3", plaintext=True,
                    prefill_address="dns:///p:1")


def test_resolve_reads_the_system_resolver():
    assert resolve("localhost:7000") == ["127.0.0.1:7000"] or "[::1]:7000" in resolve(
        "localhost:7000")


def test_least_loaded_then_round_robin_and_down_peers_left_out():
    async def scenario():
        pool = PrefillPool("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", down_s=60)
        first = [pool.pick() for _ in range(3)]
        assert {p.address for p in first} == set(pool.peers)  # each takes one before any twice
        for peer in first:
            pool.report(peer, reported_queue=0)
        busy = pool.peers["127.0.0.1:1"]
        pool.report(pool.pick(), reported_queue=0)
        busy.reported_queue = 5  # as its last reply said
        for _ in range(4):
            peer = pool.pick()
            assert peer is not busy
            pool.report(peer, reported_queue=0)
        down = pool.peers["127.0.0.1:2"]
        down.in_flight += 1
        pool.report(down, unreachable=True)
        for _ in range(6):
            peer = pool.pick()
            assert peer.address == "127.0.0.1:3"
            pool.report(peer, reported_queue=0)
        for peer in pool.peers.values():  # every one down: all are tried again
            peer.down_until = float("inf")
        assert pool.pick().address in pool.peers
        await pool.close()

    asyncio.run(scenario())


def test_a_peer_of_another_model_is_left_out_logged_and_every_one_incompatible_raises(caplog):
    ours, theirs = "ab" * 32, "cd" * 32

    async def scenario():
        pool = PrefillPool("127.0.0.1:1,127.0.0.1:2", incompatible_s=60)
        other, good = pool.peers["127.0.0.1:1"], pool.peers["127.0.0.1:2"]
        with caplog.at_level("WARNING", logger="rekv.decode.pool"):
            pool.mark_incompatible(other, theirs, ours)
        assert [r.getMessage() for r in caplog.records] == [
            f"prefill pool: 127.0.0.1:1 serves another model (fingerprint {theirs}, this "
            f"worker's {ours}); left out for 60 s"]
        assert pool.incompatible() == {"127.0.0.1:1": True, "127.0.0.1:2": False}
        for _ in range(4):
            peer = pool.pick()
            assert peer is good
            pool.report(peer, reported_queue=0)
        good.down_until = float("inf")  # down, but the one that serves this model
        assert pool.pick() is good
        pool.report(good, reported_queue=0)
        pool.mark_incompatible(good, theirs, ours)
        with pytest.raises(NoCompatiblePeer, match="every replica serves another model"):
            pool.pick()
        other.incompatible_until = time.monotonic() - 1  # its while is over: tried again
        assert pool.pick() is other and pool.incompatible()["127.0.0.1:1"] is False
        await pool.close()

    asyncio.run(scenario())


def test_dns_refresh_adds_and_retires_peers(monkeypatch):
    answers = [["10.0.0.1:50051"], ["10.0.0.1:50051", "10.0.0.2:50051"], ["10.0.0.2:50051"]]
    monkeypatch.setattr(prefill_pool, "resolve", lambda target: answers.pop(0))

    async def scenario():
        pool = PrefillPool("dns:///prefill:50051", refresh_s=3600)
        await pool.start()
        assert list(pool.peers) == ["10.0.0.1:50051"]
        held = pool.pick()  # a call in flight with the peer that is about to vanish
        await pool.refresh()
        assert sorted(pool.peers) == ["10.0.0.1:50051", "10.0.0.2:50051"]
        await pool.refresh()
        assert list(pool.peers) == ["10.0.0.2:50051"]
        assert pool.pick().address == "10.0.0.2:50051"
        pool.report(held, reported_queue=0)  # the retired peer's call still ends cleanly
        await pool.close()

    asyncio.run(scenario())


def test_an_unresolvable_name_keeps_the_known_peers(monkeypatch):
    calls = iter([["10.0.0.1:50051"]])

    def flaky(target):
        try:
            return next(calls)
        except StopIteration:
            raise OSError("temporary failure in name resolution") from None

    monkeypatch.setattr(prefill_pool, "resolve", flaky)

    async def scenario():
        pool = PrefillPool("dns:///prefill:50051")
        await pool.start()
        await pool.refresh()
        assert list(pool.peers) == ["10.0.0.1:50051"]
        await pool.close()

    asyncio.run(scenario())


def test_new_peers_are_connected_ahead_and_asked_again_while_unreachable():
    answers = {"127.0.0.1:1": [None, None, True], "127.0.0.1:2": [False]}
    calls = []

    async def on_added(peer):
        calls.append((peer.address, time.monotonic()))
        return answers[peer.address].pop(0)

    async def scenario():
        pool = PrefillPool("127.0.0.1:1,127.0.0.1:2", refresh_s=0.2, on_added=on_added)
        await pool.start()
        # start waited for the first answers, not for the retries
        assert sorted(a for a, _ in calls) == ["127.0.0.1:1", "127.0.0.1:2"]
        await asyncio.sleep(1.2)
        await pool.close()

    asyncio.run(scenario())
    retried = [t for a, t in calls if a == "127.0.0.1:1"]
    assert len(retried) == 3 and [a for a, _ in calls].count("127.0.0.1:2") == 1
    assert retried[1] - retried[0] >= 0.45 and retried[2] - retried[1] >= 0.18  # backoff


def test_start_waits_a_bounded_time_and_close_or_retirement_stops_the_asking(monkeypatch):
    answers = [["10.0.0.1:50051"], ["10.0.0.2:50051"]]
    monkeypatch.setattr(prefill_pool, "resolve", lambda target: answers.pop(0))
    hanging = []

    async def on_added(peer):
        hanging.append(asyncio.current_task())
        await asyncio.Event().wait()  # a peer that never answers

    async def scenario():
        pool = PrefillPool("dns:///prefill:50051", refresh_s=3600, on_added=on_added,
                           start_wait_s=0.3)
        started = time.monotonic()
        await pool.start()
        assert 0.25 <= time.monotonic() - started < 2
        await pool.refresh()  # 10.0.0.1 retired, 10.0.0.2 added and asked
        await asyncio.sleep(0)
        assert len(hanging) == 2 and hanging[0].cancelling()
        await pool.close()
        assert all(task.done() for task in hanging)

    asyncio.run(scenario())

