"""``python -m zeropp.convert``: the checkpoint converter under its documented command.

The converter lives in ``zeropp/checkpoints/convert.py``; this file keeps the command (and
``from zeropp.convert import from_deepspeed, to_fp32``) where users know it.
"""

import sys

from zeropp.checkpoints.convert import from_deepspeed, main, to_fp32

__all__ = ["from_deepspeed", "main", "to_fp32"]

if __name__ == "__main__":
    sys.exit(main())
