"""Collectives (exact and quantized, with one contract) and their byte accounting."""

from zeropp.comm.accounting import PHASES, CommStats
from zeropp.comm.collectives import (
    AllGather,
    Collective,
    CommGroup,
    Pending,
    ReduceScatter,
    all_gather,
    all_reduce_sum,
    all_to_all,
    reduce_scatter_sum,
)

__all__ = [
    "PHASES",
    "AllGather",
    "Collective",
    "ReduceScatter",
    "CommGroup",
    "CommStats",
    "Pending",
    "all_gather",
    "all_reduce_sum",
    "all_to_all",
    "reduce_scatter_sum",
]
