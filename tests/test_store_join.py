"""Joining the job's c10d store when the server's answer to a join never comes.

torch's TCPStore client constructor pings the server and waits for the answer without a time
limit; in the suite a 4-rank job once sat 240 s before its first step with one rank inside that
constructor. `gradmesh.stores.client` gives each attempt a bounded wait and connects again. Here
a relay in front of a real store swallows the first connection (accepts it, never forwards a
byte), as a server that lost a join would.
"""

import socket
import threading
import time
from datetime import timedelta

import pytest

from gradmesh import stores


class Relay:
    """127.0.0.1:port -> the store's port; the first `swallow` connections are accepted and left silent."""

    def __init__(self, target: int, swallow: int):
        self.target, self.swallow, self.held = target, swallow, []
        self.listener = stores.loopback_listener()
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            conn, _ = self.listener.accept()
            if self.swallow > 0:
                self.swallow -= 1
                self.held.append(conn)
                continue
            upstream = socket.create_connection((stores.LOOPBACK, self.target))
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass


def _in_thread(call, limit_s: float):
    """`call()`'s result or exception, or a failure if it has not returned within `limit_s`."""
    found: dict = {}

    def run():
        try:
            found["value"] = call()
        except Exception as error:
            found["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    assert found, f"still waiting after {limit_s} s: the join hangs"
    return found


@pytest.fixture
def server():
    store = stores.loopback_store()
    yield store
    del store


def test_a_join_whose_answer_never_comes_connects_again_and_works(server, monkeypatch, capfd):
    monkeypatch.setattr(stores, "ANSWER_S", 1.0)
    relay = Relay(server.port, swallow=1)
    start = time.monotonic()
    found = _in_thread(lambda: stores.client(stores.LOOPBACK, relay.port, timedelta(seconds=60)), 30)
    assert "value" in found, found
    joined = found["value"]
    joined.set("key", "value")
    assert server.get("key") == b"value"
    assert 1.0 <= time.monotonic() - start < 30
    assert "did not answer in 1 s; joining it again" in capfd.readouterr().err
    assert len(relay.held) == 1


def test_a_store_that_never_answers_fails_the_join_at_its_time(server, monkeypatch):
    monkeypatch.setattr(stores, "ANSWER_S", 1.0)
    monkeypatch.setattr(stores, "JOIN_S", 2.0)  # the store's 3 s timeout is the longer: the join's
    relay = Relay(server.port, swallow=1_000)
    start = time.monotonic()
    found = _in_thread(lambda: stores.client(stores.LOOPBACK, relay.port, timedelta(seconds=3)), 30)
    assert isinstance(found.get("error"), TimeoutError), found
    assert f"127.0.0.1:{relay.port} did not answer within 3 s" in str(found["error"])
    assert 3.0 <= time.monotonic() - start < 10


def test_a_short_store_timeout_still_gives_a_slow_join_its_time(server, monkeypatch):
    """The watchdog's clients time their operations out at 5 s; a join slower than that (a host
    name lookup that waits for an absent name service) must not fail the worker."""
    monkeypatch.setattr(stores, "ANSWER_S", 1.0)
    monkeypatch.setattr(stores, "JOIN_S", 20.0)
    relay = Relay(server.port, swallow=2)
    found = _in_thread(lambda: stores.client(stores.LOOPBACK, relay.port, timedelta(seconds=1)), 30)
    assert "value" in found, found
    assert len(relay.held) == 2
