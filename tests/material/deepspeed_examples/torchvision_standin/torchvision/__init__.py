"""A stand-in for the few pieces of torchvision that DeepSpeedExamples' CIFAR-10 script uses.

For the data only: ``datasets.CIFAR10`` returns deterministic synthetic images instead of the
real (downloaded) CIFAR-10, and ``transforms`` holds ``Compose``, ``ToTensor`` and
``Normalize``. The real torchvision is not installed here (pip would pull a CUDA build of
torch) and the download is not allowed. This folder's parent goes on PYTHONPATH only for the
runs of tests/test_deepspeed_example.py; the script's model, engine and loop are untouched.
"""

from torchvision import datasets, transforms

__version__ = "0.0-standin"
__all__ = ["datasets", "transforms"]
