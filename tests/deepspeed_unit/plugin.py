"""A pytest plugin that runs DeepSpeed's own unit tests against zeropp (or DeepSpeed itself).

    cd <DeepSpeed checkout>/tests
    PYTHONPATH=<this project> python -m pytest -p tests.deepspeed_unit.plugin --serve zeropp \
        --record out.json unit/runtime/zero unit/checkpoint unit/runtime/test_ds_initialize.py

(``python -m tests.deepspeed_unit.run`` does this from a DeepSpeed git directory.) DeepSpeed's
``tests/conftest.py`` and ``unit/common.py`` stay in charge of the tests: ``DistributedTest``
launches the ranks, on the CPU accelerator with gloo. This plugin only

- serves zeropp for DeepSpeed's public API with ``--serve zeropp`` ([Note: serving zeropp to
  DeepSpeed's tests] in serving.py); ``--serve deepspeed`` runs DeepSpeed itself;
- leaves out the tests that need DeepSpeed's internals (``scope.OUT_OF_SCOPE``, each with its
  reason): deselected, and listed in the record;
- preloads torch and deepspeed in multiprocessing's forkserver, from which DeepSpeed's
  scaffolding forks every rank: a rank then starts without importing them again;
- writes each test's outcome to ``--record`` as it finishes (a run cut short keeps what ran).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

from tests.deepspeed_unit import scope, serving

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SERVE_DIR = Path(__file__).resolve().parent / "serve"


def pytest_addoption(parser) -> None:
    group = parser.getgroup("deepspeed_unit", "DeepSpeed's unit tests against zeropp")
    group.addoption("--serve", choices=("zeropp", "deepspeed"), default="zeropp",
                    help="the package that answers DeepSpeed's public API")
    group.addoption("--record", default=None, help="JSON file of each test's outcome")
    group.addoption("--all-tests", action="store_true",
                    help="run the out-of-scope tests too")


def pytest_configure(config) -> None:
    paths = [str(SERVE_DIR), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if config.getoption("--serve") == "zeropp":
        os.environ[serving.ENV] = "1"
        os.environ["ZEROPP_PROJECT_ROOT"] = str(PROJECT_ROOT)
        serving.install()
    # The forkserver is started later, by the first DistributedTest, with these loaded.
    multiprocessing.set_forkserver_preload(["torch", "deepspeed", "unit.common", "unit.simple_model"])
    _Record(config.getoption("--record"), config.getoption("--serve"))


def pytest_collection_modifyitems(config, items) -> None:
    record = _Record.current
    if config.getoption("--serve") == "zeropp":
        hanging = [item for item in items if item.nodeid in scope.FAILS_BY_HANGING]
        for item in hanging:
            record.outcomes[item.nodeid] = {"outcome": "failed (not run)", "seconds": 0.0,
                                            "reason": scope.FAILS_BY_HANGING[item.nodeid]}
        if hanging:
            config.hook.pytest_deselected(items=hanging)
            items[:] = [item for item in items if item.nodeid not in scope.FAILS_BY_HANGING]
    if not config.getoption("--all-tests"):
        kept, left = [], []
        for item in items:
            reason = scope.out_of_scope(item.nodeid)
            (left if reason else kept).append(item)
            if reason:
                record.out_of_scope[item.nodeid] = reason
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = kept
    record.write()


def pytest_runtest_logreport(report) -> None:
    if _Record.current is not None:
        _Record.current.add(report)


class _Record:
    current: _Record | None = None

    def __init__(self, path: str | None, serve: str) -> None:
        self.path = Path(path) if path else None
        self.serve = serve
        self.outcomes: dict[str, dict] = {}
        self.out_of_scope: dict[str, str] = {}
        self.started = time.time()
        _Record.current = self

    def add(self, report) -> None:
        entry = self.outcomes.setdefault(report.nodeid, {"outcome": "passed", "seconds": 0.0})
        entry["seconds"] = round(entry["seconds"] + report.duration, 2)
        if report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            longrepr = report.longrepr
            entry["reason"] = str(longrepr[-1] if isinstance(longrepr, tuple) else longrepr)
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else f"error ({report.when})"
            entry["reason"] = _exception_line(report)
        if report.when == "teardown":
            self.write()

    def write(self) -> None:
        if self.path is None:
            return
        self.path.write_text(json.dumps(
            {"serve": self.serve, "wall_seconds": round(time.time() - self.started, 1),
             "outcomes": self.outcomes, "out_of_scope": self.out_of_scope},
            indent=1, sort_keys=True) + "\n")


def _exception_line(report) -> str:
    """The failure's last 'E ' line (the exception the ranks raised), cut to 300 characters."""
    text = str(report.longrepr)
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    error_lines = [line for line in lines if "Error" in line or "assert" in line]
    chosen = (error_lines or lines or text.strip().splitlines() or [""])[-1]
    return chosen[:300]
