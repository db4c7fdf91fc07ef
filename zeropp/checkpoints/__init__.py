"""Checkpoints: sharded saves and loads at any world size, checksums, async writes, DeepSpeed's.

- ``checkpoint``: atomic sharded saves, loads that reshard to any world size, consolidation
  into one state dict, the client state ([Note: checkpoint layout]).
- ``checkpoint_async``: host staging and the background writer of ``--async-save``.
- ``checkpoint_files``: the errors and the shard file's name both sides share.
- ``checkpoint_integrity``: a checksum for every file, verified before a load, and the fallback
  to the newest checkpoint that verifies.
- ``checkpoint_io``: O_DIRECT chunked writes with the CRC computed on the way.
- ``deepspeed_checkpoint``: reading a checkpoint DeepSpeed's ZeRO-1/2/3 wrote.
- ``convert``: ``python -m zeropp.convert``: DeepSpeed's checkpoints in, fp32 state dicts out.
"""

from zeropp.checkpoints.checkpoint import (
    client_state,
    consolidate,
    load,
    read_latest,
    restore_rng_state,
    save,
)
from zeropp.checkpoints.checkpoint_files import CheckpointError, CheckpointStorageError
from zeropp.checkpoints.checkpoint_integrity import newest_verified
from zeropp.checkpoints.convert import from_deepspeed, to_fp32
from zeropp.checkpoints.deepspeed_checkpoint import (
    DeepSpeedCheckpoint,
    DeepSpeedCheckpointError,
    open_checkpoint,
)

__all__ = [
    "CheckpointError",
    "CheckpointStorageError",
    "DeepSpeedCheckpoint",
    "DeepSpeedCheckpointError",
    "client_state",
    "consolidate",
    "from_deepspeed",
    "load",
    "newest_verified",
    "open_checkpoint",
    "read_latest",
    "restore_rng_state",
    "save",
    "to_fp32",
]
