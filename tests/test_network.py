"""What a job reads from and shows to the network (issue 13, item 4), at the unit level; the
listening sockets of real jobs are checked in test_signals.py, test_dashboard.py and
test_run_and_api.py."""

import socket

import pytest
import torch.distributed as dist

from gradmesh.fault.inplace import BadStoreValue, members_of, publish_members, whole
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


MACHINE = socket.gethostname()
LOOPBACK_OK = ["127.0.0.1:8265", "localhost:9000", "[::1]:8265", "[0:0::1]", "127.0.0.2", "LocalHost.", None]
FOREIGN = ["attacker.example:8265", "127.0.0.1.nip.io", "localhost.attacker.example"]
MALFORMED = ["[", "[::1", "[zz]:80", "a:b:c", "localhost:99999", "127.0.0.1, evil.example", "h\u00e9te", ""]


@pytest.mark.parametrize("bound, accepted, refused", [
    # Loopback: localhost and loopback addresses only (any port: ssh -L forwarding changes it).
    ("127.0.0.1", LOOPBACK_OK, FOREIGN + ["10.1.2.3"] + [MACHINE] * (MACHINE.lower() != "localhost")),
    ("::1", LOOPBACK_OK, FOREIGN + ["10.1.2.3"]),
    # Chosen by the user for the network: also any address (NAT changes it) and this machine's name.
    ("0.0.0.0", LOOPBACK_OK + ["10.1.2.3:8265", "[2001:db8::1]", MACHINE], FOREIGN),
    ("10.0.0.5", LOOPBACK_OK + ["10.0.0.5:8265", "34.1.2.3"], FOREIGN),
    ("dash.example.org", LOOPBACK_OK + ["Dash.Example.Org:8265", "10.1.2.3"], FOREIGN),
])
def test_listeners_answer_only_their_own_host_names(bound, accepted, refused):
    from gradmesh.monitor.listener import HostCheck

    check = HostCheck(bound)
    assert [host for host in accepted if check.refusal(host)] == []
    assert [check.refusal(host)[0] for host in refused] == [403] * len(refused)
    assert [check.refusal(host)[0] for host in MALFORMED] == [400] * len(MALFORMED)
