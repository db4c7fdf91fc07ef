"""Run DeepSpeedExamples' CIFAR-10 script (cifar10_deepspeed.py, unmodified on disk) on 2 gloo
ranks, under DeepSpeed or, with its one import line changed, under zeropp.

What this runner adds around the script is observation and launching only:

* it seeds torch before the script runs (the script does not seed), so every run starts from
  the same weights;
* with ``--system zeropp`` it replaces the line ``import deepspeed`` by
  ``import zeropp as deepspeed`` in the source text it executes (the file is not changed);
  the script's other DeepSpeed imports (``deepspeed.accelerator``, ``deepspeed.moe.utils``)
  stay, as a user's would;
* it records every training loss exactly (``torch.nn.CrossEntropyLoss.forward`` wrapped to
  append ``loss.item()``) and the lr in force at each step;
* it keeps a reference to the engine ``initialize`` returns: with ``--save DIR`` it calls
  ``engine.save_checkpoint(DIR)`` after the script finishes (phase A); with ``--load DIR`` it
  calls ``engine.load_checkpoint(DIR)`` right after ``initialize`` returns (phase B), so the
  script's training continues from phase A's weights, optimizer moments and lr schedule.

Each rank writes its record as JSON to the path in the environment variable
``CIFAR_EXAMPLE_RESULT`` (``{rank}`` in it becomes the rank).

``launch()`` starts the ranks (what ``deepspeed``/``torchrun`` would do: RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment and ``--local_rank=N`` on the command
line, as the ``deepspeed`` launcher passes it). By hand, from the repository root:

    .venv/bin/python tests/material/deepspeed_examples/run_example.py --launch \
        --system deepspeed --save /tmp/ckpt_ds
    .venv/bin/python tests/material/deepspeed_examples/run_example.py --launch \
        --system deepspeed --load /tmp/ckpt_ds
"""

from __future__ import annotations

import argparse
import builtins
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "cifar10_deepspeed.py"
STANDIN = HERE / "torchvision_standin"  # holds the stand-in package ``torchvision``
REPO_ROOT = HERE.parents[2]
SEED = 1234
# The script's own flags: fp32 ZeRO-3, one epoch, a progress line per step. ``--deepspeed``
# is what the example's run_ds.sh passes; ``--local_rank=N`` is added per rank by launch().
SCRIPT_ARGS = ["--deepspeed", "--dtype", "fp32", "--stage", "3", "--epochs", "1",
               "--log-interval", "1"]
IMPORT_LINE = re.compile(r"^import deepspeed$", re.MULTILINE)
RESULT_ENV = "CIFAR_EXAMPLE_RESULT"


def script_source(system: str, script: Path = SCRIPT) -> str:
    """The script's text as it is executed: unchanged for DeepSpeed, one line for zeropp."""
    source = script.read_text()
    if system == "zeropp":
        source, count = IMPORT_LINE.subn("import zeropp as deepspeed", source)
        if count != 1:
            raise RuntimeError(f"expected one 'import deepspeed' line in {script}, found {count}")
    elif system != "deepspeed":
        raise ValueError(f"unknown system {system!r}")
    return source


