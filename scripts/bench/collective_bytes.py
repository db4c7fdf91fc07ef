"""Count the bytes a rank hands to torch.distributed collectives, whichever library calls them.

FSDP2 and DeepSpeed keep no byte counters of their own that say which group a collective ran
in, so the lab counts at the one layer all systems share: the torch.distributed functions.
``CollectiveByteCounter.install()`` wraps them; it must run before any library captures a
reference to one of them (this engine and DeepSpeed both keep references made at import or
start-up), i.e. before those libraries are imported.

The byte rules are the engine's own (``zeropp/comm/accounting.py``), so both counts follow one
convention: the bytes leaving this rank for other ranks, each peer's piece counted as sent
directly; a collective is ``inter_node`` when its group holds ranks of more than one node.
For a group of G ranks and an input of B bytes: all-gather B*(G-1), reduce-scatter and
all-to-all B*(G-1)/G, all-reduce 2*B*(G-1)/G. ``install()`` imports those rules only after
its wrappers are in place, because importing them imports the engine, which keeps the
torch.distributed functions it finds at that moment; this module imports nothing of the
engine before then.
"""

from __future__ import annotations

import functools
import inspect
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

LOCALITIES = ("intra_node", "inter_node")


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# name -> (parameter holding the input tensor, its bytes rule in zeropp.comm.accounting). The
# deprecated names (all_gather_into_tensor, reduce_scatter_tensor, _all_gather_base) call
# these through the module's globals, so wrapping these counts them too, and exactly once.
_COUNTED = {
    "all_gather_single": ("input_tensor", "all_gather_bytes"),
    "reduce_scatter_single": ("input", "reduce_scatter_bytes"),
    "all_reduce": ("tensor", "all_reduce_bytes"),
    "all_to_all_single": ("input", "all_to_all_bytes"),
}


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
        for name in _COUNTED:
            if name in self._originals:
                continue
            original = getattr(distributed_c10d, name, None)
            if original is None:  # an older torch without the renamed function
                continue
            self._originals[name] = original
            wrapped = self._wrap(name, original)
            setattr(distributed_c10d, name, wrapped)
            setattr(dist, name, wrapped)
        # Only now: this import imports the engine, which then keeps the wrappers.
        from zeropp.comm import accounting

        self.rules = {name: getattr(accounting, rule) for name, (_, rule) in _COUNTED.items()}
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(distributed_c10d, name, original)
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Callable) -> Callable:
        input_parameter = _COUNTED[name][0]
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args, **kwargs):
            arguments = signature.bind_partial(*args, **kwargs).arguments
            tensor = arguments.get(input_parameter)
            if isinstance(tensor, torch.Tensor):
                self.record(name, arguments.get("group"), _nbytes(tensor))
            return original(*args, **kwargs)

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
