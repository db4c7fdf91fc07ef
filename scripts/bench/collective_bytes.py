"""Count the bytes a rank hands to torch.distributed collectives, whichever library calls them.

FSDP2 and DeepSpeed keep no byte counters of their own that say which group a collective ran
in, so the lab counts at the one layer all systems share: the process group's methods, where
torch.distributed's functions end and where this engine calls directly ([Note: issued to the
process group] in zeropp/comm/collectives.py). ``CollectiveByteCounter.install()`` wraps them
on ``ProcessGroup`` itself, so a call is counted however the caller reached the method (a
backend that overrides them in Python, as the simulated one does, is not counted).

The byte rules are the engine's own (``zeropp/comm/accounting.py``), so both counts follow one
convention: the bytes leaving this rank for other ranks, each peer's piece counted as sent
directly; a collective is ``inter_node`` when its group holds ranks of more than one node.
For a group of G ranks and an input of B bytes: all-gather B*(G-1), reduce-scatter and
all-to-all B*(G-1)/G, all-reduce 2*B*(G-1)/G. ``install()`` imports those rules only then, so
importing this module imports nothing of the engine.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

LOCALITIES = ("intra_node", "inter_node")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# A collective by the name of torch.distributed's function -> its bytes rule in
# zeropp.comm.accounting, and the ``ProcessGroup`` methods that run it (torch 2.13's names and
# the older ones; each is a binding of its own, so a call is counted once). Every method takes
# (output, input, ...) except ``allreduce``, which takes the list of tensors it reduces.
_COUNTED = {
    "all_gather_single": ("all_gather_bytes", ("all_gather_single", "_allgather_base")),
    "reduce_scatter_single": ("reduce_scatter_bytes",
                              ("reduce_scatter_single", "_reduce_scatter_base")),
    "all_reduce": ("all_reduce_bytes", ("allreduce",)),
    "all_to_all_single": ("all_to_all_bytes", ("all_to_all_single", "alltoall_base")),
}


def _input_bytes(name: str, args: tuple) -> int | None:
    """Bytes of the input of a ``ProcessGroup`` method's call (its arguments after the group)."""
    if name == "all_reduce":
        tensors = args[0] if args else None
        if isinstance(tensors, torch.Tensor):
            return _nbytes(tensors)
        if isinstance(tensors, (list, tuple)):
            return sum(_nbytes(t) for t in tensors if isinstance(t, torch.Tensor))
        return None
    tensor = args[1] if len(args) > 1 else None
    return _nbytes(tensor) if isinstance(tensor, torch.Tensor) else None


class CollectiveByteCounter:
    """Bytes by collective and locality since the last ``reset``, for this rank."""

    def __init__(self, ranks_per_node: int) -> None:
        if ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
        self.ranks_per_node = ranks_per_node
        self._bytes: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(LOCALITIES, 0))
        self._group_facts: dict[int, tuple[int, bool]] = {}
        self._originals: dict[str, Callable] = {}
        self.rules: dict[str, Callable[[int, int], int]] = {}

    # ---- installation ---------------------------------------------------------------------
    def install(self) -> CollectiveByteCounter:
        for name, (_, methods) in _COUNTED.items():
            for method in methods:
                original = dist.ProcessGroup.__dict__.get(method)
                if original is None or method in self._originals:
                    continue  # not in this torch, or wrapped already
                self._originals[method] = original
                setattr(dist.ProcessGroup, method, self._wrap(name, original))
        # Only now: importing the rules imports the engine.
        from zeropp.comm import accounting

        self.rules = {name: getattr(accounting, rule) for name, (rule, _) in _COUNTED.items()}
        return self

    def uninstall(self) -> None:
        for method, original in self._originals.items():
            setattr(dist.ProcessGroup, method, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def counted(group, *args, **kwargs):
            input_bytes = _input_bytes(name, args)
            if input_bytes is not None:
                self.record(name, group, input_bytes)
            return original(group, *args, **kwargs)

        return counted

    # ---- accounting -----------------------------------------------------------------------
    def group_facts(self, group) -> tuple[int, bool]:
        """(size, spans_nodes) of ``group`` (None: the default group)."""
        group = group if group is not None else distributed_c10d._get_default_group()
        key = id(group)
        if key not in self._group_facts:
            ranks = dist.get_process_group_ranks(group)
            nodes = {rank // self.ranks_per_node for rank in ranks}
            self._group_facts[key] = (len(ranks), len(nodes) > 1)
        return self._group_facts[key]

    def record(self, name: str, group, input_bytes: int) -> None:
        """Count one call of collective ``name`` with ``input_bytes`` in ``group``."""
        size, spans_nodes = self.group_facts(group)
        if size > 1:
            self._bytes[name]["inter_node" if spans_nodes else "intra_node"] += self.rules[name](
                input_bytes, size)

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {name: dict(counts) for name, counts in self._bytes.items()}

    def total(self, locality: str) -> int:
        return sum(counts[locality] for counts in self._bytes.values())

    def reset(self) -> None:
        self._bytes.clear()
