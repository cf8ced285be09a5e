"""A Ray cluster of two nodes on this machine (ray.cluster_utils.Cluster) for as long as stdin stays open:
prints {"address", "nodes"} as one JSON line, waits for stdin to close, then shuts the cluster down.

Run as a process of its own (tests/test_multinode.py), so the test session's Ray driver, connected to the
session cluster, is untouched. One CPU per node: two workers of one CPU each can only run one per node."""

import json
import sys

from ray.cluster_utils import Cluster

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
cluster.add_node(num_cpus=1)
cluster.wait_for_nodes()
print(json.dumps({"address": cluster.address, "nodes": sorted(n.node_id for n in cluster.list_all_nodes())}),
      flush=True)
sys.stdin.read()
cluster.shutdown()
