"""Python calls the host makes per collective on the CUDA path, counted on a CPU machine.

    python -m scripts.bench.cuda_host_calls [--collectives 200] [--json FILE]

On a GPU each collective the engine issues goes through ``CudaExecution.launch`` and
``Pending.wait`` (``zeropp/comm/streams.py``): a stream switch, events, a join of the side
stream to compute, and torch.cuda's Python around each. The CPU probe
(``scripts.bench.host_ops --python-time``) does not see that path: on the CPU the engine
runs collectives on host threads. This counts it here. torch.cuda's own Python runs as on a
GPU; only its C entry points are replaced by stand-ins of one call each, as the C calls
they replace count one each under cProfile: the stream and event base classes, the current
stream and device getters and setters. The collectives' own work (``issue`` and
``finish``) is a no-op, so what is counted is the execution's and torch.cuda's calls.

Reported per collective, as cProfile counts calls (Python functions and C builtins): a
single gather with a completion step (qwZ's: dequantize on the completion stream), and a
sequence (qgZ's reduction: the last hop finished at ``wait()``), each launched and waited
for. The stand-ins follow torch 2.13's torch.cuda; another torch may need them changed, and
the script says so rather than counting something else.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.cuda
import torch.cuda.streams as cuda_streams


class _StreamBase:
    """What ``torch._C._CudaStreamBase`` holds, in Python."""

    def __new__(cls, priority=0, stream_id=None, device_index=None, device_type=None,
                **kwargs):
        stream = object.__new__(cls)
        stream.stream_id = id(stream) if stream_id is None else stream_id
        stream.device_index = 0 if device_index is None else device_index
        stream.device_type = 1 if device_type is None else device_type
        # (a C getter on the real base: an attribute here, so it counts no call either)
        stream.device = torch.device("cuda", stream.device_index)
        return stream

    def wait_event(self, event) -> None:
        pass


class _EventBase:
    """What ``torch._C._CudaEventBase`` does, as one call each."""

    def __new__(cls, **kwargs):
        return object.__new__(cls)

    def record(self, stream) -> None:
        pass

    def wait(self, stream) -> None:
        pass


@contextlib.contextmanager
def cuda_runtime_stand_ins() -> Iterator[None]:
    """torch.cuda's Python over stand-ins for its C entry points (one device, cuda:0)."""
    if torch.backends.cuda.is_built():
        raise SystemExit("error: this counts over stand-ins for a CPU build of torch; with "
                         "CUDA, the GPU check's section e measures the real path")
    current = {"device": 0, "streams": {}}

    def get_stream(index):
        index = current["device"] if index is None else index
        return current["streams"].setdefault(index, (0, index, 1))

    def set_stream(stream_id=0, device_index=0, device_type=1):
        current["device"] = device_index
        current["streams"][device_index] = (stream_id, device_index, device_type)

    def exchange_device(index):
        previous, current["device"] = current["device"], index
        return previous

    replaced = [(cuda_streams.Stream, "__bases__", (_StreamBase,)),
                (cuda_streams.Event, "__bases__", (_EventBase,)),
                (torch._C, "_cuda_getCurrentStream", get_stream),
                (torch._C, "_cuda_setStream", set_stream),
                (torch._C, "_cuda_getDevice", lambda: current["device"]),
                (torch.cuda, "_exchange_device", exchange_device),
                (torch.cuda, "_maybe_exchange_device", exchange_device),
                (torch.cuda, "_initialized", True),
                (torch.cuda, "is_available", lambda: True),
                (torch.cuda, "device_count", lambda: 1),
                (torch.backends.cuda, "is_built", lambda: True)]
    saved = [(owner, name, getattr(owner, name, None), hasattr(owner, name))
             for owner, name, _ in replaced]
    try:
        for owner, name, value in replaced:
            setattr(owner, name, value)
    except TypeError as error:  # a base class whose layout differs: another torch
        raise SystemExit(f"error: torch {torch.__version__}'s torch.cuda classes cannot take "
                         f"the stand-ins ({error}); this script follows torch 2.13") from error
    try:
        yield
    finally:
        for owner, name, value, existed in reversed(saved):
            if existed:
                setattr(owner, name, value)
            else:
                delattr(owner, name)


def count_calls(collectives: int) -> dict[str, float]:
    """cProfile's calls per collective, launched and waited for, by kind."""
    from zeropp.comm.streams import CudaExecution

    def issue(async_op: bool) -> None:
        return None

    def finish() -> None:
        pass

    kinds = {
        "gather with a completion step": lambda execution: execution.launch(
            "gather", issue, finish=finish).wait(),
        "sequence finished at wait()": lambda execution: execution.launch(
            "reduce", issue, finish=finish, sequence=True).wait(),
    }
    counts = {}
    with cuda_runtime_stand_ins():
        execution = CudaExecution(torch.device("cuda", 0))
        for name, one in kinds.items():
            for _ in range(3):  # the lanes' events and completion stream exist from here
                one(execution)
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(collectives):
                one(execution)
            profile.disable()
            stats = pstats.Stats(profile).stats
            own = sum(calls for (path, _, function), (_, calls, *_) in stats.items()
                      if function in ("issue", "finish") and path == __file__)
            total = sum(calls for _, (_, calls, *_) in stats.items())
            counts[name] = (total - own) / collectives
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.cuda_host_calls",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--collectives", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    if args.collectives < 1:
        parser.error("--collectives must be at least 1")
    counts = count_calls(args.collectives)
    print(f"calls per collective on the CUDA path (torch {torch.__version__}, cProfile's "
          "count, C entry points as one call each):")
    for name, calls in counts.items():
        print(f"  {name:32s} {calls:6.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"torch": torch.__version__, "calls": counts},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
