"""Start the ranks of a job on the simulated cluster: each node's ranks inside its namespace.

    sudo .venv/bin/python -m scripts.bench.launch_ranks --nodes 2 --ranks-per-node 2 -- \\
        .venv/bin/python -m scripts.bench.bench_step --system zeropp --iters 3

Rank r runs on node ``r // ranks_per_node`` (node-major, as every launcher lays ranks out),
as ``ip netns exec zpp-node{node} CMD`` with the torchrun environment: MASTER_ADDR (node 0's
address), MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, plus
GLOO_SOCKET_IFNAME (the node's veth, so gloo binds the node's address) and OMP_NUM_THREADS=1
(the ranks already share the machine's cores). Ranks of one node reach each other at that
address over the namespace's loopback, unshaped; ranks of different nodes cross the shaped
veths. ``--local`` starts the same ranks without namespaces, on 127.0.0.1 (no root needed).

If a rank fails, the others are ended (TERM, then KILL) and the launcher reports which rank
failed and the end of its stderr. Each rank's stdout and stderr are collected in files, not
pipes, so a chatty rank can never block on a full pipe.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from scripts.bench.cluster import SimCluster

LOCALHOST = "127.0.0.1"
# Inside a node namespace nothing else listens, so a fixed port is always free there.
CLUSTER_MASTER_PORT = 29500
TERMINATE_GRACE_S = 5.0
POLL_INTERVAL_S = 0.1
STDERR_TAIL_CHARS = 3000


@dataclass
class RankOutput:
    rank: int
    node: int
    returncode: int  # negative: ended by that signal (the launcher TERMs, then KILLs)
    stdout: str
    stderr: str


class LaunchError(RuntimeError):
    """A rank failed or the job ran out of time; ``outputs`` holds what every rank wrote."""

    def __init__(self, message: str, outputs: list[RankOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    node: int
    local_rank: int


def place_ranks(nodes: int, ranks_per_node: int) -> list[RankPlacement]:
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"nodes ({nodes}) and ranks per node ({ranks_per_node}) must be >= 1")
    return [
        RankPlacement(rank, rank // ranks_per_node, rank % ranks_per_node)
        for rank in range(nodes * ranks_per_node)
    ]


def rank_environment(
    placement: RankPlacement, nodes: int, ranks_per_node: int, master_port: int,
    cluster: SimCluster | None, base_env: dict[str, str],
) -> dict[str, str]:
    """The torchrun variables of one rank, on the simulated cluster or on localhost."""
    env = dict(base_env)
    env.update(
        MASTER_ADDR=cluster.node_address(0) if cluster else LOCALHOST,
        MASTER_PORT=str(master_port),
        RANK=str(placement.rank),
        WORLD_SIZE=str(nodes * ranks_per_node),
        LOCAL_RANK=str(placement.local_rank),
        LOCAL_WORLD_SIZE=str(ranks_per_node),
        GROUP_RANK=str(placement.node),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    if cluster:
        env["GLOO_SOCKET_IFNAME"] = cluster.interface(placement.node)
    else:
        env.pop("GLOO_SOCKET_IFNAME", None)
    return env


def _end(processes: list[subprocess.Popen]) -> None:
    """TERM every live process, then KILL those still alive after the grace period."""
    live = [p for p in processes if p.poll() is None]
    for process in live:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for process in live:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def free_local_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOCALHOST, 0))
        return probe.getsockname()[1]


def launch(
    command: list[str],
    *,
    nodes: int,
    ranks_per_node: int,
    cluster: SimCluster | None,
    master_port: int | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout_s: float = 1800.0,
) -> list[RankOutput]:
    """Run ``command`` as every rank; returns the outputs in rank order when all succeed.

    ``cluster=None`` runs the ranks on localhost without namespaces. ``master_port=None``
    picks a free port on localhost, or CLUSTER_MASTER_PORT on the cluster. ``cwd`` is every
    rank's working directory (default: this process's), where a ``python -m`` command finds
    its modules. Raises ``LaunchError`` when a rank exits non-zero or the job exceeds
    ``timeout_s``; every other rank is ended first, so no rank is left waiting in a collective.
    """
    if not command:
        raise ValueError("no command to launch")
    placements = place_ranks(nodes, ranks_per_node)
    if master_port is None:
        master_port = CLUSTER_MASTER_PORT if cluster else free_local_port()
    base_env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="zpp-launch-") as log_dir, ExitStack() as files:
        processes: list[subprocess.Popen] = []
        logs: list[tuple[IO[str], IO[str]]] = []
        try:
            for placement in placements:
                prefix = Path(log_dir) / f"rank{placement.rank}"
                out = files.enter_context(open(prefix.with_suffix(".out"), "w+"))
                err = files.enter_context(open(prefix.with_suffix(".err"), "w+"))
                logs.append((out, err))
                argv = cluster.netns_command(placement.node, command) if cluster else command
                processes.append(subprocess.Popen(
                    argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd,
                    env=rank_environment(placement, nodes, ranks_per_node, master_port,
                                         cluster, base_env),
                ))
            failure = _wait_all(processes, timeout_s)
        finally:
            _end(processes)
        outputs = [_collect(p, process, log)
                   for p, process, log in zip(placements, processes, logs, strict=True)]
    if failure:
        raise LaunchError(failure, outputs)
    return outputs


def _wait_all(processes: list[subprocess.Popen], timeout_s: float) -> str | None:
    """None when every process exits 0; else why the job failed (first failure wins)."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in processes]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                return f"rank {rank} exited with status {code}"
        if all(code == 0 for code in codes):
            return None
        if time.monotonic() > deadline:
            running = [rank for rank, code in enumerate(codes) if code is None]
            return f"ranks {running} still running after {timeout_s:.0f} s"
        time.sleep(POLL_INTERVAL_S)


def _collect(placement: RankPlacement, process: subprocess.Popen,
             log: tuple[IO[str], IO[str]]) -> RankOutput:
    texts = []
    for handle in log:
        handle.seek(0)
        texts.append(handle.read())
    return RankOutput(placement.rank, placement.node, process.returncode, *texts)


def describe_failure(error: LaunchError) -> str:
    """The failure line plus the stderr tail of the rank that failed first."""
    lines = [str(error)]
    failed = [o for o in error.outputs if o.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL)]
    for output in failed[:1] or error.outputs[:1]:
        lines.append(f"--- rank {output.rank} stderr (end) ---")
        lines.append(output.stderr[-STDERR_TAIL_CHARS:].rstrip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.launch_ranks",
                                     description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [options] -- CMD [ARG...]")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--master-port", type=int, default=None,
                        help="default: a free port on localhost, 29500 on the cluster")
    parser.add_argument("--local", action="store_true",
                        help="run every rank on localhost, without namespaces")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the job")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    cluster = None if args.local else SimCluster()
    if cluster is not None and cluster.node_count() < args.nodes:
        parser.error(f"--nodes {args.nodes}: the simulated cluster has "
                     f"{cluster.node_count()} node(s); run sim_cluster.sh up {args.nodes} RATE")
    try:
        outputs = launch(command, nodes=args.nodes, ranks_per_node=args.ranks_per_node,
                         master_port=args.master_port, cluster=cluster, timeout_s=args.timeout)
    except LaunchError as error:
        print(f"error: {describe_failure(error)}", file=sys.stderr)
        return 1
    for output in outputs:
        for line in output.stdout.splitlines():
            print(f"[rank {output.rank}] {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
