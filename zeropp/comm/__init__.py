"""Collectives (exact and quantized, with one contract) and their byte accounting."""

from zeropp.comm.accounting import PHASES, CommStats
from zeropp.comm.collectives import (
    CommGroup,
    Pending,
    all_gather,
    all_reduce_sum,
    all_to_all,
    reduce_scatter_sum,
)

__all__ = [
    "PHASES",
    "CommGroup",
    "CommStats",
    "Pending",
    "all_gather",
    "all_reduce_sum",
    "all_to_all",
    "reduce_scatter_sum",
]
