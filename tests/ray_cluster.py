"""A local Ray cluster for the tests, in a process of its own, so that Ray's client threads never
enter the test process (which forks workers for other tests): `python ray_cluster.py NODES` starts
a head and NODES-1 more nodes (`ray.cluster_utils.Cluster`, one CPU each, all on 127.0.0.1),
prints the address, and shuts the cluster down when its standard input closes. Should it die
first, Ray's reaper stops the nodes."""

import os
import sys

# No usage statistics, and every node's address 127.0.0.1 (Ray reads both at its import; the nodes inherit them).
os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")

from ray.cluster_utils import Cluster  # noqa: E402

LOCAL = {"num_cpus": 1, "node_ip_address": "127.0.0.1"}

if __name__ == "__main__":
    cluster = Cluster(initialize_head=True, head_node_args={**LOCAL, "include_dashboard": False})
    try:
        for _ in range(int(sys.argv[1]) - 1):
            cluster.add_node(**LOCAL)
        cluster.wait_for_nodes()
        print(cluster.address, flush=True)
        sys.stdin.read()
    finally:
        cluster.shutdown()
