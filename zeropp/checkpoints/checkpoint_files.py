"""What both sides of a checkpoint share: its errors and the name of a rank's shard file.

``checkpoint`` (saves and loads) and ``checkpoint_integrity`` (checksums and the fallback
choice) both import from here; ``zeropp.checkpoints`` and ``zeropp`` re-export the names.
"""

from __future__ import annotations

from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read (one-line message)."""


class CheckpointStorageError(CheckpointError):
    """A save failed because storage did (disk full, permissions, a read-only file system):
    the run itself is sound, so ``--save-error continue`` may train on."""


def shard_file(tag_dir: Path, rank: int) -> Path:
    return tag_dir / f"zero_rank{rank:05d}.pt"
