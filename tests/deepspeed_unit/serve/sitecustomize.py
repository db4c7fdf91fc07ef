"""Run at every interpreter start while this folder is on PYTHONPATH (the plugin puts it there):
in the processes DeepSpeed's test scaffolding starts, undo the harness's device count and,
with ``--serve zeropp``, serve zeropp for DeepSpeed's public API ([Note: serving zeropp to
DeepSpeed's tests] in tests/deepspeed_unit/serving.py)."""

import os
import sys

# LOCAL_SIZE tells DeepSpeed's CPU accelerator, in the pytest process, how many devices it
# has (DistributedTest skips a test needing more ranks than that). A rank that needs it gets
# its own from DistributedTest; one that does not (a serial test) must not see the harness's,
# which would say 4 ranks on a node of a world of 1.
if os.environ.get("ZEROPP_HARNESS_LOCAL_SIZE") == os.environ.get("LOCAL_SIZE"):
    os.environ.pop("LOCAL_SIZE", None)

if os.environ.get("ZEROPP_SERVES_DEEPSPEED") == "1":
    sys.path.append(os.environ["ZEROPP_PROJECT_ROOT"])
    from tests.deepspeed_unit.serving import install

    install()
