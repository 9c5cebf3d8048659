"""What a job reads from and shows to the network (issue 13, item 4), at the unit level; the
listening sockets of real jobs are checked in test_signals.py, test_dashboard.py and
test_run_and_api.py."""

import pytest
import torch.distributed as dist

from gradmesh.fault.inplace import BadStoreValue, members_of, publish_members, whole
from gradmesh.monitor.dashboard import host_accepted
from gradmesh.stores import LoopbackTCPStore, loopback_store
from helpers import listening_sockets


def test_store_servers_listen_on_loopback_and_clients_still_connect():
    server = loopback_store()
    torch_own = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    listening = listening_sockets()
    assert [a for a, port in listening if port == server.port] == ["127.0.0.1"]
    assert [a for a, port in listening if port == torch_own.port] == ["::"]  # why gradmesh hands it a socket
    client = LoopbackTCPStore("127.0.0.1", server.port, is_master=False)
    client.set("k", "v")
    assert server.get("k") == b"v"


@pytest.mark.parametrize("value", [b"-1", b"1e3", b"\xd9\xa3", b"2147483648", b"", b"0x10", b"3 "])
def test_values_from_the_inplace_store_are_whole_numbers_in_range(value):
    with pytest.raises(BadStoreValue):
        whole(value, "a test value")


def test_members_read_from_the_store_are_checked_before_use():
    store = dist.HashStore()
    generation = publish_members(store, [0, 2, 3])
    assert members_of(store, generation) == [0, 2, 3]
    for bad in ("0,1,1", "0,-1", "0,rank", "0,99999999999"):
        store.set(f"gradmesh/inplace/members/{generation}", bad)
        with pytest.raises(BadStoreValue):
            members_of(store, generation)


@pytest.mark.parametrize("host, accepted", [
    ("127.0.0.1:8265", True), ("localhost:8265", True), ("[::1]:8265", True), ("10.1.2.3", True),
    (None, True), ("attacker.example:8265", False), ("127.0.0.1.nip.io", False),
])
def test_the_dashboard_accepts_only_this_machines_names(host, accepted):
    assert host_accepted(host) is accepted
