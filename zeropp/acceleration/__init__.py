"""Execution options on request: compiled blocks and the whole iteration as one CUDA graph.

- ``compiled_blocks``: ``torch.compile`` on each unit's computation, the engine's hooks left
  outside (``"compile"`` in the DeepSpeed JSON) ([Note: compiled blocks]).
- ``cuda_graph``: the whole training iteration captured once and replayed
  (``"cuda_graph": {"enabled": true}``, ``--cuda-graph``) ([Note: iteration graphs]).
"""

from zeropp.acceleration.compiled_blocks import (
    CompileRefused,
    check_compile_settings,
    compile_blocks,
)
from zeropp.acceleration.cuda_graph import CudaGraphOptions, IterationGraph, capture_blockers

__all__ = [
    "CompileRefused",
    "CudaGraphOptions",
    "IterationGraph",
    "capture_blockers",
    "check_compile_settings",
    "compile_blocks",
]
