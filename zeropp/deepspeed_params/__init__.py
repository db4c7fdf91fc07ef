"""Parameters as DeepSpeed shows them: ds_* attributes on ours, DeepSpeed's partitions adopted.

- ``param_face``: the ``ds_*`` attributes a stage-3 parameter carries for scripts written for
  DeepSpeed, mirrored from its unit's state ([Note: DeepSpeed's parameter attributes]).
- ``deepspeed_adoption``: a model DeepSpeed's ``zero.Init`` already partitioned, gathered into
  this engine's units one unit at a time ([Note: adopting DeepSpeed's partitions]).

Both sit below the engine's units, which import them (``zeropp.deepspeed_api`` sits above the
engine), so they are a package of their own.
"""

from zeropp.deepspeed_params.deepspeed_adoption import (
    DeepSpeedValues,
    is_deepspeed_partitioned,
    stand_in_for_deepspeed,
)
from zeropp.deepspeed_params.param_face import (
    ZeroParamStatus,
    mirror_status,
    present_as_partitioned,
)

__all__ = [
    "DeepSpeedValues",
    "ZeroParamStatus",
    "is_deepspeed_partitioned",
    "mirror_status",
    "present_as_partitioned",
    "stand_in_for_deepspeed",
]
