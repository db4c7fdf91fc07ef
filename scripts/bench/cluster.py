"""Python side of ``scripts/sim_cluster.sh``: bring the simulated cluster up and down, name
its namespaces, addresses and interfaces, read its byte counters.

The shell script owns every change to the network; this module only calls it and reads
state, so the naming rules below must match the script's constants.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

# The repository root: the bench modules run as ``python -m scripts.bench.<name>`` from here.
ROOT = Path(__file__).resolve().parents[2]
SIM_CLUSTER = ROOT / "scripts" / "sim_cluster.sh"
NODE_NAMESPACE = "zpp-node{}"
NODE_INTERFACE = "zpp-veth{}"
NODE_ADDRESS = "10.77.0.{}"  # node i holds 10.77.0.(i+1)
_RATE = re.compile(r"^(unlimited|[0-9]+(bit|kbit|mbit|gbit|tbit))$", re.IGNORECASE)


class ClusterError(RuntimeError):
    """A sim_cluster.sh command failed; the message carries its stderr."""


def check_rate(rate: str) -> str:
    """``rate`` unchanged when sim_cluster.sh accepts it, else a ValueError naming it."""
    if not _RATE.match(rate):
        raise ValueError(
            f"rate {rate!r}: expected a number followed by bit, kbit, mbit, gbit or tbit "
            "(e.g. 100mbit, 1gbit) or 'unlimited'"
        )
    return rate


def unavailable_reason() -> str | None:
    """Why the simulated cluster cannot run here, or None when it can."""
    if os.name != "posix" or not Path("/proc/self/ns/net").exists():
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "the simulated cluster needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"'ip netns' does not work here: {probe.stderr.strip()}"
    return None


class SimCluster:
    """The nodes of ``sim_cluster.sh``: node i is namespace zpp-node{i} at 10.77.0.(i+1)."""

    def __init__(self, script: Path = SIM_CLUSTER) -> None:
        if not script.is_file():
            raise FileNotFoundError(f"{script}: the simulated-cluster script is missing")
        self.script = script

    # ---- changes (through the script) ----------------------------------------------------
    def up(self, nodes: int, rate: str) -> None:
        self._run("up", str(nodes), check_rate(rate))

    def set_rate(self, rate: str) -> None:
        self._run("rate", check_rate(rate))

    def down(self) -> None:
        self._run("down")

    def _run(self, *args: str) -> str:
        result = subprocess.run(["bash", str(self.script), *args], capture_output=True,
                                text=True, timeout=300)
        if result.returncode != 0:
            raise ClusterError(f"sim_cluster.sh {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout

    # ---- names -----------------------------------------------------------------------------
    @staticmethod
    def namespace(node: int) -> str:
        return NODE_NAMESPACE.format(node)

    @staticmethod
    def interface(node: int) -> str:
        return NODE_INTERFACE.format(node)

    @staticmethod
    def node_address(node: int) -> str:
        return NODE_ADDRESS.format(node + 1)

    @classmethod
    def netns_command(cls, node: int, argv: list[str]) -> list[str]:
        """``argv`` run inside node ``node``'s namespace (the environment is inherited)."""
        return ["ip", "netns", "exec", cls.namespace(node), *argv]

    # ---- state -----------------------------------------------------------------------------
    @staticmethod
    def namespaces() -> list[str]:
        """This lab's namespaces that exist now (nodes and switch)."""
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                 check=True).stdout
        names = [line.split()[0] for line in listing.splitlines() if line.strip()]
        return sorted(n for n in names if re.fullmatch(r"zpp-node[0-9]+|zpp-br", n))

    def node_count(self) -> int:
        return sum(1 for n in self.namespaces() if n.startswith("zpp-node"))

    def tx_bytes(self, node: int) -> int:
        """Bytes node ``node`` has sent on its veth since the cluster came up."""
        path = f"/sys/class/net/{self.interface(node)}/statistics/tx_bytes"
        result = subprocess.run(self.netns_command(node, ["cat", path]), capture_output=True,
                                text=True, check=True)
        return int(result.stdout.strip())

    def shaping(self, node: int) -> str:
        """The root qdisc on node ``node``'s veth, as tc prints it ('' when unshaped)."""
        result = subprocess.run(
            ["tc", "-n", self.namespace(node), "qdisc", "show", "dev", self.interface(node),
             "root"], capture_output=True, text=True, check=True,
        )
        line = result.stdout.strip().splitlines()[0] if result.stdout.strip() else ""
        return "" if line.startswith(("qdisc noqueue", "qdisc noop")) else line