def import_deepspeed():
    """Import DeepSpeed with its shared-memory all-reduce op marked unavailable.

    DeepSpeed's CPU communication backend JIT-compiles that op in ``init_distributed``, for
    inference all-reduces that ZeRO-3 training never issues; marking it incompatible is
    DeepSpeed's own switch (as in scripts/bench/bench_step.py). The script's later
    ``import deepspeed`` finds this module already loaded.
    """
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def run_rank(system: str, save_dir: str | None, load_dir: str | None,
             script_args: list[str]) -> int:
    """One rank: run the script as ``__main__``, write what was observed; returns the exit code."""
    rank = int(os.environ["RANK"])
    record: dict = {"system": system, "rank": rank, "world_size": int(os.environ["WORLD_SIZE"]),
                    "losses": [], "lrs": [], "status": "started"}
    result_path = os.environ[RESULT_ENV].format(rank=rank)
    code = 1
    try:
        import torch

        torch.set_num_threads(1)
        # DeepSpeed's training DataLoader starts 2 worker processes per rank. Forked from this
        # process (gloo and other threads running), a worker once hung for good inside
        # CPython 3.11's PyOS_AfterFork_Child (_PyThreadState_DeleteExcept waiting on a lock
        # another thread held at fork time), and the job with it. Workers forked from a
        # single-threaded fork server see the same data without that race.
        import multiprocessing
        import multiprocessing.forkserver

        multiprocessing.set_start_method("forkserver", force=True)
        multiprocessing.set_forkserver_preload(["numpy", "torch", "torchvision"])
        multiprocessing.forkserver.ensure_running()  # its imports overlap DeepSpeed's here
        import_deepspeed()  # both systems: the script imports deepspeed.accelerator/.moe
        module = __import__(system)  # what ``import deepspeed`` binds in the script
        engines = []
        original_initialize = module.initialize

        def initialize(*args, **kwargs):
            result = original_initialize(*args, **kwargs)
            engine = result[0]
            engines.append(engine)
            if load_dir is not None:  # phase B: continue from phase A's checkpoint
                path, _client_state = engine.load_checkpoint(load_dir)
                record["loaded_path"] = None if path is None else str(path)
                record["lr_after_load"] = list(engine.get_lr())
                record["global_steps_after_load"] = getattr(engine, "global_steps", None)
            return result

        module.initialize = initialize

        original_forward = torch.nn.CrossEntropyLoss.forward

        def forward(self, input, target):
            loss = original_forward(self, input, target)
            record["losses"].append(loss.item())
            record["lrs"].append(engines[-1].get_lr()[0] if engines else None)
            return loss

        torch.nn.CrossEntropyLoss.forward = forward

        torch.manual_seed(SEED)  # the script does not seed: the same initial weights everywhere
        source = script_source(system)
        saved_argv = sys.argv
        sys.argv = [str(SCRIPT)] + script_args
        namespace = {"__name__": "__main__", "__file__": str(SCRIPT), "__builtins__": builtins}
        start = time.perf_counter()
        try:
            exec(compile(source, str(SCRIPT), "exec"), namespace)
        finally:
            sys.argv = saved_argv
        record["script_seconds"] = time.perf_counter() - start
        if not engines:
            raise RuntimeError("the script never called initialize")
        engine = engines[-1]
        record.update(what_ran(engine))
        if save_dir is not None:  # phase A
            engine.save_checkpoint(save_dir)
        torch.distributed.barrier()
        record["status"] = "ok"
        code = 0
    except BaseException:  # the parent reads the traceback from the record and the log
        record["status"] = "error"
        record["error"] = traceback.format_exc()
        traceback.print_exc()
    with open(result_path, "w") as f:
        json.dump(record, f, indent=1)
    return code


def what_ran(engine) -> dict:
    """The engine's final lr, and what actually ran: ZeRO stage, precision, and the optimizer
    under the ZeRO wrapper (DeepSpeed: DeepSpeedZeroOptimizer_Stage3 around FusedAdam)."""
    inner = getattr(engine.optimizer, "optimizer", None)
    return {"final_lr": list(engine.get_lr()), "zero_stage": engine.zero_optimization_stage(),
            "fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(),
            "optimizer": type(engine.optimizer).__name__,
            "inner_optimizer": None if inner is None else type(inner).__name__,
            "global_steps": getattr(engine, "global_steps", None)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, chars: int = 6000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-chars:]


def launch(system: str, *, save: str | None = None, load: str | None = None, world_size: int = 2,
           workdir: str | None = None, timeout: float = 600) -> list[dict]:
    """Start ``world_size`` ranks of the script, wait, and return each rank's record.

    Raises AssertionError (with each rank's error and output tail) when a rank fails.
    """
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"cifar_{system}_"))
    tag = f"{system}_{'B' if load else 'A'}"

    def argv_for(rank: int) -> list[str]:
        argv = [sys.executable, str(Path(__file__).resolve()), "--system", system]
        if save:
            argv += ["--save", str(save)]
        if load:
            argv += ["--load", str(load)]
        return argv + ["--", f"--local_rank={rank}"] + SCRIPT_ARGS

    return start_ranks(tag, argv_for, workdir, result_env=RESULT_ENV, pythonpath=[STANDIN],
                       world_size=world_size, timeout=timeout)


