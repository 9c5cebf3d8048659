"""Hosts for multi-host tests: network namespaces joined by veth pairs through a bridge.

Each host is a namespace with its loopback up and one interface, `eth0`, addressed
10.X.0.(i+1)/24 (X drawn per harness); the bridge lives in a namespace of its own, so no address
or link is added to the machine's own namespace, and every address traffic goes to is one the
harness made. `rate` ("200mbit") limits each host's egress with a token bucket (`tc ... tbf`;
netem is not available everywhere). Everything is removed on exit, also when a test fails.
Needs root and iproute2: `Hosts.unavailable()` says why not, for a skip.
"""

import os
import random
import shutil
import subprocess


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class Hosts:
    def __init__(self, count: int, rate: str = ""):
        self.count, self.rate = count, rate
        tag = f"gm{os.getpid() % 100000}{random.randrange(1000)}"
        self.names = [f"{tag}h{i}" for i in range(count)]
        self.bridge = f"{tag}br"
        self.subnet = random.randrange(100, 250)
        self.addresses = [f"10.{self.subnet}.0.{i + 1}" for i in range(count)]

    @staticmethod
    def unavailable() -> str:
        """Why namespaces cannot be made here ('' when they can)."""
        if shutil.which("ip") is None:
            return "iproute2's ip is not installed"
        if os.geteuid() != 0:
            return "making network namespaces needs root"
        probe = f"gmprobe{os.getpid()}"
        made = _ip("netns", "add", probe, check=False)
        if made.returncode:
            return f"ip netns add failed: {made.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
        return ""

    def __enter__(self) -> "Hosts":
        try:
            self._make()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _make(self) -> None:
        _ip("netns", "add", self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            _ip("netns", "add", name)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.bridge)
            _ip("-n", self.bridge, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", self.bridge, "link", "set", f"p{i}", "up")
            _ip("-n", name, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            if self.rate:
                self.run_in(
                    i,
                    [
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        "eth0",
                        "root",
                        "tbf",
                        "rate",
                        self.rate,
                        "burst",
                        "256kb",
                        "latency",
                        "100ms",
                    ],
                    check=True,
                )

    def __exit__(self, *exc) -> None:
        for name in [*self.names, self.bridge]:  # a namespace takes its veth ends with it
            _ip("netns", "del", name, check=False)

    def command(self, host: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *cmd]

    def run_in(self, host: int, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, cmd), capture_output=True, text=True, **kwargs)

    def start(self, host: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(
            self.command(host, cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
        )
