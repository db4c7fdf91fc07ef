"""The one call a lent GPU gets (scripts/gpu_check/session.sh) cannot rot between GPU
sessions: run here with a stand-in ``python3`` that records what it is asked to run, every
part is reached and logged with its exit status, and every command line it would run parses
with the flags of the program it names (a renamed flag or module fails here, not on the GPU,
where the device time is spent)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SESSION = ROOT / "scripts" / "gpu_check" / "session.sh"
PARTS = ("check", "graph", "train", "side", "profile")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[list[list[str]], str, list[str]]:
    """(the stand-in python3's command lines, session.log, the names left in OUT)."""
    tmp = tmp_path_factory.mktemp("session")
    stubs, out, wheels = tmp / "bin", tmp / "out", tmp / "wheels"
    for folder in (stubs, wheels):
        folder.mkdir()
    log = tmp / "python3.jsonl"
    python3 = stubs / "python3"
    python3.write_text(f"""#!{sys.executable}
import json, sys
with open({str(log)!r}, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
if sys.argv[1:2] == ["-"]:  # a script on stdin (the train part's summary)
    sys.stdin.read()
    print("{{}}")
""")
    nvidia_smi = stubs / "nvidia-smi"
    nvidia_smi.write_text("#!/bin/sh\necho 'name, memory.total'\n")
    for stub in (python3, nvidia_smi):
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "OUT": str(out),
           "WHEELS": str(wheels)}
    done = subprocess.run(["bash", str(SESSION), *PARTS], env=env, cwd=ROOT, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    return lines, (out / "session.log").read_text(), sorted(p.name for p in out.iterdir())


def test_every_part_runs_and_is_logged(recorded) -> None:
    _, session_log, left = recorded
    for part in ("check", "graph", "train_eager", "train_graph", "side", "profile"):
        assert f"{part}: exit 0 after" in session_log, session_log
    assert "unknown part" not in session_log
    # What the device sends back: the logs' tarball and the summaries, at most 8 files.
    assert {"session.log", "logs.tgz", "train_graph_vs_eager.json"} <= set(left)
    assert len(left) <= 8


class _Parsed(BaseException):
    """Raised in place of running a program once its command line has parsed."""


def _parses(module: str, argv: list[str], monkeypatch) -> None:
    """``module``'s ``main(argv)`` gets as far as a parsed command line."""
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise _Parsed

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        with pytest.raises(_Parsed):
            importlib.import_module(module).main(argv)


def test_every_command_line_parses(recorded, monkeypatch) -> None:
    lines, _, _ = recorded
    modules = {}
    for argv in lines:
        if argv[:1] == ["-m"]:
            modules.setdefault(argv[1], []).append(argv[2:])
    assert {"scripts.gpu_check.run", "scripts.gpu_check.graph_check", "torch.distributed.run",
            "scripts.gpu_check.side_by_side", "scripts.bench.host_profile"} <= set(modules)
    from scripts.gpu_check.run import parse_args as check_args

    for argv in modules.pop("scripts.gpu_check.run"):
        check_args(argv)  # its own checks of sections and budgets too
    from megatron_lite.arguments import parse_args, validate_args

    launches = modules.pop("torch.distributed.run")
    assert len(launches) == 2  # eager and --cuda-graph
    for argv in launches:
        script = argv.index("pretrain_zeropp_gpt.py")
        assert (ROOT / argv[script]).exists()
        validate_args(parse_args(argv[script + 1:]), world_size=1)
    modules.pop("pip", None)
    for module, command_lines in modules.items():
        for argv in command_lines:
            _parses(module, argv, monkeypatch)