def start_ranks(tag: str, argv_for, workdir: Path, *, result_env: str, pythonpath=(),
                extra_env: dict[str, str] | None = None, world_size: int = 2,
                timeout: float = 600) -> list[dict]:
    """Start ``world_size`` processes ``argv_for(rank)`` as the ranks of one gloo job on CPU
    (what ``deepspeed``/``torchrun`` would set up), wait, and return each rank's record: the
    JSON each rank writes to the path in ``result_env`` (``{rank}`` in it becomes the rank).

    Logs go to ``workdir/{tag}_rank{N}.log``. Raises AssertionError (with each rank's error and
    output tail) when a rank fails. The rendezvous port is picked free just before the start;
    if another program takes it in between (EADDRINUSE in a log), the ranks are started once
    more on a new port.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for attempt in range(2):
        records, problems, logs = _launch_once(tag, argv_for, workdir, result_env, pythonpath,
                                               extra_env or {}, world_size, timeout)
        if not problems:
            return records
        if attempt == 0 and any("EADDRINUSE" in _tail(log, 100_000) for log in logs):
            continue
        raise AssertionError(f"{tag} run ({workdir}) failed:\n" + "\n".join(problems))
    raise AssertionError("unreachable")


def _launch_once(tag, argv_for, workdir: Path, result_env, pythonpath, extra_env, world_size,
                 timeout):
    env = dict(os.environ)
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    pythonpath = [str(p) for p in pythonpath] + [str(REPO_ROOT)] + inherited
    env.update(
        PYTHONPATH=os.pathsep.join(pythonpath),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        OMP_NUM_THREADS="1",
        # CPU and gloo for both systems, also on a machine with a GPU.
        CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", TRITON_INTERPRET="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra_env)
    env[result_env] = str(workdir / f"{tag}_rank{{rank}}.json")
    procs, logs = [], []
    for rank in range(world_size):
        Path(env[result_env].format(rank=rank)).unlink(missing_ok=True)
        log = workdir / f"{tag}_rank{rank}.log"
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        with open(log, "w") as out:
            procs.append(subprocess.Popen(argv_for(rank), cwd=workdir, env=rank_env, stdout=out,
                                          stderr=subprocess.STDOUT))
        logs.append(log)
    deadline = time.monotonic() + timeout
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    records, problems = [], []
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        path = Path(env[result_env].format(rank=rank))
        record = json.loads(path.read_text()) if path.exists() else {"status": "no record"}
        records.append(record)
        if timed_out or proc.returncode != 0 or record.get("status") != "ok":
            error = record.get("error", "")
            problems.append(
                f"--- {tag} rank {rank}: exit {proc.returncode}, status {record.get('status')}"
                f"{f' (timed out after {timeout:.0f} s)' if timed_out else ''}\n{error}"
                f"--- output tail ({log}):\n{_tail(log, 1500 if error else 6000)}")
    return records, problems, logs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, script_args = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", choices=["deepspeed", "zeropp"], required=True)
    parser.add_argument("--save", help="phase A: save a checkpoint here after the script")
    parser.add_argument("--load", help="phase B: load this checkpoint right after initialize")
    parser.add_argument("--launch", action="store_true",
                        help="start 2 ranks and print their records (else: be one rank)")
    args = parser.parse_args(argv)
    if args.save and args.load:
        parser.error("--save and --load are separate phases")
    if args.launch:
        start = time.perf_counter()
        records = launch(args.system, save=args.save, load=args.load)
        for record in records:
            print(json.dumps(record))
        print(f"wall time {time.perf_counter() - start:.1f} s", flush=True)
        return 0
    code = run_rank(args.system, args.save, args.load, script_args)
    # The record is on disk: leave without interpreter/C++ teardown (DataLoader workers, gloo),
    # which can hang or abort after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
