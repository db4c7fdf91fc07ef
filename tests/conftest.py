"""Test-wide settings."""

import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter. Triton reads the switch when
# it is first imported, and other test modules (transformers, deepspeed) may import it
# first, so it is set before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
