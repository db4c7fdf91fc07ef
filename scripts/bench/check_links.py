"""Measure the simulated cluster's links: TCP throughput between nodes and inside one node.

    sudo scripts/sim_cluster.sh up 2 100mbit
    sudo .venv/bin/python -m scripts.bench.check_links --mib 32 --out links.json

Two transfers, each a single TCP stream of ``--mib`` MiB:

- inter-node: a sender in node 0 to a receiver in node 1 (crosses both shaped veth ends);
- intra-node: a sender in node 0 to a receiver in node 0 at node 0's own veth address, the
  address gloo uses when ``GLOO_SOCKET_IFNAME`` names the veth.

For each it reports the goodput and how many bytes left node 0's veth meanwhile. Linux routes
a packet for one of the namespace's own addresses through its ``local`` table, i.e. over
loopback, whatever interface holds the address: so the intra-node transfer is expected to be
unshaped and to leave the veth counter at (almost) zero.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from scripts.bench.cluster import ROOT, SimCluster

CHUNK_BYTES = 1 << 20
PORT = 29411


def receive(port: int, address: str) -> None:
    """Accept one connection, read until EOF, print the byte count."""
    with socket.create_server((address, port)) as server:
        print("ready", flush=True)
        connection, _ = server.accept()
        received = 0
        with connection:
            while chunk := connection.recv(CHUNK_BYTES):
                received += len(chunk)
    print(received, flush=True)


def send(address: str, port: int, mib: int) -> None:
    """Send ``mib`` MiB, print the seconds from connect to the receiver's EOF."""
    payload = bytes(CHUNK_BYTES)
    with socket.create_connection((address, port), timeout=120) as connection:
        started = time.perf_counter()
        for _ in range(mib):
            connection.sendall(payload)
        connection.shutdown(socket.SHUT_WR)
        connection.recv(1)  # returns at the receiver's close: every byte has arrived
        print(time.perf_counter() - started, flush=True)


def _in_node(cluster: SimCluster, node: int, *args: str) -> list[str]:
    """This module run with ``args`` inside node ``node`` (from ROOT, where it is found)."""
    return cluster.netns_command(node, [sys.executable, "-m", "scripts.bench.check_links",
                                        *args])


def measure(cluster: SimCluster, receiver_node: int, mib: int) -> dict[str, float]:
    """One transfer from node 0 to ``receiver_node``: goodput and node 0's veth tx bytes."""
    address = cluster.node_address(receiver_node)
    receiver = subprocess.Popen(
        _in_node(cluster, receiver_node, "receive", "--address", address, "--port", str(PORT)),
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        if receiver.stdout is None or receiver.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the receiver in node {receiver_node} did not start")
        tx_before = cluster.tx_bytes(0)
        seconds = float(subprocess.run(
            _in_node(cluster, 0, "send", "--address", address, "--port", str(PORT),
                     "--mib", str(mib)),
            check=True, capture_output=True, text=True, timeout=600, cwd=ROOT,
        ).stdout.strip())
        tx_delta = cluster.tx_bytes(0) - tx_before
        received = int(receiver.communicate(timeout=60)[0].strip())
    finally:
        if receiver.poll() is None:
            receiver.kill()
    if received != mib * CHUNK_BYTES:
        raise RuntimeError(f"received {received} bytes of {mib * CHUNK_BYTES}")
    return {
        "mib": mib,
        "seconds": seconds,
        "goodput_mbit_per_s": mib * CHUNK_BYTES * 8 / seconds / 1e6,
        "node0_veth_tx_bytes": tx_delta,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.check_links",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    rx = sub.add_parser("receive")
    rx.add_argument("--address", required=True)
    rx.add_argument("--port", type=int, required=True)
    tx = sub.add_parser("send")
    tx.add_argument("--address", required=True)
    tx.add_argument("--port", type=int, required=True)
    tx.add_argument("--mib", type=int, required=True)
    parser.add_argument("--mib", type=int, default=32, help="MiB per transfer")
    parser.add_argument("--out", type=Path, help="write the results here as JSON")
    args = parser.parse_args(argv)
    if args.command == "receive":
        receive(args.port, args.address)
        return 0
    if args.command == "send":
        send(args.address, args.port, args.mib)
        return 0
    cluster = SimCluster()
    nodes = cluster.node_count()
    if nodes < 2:
        raise SystemExit("error: needs a cluster of 2 or more nodes: sim_cluster.sh up 2 RATE")
    results = {
        "shaping": cluster.shaping(0),
        "inter_node": measure(cluster, 1, args.mib),
        "intra_node": measure(cluster, 0, args.mib),
    }
    for name in ("inter_node", "intra_node"):
        r = results[name]
        print(f"{name:<10} {r['goodput_mbit_per_s']:10.1f} Mbit/s   node 0 veth tx "
              f"{r['node0_veth_tx_bytes'] / 2**20:8.2f} MiB for {r['mib']} MiB sent")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
