"""The one call a lent GPU gets (scripts/gpu_check/session.sh) cannot rot between GPU
sessions. Run here with a stand-in ``python3`` that records what it is asked to run and
writes, under the names each program uses, the files it would write: every part is reached
and logged with its exit status, each part's results arrive in OUT under the names the
script copies, the train part's summary runs on them, every command line parses with the
flags of the program it names, and the session's time budget skips what would not fit (a
renamed flag, module or file fails here, not on the GPU, where the device time is spent)."""

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
LOGGED = ("check", "graph", "train_eager", "train_graph", "side_wheels", "side", "profile")

# The stand-in python3: records its command line, writes the file(s) the program would
# write (their names taken from the programs), runs a script given on stdin for real.
STUB = """#!{python}
import json, sys
from pathlib import Path
sys.path.insert(0, {root!r})
argv = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(argv) + "\\n")

def value(flag):
    return Path(argv[argv.index(flag) + 1])

module = argv[1] if argv[:1] == ["-m"] else None
if module == "scripts.gpu_check.run":
    from scripts.gpu_check.report import REPORT_NAME
    value("--out").mkdir(parents=True, exist_ok=True)
    (value("--out") / REPORT_NAME).write_text("{{}}")
elif module == "scripts.gpu_check.graph_check":
    from scripts.gpu_check.graph_check import REPORT_NAME
    value("--out").mkdir(parents=True, exist_ok=True)
    (value("--out") / REPORT_NAME).write_text("{{}}")
elif module == "scripts.gpu_check.side_by_side":
    value("--out").write_text("{{}}")
elif module == "torch.distributed.run":
    value("--metrics-file").write_text(json.dumps({{"iteration": 1, "lm loss": 9.5}}) + "\\n")
elif argv[:1] == ["-"]:  # a script on stdin (the train part's summary): run it
    sys.argv = argv
    exec(compile(sys.stdin.read(), "<stdin>", "exec"))
"""


def _run_session(tmp: Path, budget_s: int | None = None) -> tuple[list[list[str]], Path]:
    stubs, out, wheels, scratch = tmp / "bin", tmp / "out", tmp / "wheels", tmp / "scratch"
    for folder in (stubs, wheels, scratch):
        folder.mkdir()
    log = tmp / "python3.jsonl"
    python3 = stubs / "python3"
    python3.write_text(STUB.format(python=sys.executable, root=str(ROOT), log=str(log)))
    nvidia_smi = stubs / "nvidia-smi"
    nvidia_smi.write_text("#!/bin/sh\necho 'name, memory.total'\n")
    for stub in (python3, nvidia_smi):
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "OUT": str(out),
           "WHEELS": str(wheels), "TMPDIR": str(scratch)}
    if budget_s is not None:
        env["BUDGET_S"] = str(budget_s)
    done = subprocess.run(["bash", str(SESSION), *PARTS], env=env, cwd=ROOT, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(scratch.iterdir()) == []  # the session's work folder is removed
    return [json.loads(line) for line in log.read_text().splitlines()], out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> tuple[list[list[str]], Path]:
    """(the stand-in python3's command lines, OUT)."""
    return _run_session(tmp_path_factory.mktemp("session"))


def test_every_part_runs_and_its_results_arrive(recorded) -> None:
    _, out = recorded
    session_log = (out / "session.log").read_text()
    for part in LOGGED:
        assert f"{part}: exit 0 after" in session_log, session_log
    assert "unknown part" not in session_log and "skipped" not in session_log
    # What the device sends back, at most 8 files: each part's JSON under the name the
    # script copies, the session's log and every part's log.
    left = sorted(path.name for path in out.iterdir())
    assert left == sorted(["gpu_check.json", "gpu_graph_check.json", "logs.tgz", "session.log",
                           "side_by_side.json", "train_graph_vs_eager.json"])
    summary = json.loads((out / "train_graph_vs_eager.json").read_text())
    assert summary == {mode: [{"iteration": 1, "lm loss": 9.5}] for mode in ("eager", "graph")}
    listed = subprocess.run(["tar", "tzf", str(out / "logs.tgz")], capture_output=True,
                            text=True, check=True).stdout
    assert all(f"./{part}.log" in listed.split() for part in LOGGED)


def test_the_budget_skips_what_would_not_fit(tmp_path) -> None:
    """With no time left every part is skipped and named; nothing runs past the budget."""
    lines, out = _run_session(tmp_path, budget_s=0)
    session_log = (out / "session.log").read_text()
    for part in LOGGED:
        assert f"{part}: skipped" in session_log
    assert all(argv[:1] == ["-c"] or argv[:1] == ["-"] for argv in lines)


def test_the_side_by_side_budget_is_what_its_part_has_left(tmp_path) -> None:
    """The side by side stops starting systems before its part's limit, cut to the session's
    budget, would kill it (a fixed budget let it run past a cut limit and lose its JSON)."""
    lines, _ = _run_session(tmp_path, budget_s=200)
    side = next(argv for argv in lines if argv[1:2] == ["scripts.gpu_check.side_by_side"])
    budget = int(side[side.index("--budget") + 1])
    assert 150 <= budget <= 200 - 20


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
    lines, _ = recorded
    modules = {}
    for argv in lines:
        if argv[:1] == ["-m"]:
            modules.setdefault(argv[1], []).append(argv[2:])
    assert {"scripts.gpu_check.run", "scripts.gpu_check.graph_check", "torch.distributed.run",
            "scripts.gpu_check.side_by_side", "scripts.bench.host_profile"} <= set(modules)
    from scripts.gpu_check.run import parse_args as check_args

    for argv in modules.pop("scripts.gpu_check.run"):
        check_args(argv)  # its own checks of sections and budgets too
    from torch.distributed.run import parse_args as torchrun_args

    from megatron_lite.arguments import parse_args, validate_args

    launches = modules.pop("torch.distributed.run")
    assert len(launches) == 2  # eager and --cuda-graph
    for argv in launches:
        script = argv.index("pretrain_zeropp_gpt.py")
        torchrun_args(argv[:script + 1])
        assert (ROOT / argv[script]).exists()
        validate_args(parse_args(argv[script + 1:]), world_size=1)
    modules.pop("pip", None)
    for module, command_lines in modules.items():
        for argv in command_lines:
            _parses(module, argv, monkeypatch)
