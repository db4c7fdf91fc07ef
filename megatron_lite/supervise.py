"""Relaunch a training job when it fails, from its latest verified checkpoint.

    python -m megatron_lite.supervise --restarts 3 [--backoff 30] -- \\
        torchrun --nproc_per_node 8 pretrain_zeropp_gpt.py ... --save ckpt --load ckpt

Runs the launch command (torchrun, the deepspeed launcher, a script of scripts/launch/, or
the program itself); when it ends with a non-zero status, runs it again, up to ``--restarts``
times, ``--backoff`` seconds apart. Each relaunch resumes from the newest checkpoint whose
files all verify ([Note: checkpoint checksums]), which ``--load`` picks by itself; the command
must therefore carry ``--save DIR --load DIR`` with the same DIR (refused otherwise). One log
line per restart gives the exit status and the iteration it resumes from.

It does not restart what a restart cannot fix: the program's usage errors (a bad flag, a bad
config: exit status 2, or the program's own note in the file named by
``ZEROPP_SUPERVISE_STATUS``, which launchers that fold their workers' statuses into 1 pass
on through the environment). Ctrl-C (or SIGTERM) stops the job and the supervisor. torch's
elastic restarts (``torchrun --max-restarts``) are not used: on gloo the restarted workers
fail to reconnect.

A hang is restarted like any failure: the program's watchdog ([Note: hang watchdog] in
megatron_lite/watchdog.py) ends every rank it can with status 75 and notes the verdict in the
same file, which the restart's log line quotes (which rank hung, where, at which iteration).
Each run sees its attempt number in ``ZEROPP_SUPERVISE_ATTEMPT`` (0 for the first), so a
fault injected for a test fires once, not again on the relaunch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STATUS_ENV = "ZEROPP_SUPERVISE_STATUS"
ATTEMPT_ENV = "ZEROPP_SUPERVISE_ATTEMPT"
USAGE_STATUS = 2
USAGE_NOTE = "usage"
HANG_NOTE = "hang: "


def note_usage_error() -> None:
    """Called by the program on a usage error: tells a supervisor not to restart it."""
    path = os.environ.get(STATUS_ENV)
    if path:
        try:
            Path(path).write_text(USAGE_NOTE)
        except OSError:
            pass  # the exit status still says it


def note_hang(verdict: str) -> None:
    """Called by the watchdog of every rank that ends on a hang: the restart's log line
    quotes the verdict (the same on every rank, whichever writes last)."""
    path = os.environ.get(STATUS_ENV)
    if path:
        with contextlib.suppress(OSError):
            Path(path).write_text(HANG_NOTE + verdict)


def flag_values(command: list[str], flag: str) -> list[str]:
    """Every value given to ``flag`` in ``command`` (as ``--flag V`` or ``--flag=V``)."""
    values = []
    for index, word in enumerate(command):
        if word == flag and index + 1 < len(command):
            values.append(command[index + 1])
        elif word.startswith(flag + "="):
            values.append(word.split("=", 1)[1])
    return values


def checkpoint_dir(command: list[str]) -> Path:
    saves, loads = flag_values(command, "--save"), flag_values(command, "--load")
    if not saves or not loads or Path(saves[-1]).resolve() != Path(loads[-1]).resolve():
        raise ValueError("the command must carry --save DIR --load DIR with the same DIR, so "
                         "that a relaunch resumes where the job stopped (got --save "
                         f"{saves[-1] if saves else '(none)'}, --load "
                         f"{loads[-1] if loads else '(none)'})")
    return Path(loads[-1])


def resume_point(root: Path) -> str:
    """'iteration N' of the newest checkpoint in ``root`` that verifies, else 'scratch'."""
    from zeropp.checkpoints.checkpoint_integrity import newest_verified

    tag = newest_verified(root)
    if tag is None:
        return "scratch"
    match = re.search(r"(\d+)$", tag)
    return f"iteration {int(match.group(1))} ({tag})" if match else tag


def run_once(command: list[str], status_file: Path, attempt: int = 0) -> int:
    """The command's exit status; Ctrl-C or SIGTERM stop it and raise KeyboardInterrupt."""
    status_file.write_text("")
    env = {**os.environ, STATUS_ENV: str(status_file), ATTEMPT_ENV: str(attempt)}
    process = subprocess.Popen(command, env=env, start_new_session=True)

    def stop(signum, frame):
        raise KeyboardInterrupt

    # Both installed explicitly: a shell that started this in the background may have left
    # SIGINT ignored, and Ctrl-C must still end the job.
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return process.wait()
    except KeyboardInterrupt:
        # The whole process group: a launcher's workers are in it too.
        for sig, grace in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(process.pid, sig)
                process.wait(timeout=grace)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def supervise(command: list[str], restarts: int, backoff: float, log=print) -> int:
    root = checkpoint_dir(command)
    with tempfile.TemporaryDirectory(prefix="zeropp-supervise-") as scratch:
        status_file = Path(scratch) / "status"
        attempt = 0
        while True:
            status = run_once(command, status_file, attempt)
            if status == 0:
                return 0
            note = status_file.read_text().strip()
            if status == USAGE_STATUS or note == USAGE_NOTE:
                log(f"supervise: exit status {status}, a usage error: not restarting")
                return status
            if attempt == restarts:
                log(f"supervise: exit status {status}; no restarts left ({restarts} used)")
                return status
            attempt += 1
            why = f" ({note})" if note.startswith(HANG_NOTE) else ""
            log(f"supervise: exit status {status}{why}; restart {attempt} of {restarts} in "
                f"{backoff:g} s, from {resume_point(root)}")
            time.sleep(backoff)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_lite.supervise",
        description="Relaunch a training job from its latest verified checkpoint when it fails.",
        usage="%(prog)s --restarts N [--backoff S] -- COMMAND ...")
    parser.add_argument("--restarts", type=int, required=True,
                        help="relaunches allowed after the first run fails")
    parser.add_argument("--backoff", type=float, default=10.0,
                        help="seconds to wait before each relaunch (default 10)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the launch command, after --")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command given: put the launch command after --")
    if args.restarts < 0:
        parser.error(f"--restarts must be at least 0, got {args.restarts}")
    if args.backoff < 0:
        parser.error(f"--backoff must be at least 0, got {args.backoff}")
    try:
        checkpoint_dir(args.command)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return supervise(args.command, args.restarts, args.backoff,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
    except KeyboardInterrupt:
        print("supervise: interrupted; the job was stopped", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
