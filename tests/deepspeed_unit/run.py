"""Run DeepSpeed's public-API unit tests against zeropp, or DeepSpeed itself, on the CPU.

    python -m tests.deepspeed_unit.run --deepspeed-git <DeepSpeed clone or git dir> \
        [--commit SHA] [--serve zeropp|deepspeed] [--record out.json] [--only passed.json] \
        [-- extra pytest arguments]

DeepSpeed's ``tests/`` folder is taken from the given repository at ``--commit`` (``git
archive``, nothing else of the repository: the installed ``deepspeed`` is the one tested, not
the repository's source, which DeepSpeed's conftest would otherwise put first on the path) into
a cache folder, and pytest runs there with ``tests.deepspeed_unit.plugin``. The test files are
read from DeepSpeed's repository, never copied into this project: they stay DeepSpeed's,
unedited, at a commit the record names. ``--only`` runs the tests a previous record lists as
passed (DeepSpeed's own run), which is what the comparison needs.

One pytest process at a time; DeepSpeed's ``DistributedTest`` starts each test's ranks itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
GROUPS = ("unit/runtime/zero", "unit/checkpoint", "unit/runtime/test_ds_initialize.py")
# The snapshot of deepspeedai/DeepSpeed this project's record was made from (the newest commit
# of the snapshot available; its tag v0.19.8 was not in it): see docs/deepspeed_unit_tests.md.
DEFAULT_COMMIT = "edaa7221267243c7be7fb49c5d5f5c4fb97b4641"


def export_tests(git_dir: Path, commit: str, cache: Path) -> Path:
    """DeepSpeed's ``tests/`` at ``commit``, extracted once into ``cache``."""
    target = cache / f"deepspeed-tests-{commit[:12]}"
    if not (target / "tests" / "unit" / "common.py").exists():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", f"--git-dir={git_dir}", "archive", commit, "tests"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target / "tests"


def git_dir_of(path: Path) -> Path:
    return path / ".git" if (path / ".git").exists() else path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-git", type=Path, required=True,
                        help="a clone of deepspeedai/DeepSpeed (or its git directory)")
    parser.add_argument("--commit", default=DEFAULT_COMMIT)
    parser.add_argument("--serve", choices=("zeropp", "deepspeed"), default="zeropp")
    parser.add_argument("--record", type=Path, default=None, help="outcomes, as JSON")
    parser.add_argument("--only", type=Path, default=None,
                        help="a record whose passed tests are the ones to run")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)

    tests = export_tests(git_dir_of(args.deepspeed_git.resolve()), args.commit,
                         args.cache.resolve())
    selection = list(GROUPS)
    if args.only is not None:
        outcomes = json.loads(args.only.read_text())["outcomes"]
        selection = sorted(k for k, v in outcomes.items() if v["outcome"] == "passed")
    record = args.record.resolve() if args.record else None
    env = dict(os.environ)
    env.update({
        "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
        # DeepSpeed's CPU accelerator counts its devices from LOCAL_SIZE, else one per NUMA
        # node (1 here), and DistributedTest skips a test needing more ranks than devices.
        "LOCAL_SIZE": "4", "ZEROPP_HARNESS_LOCAL_SIZE": "4",  # not for the ranks: serve/
        # A rank left waiting in a collective by its peer's failure gives up after 3 minutes
        # (DeepSpeed's process-group timeout), and a test after 400 s (its test timeout).
        "DEEPSPEED_TIMEOUT": "3", "DS_UNITTEST_TIMEOUT": "400",
        "PYTHONPATH": os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH"))
                                      if p),
    })
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
               "-p", "tests.deepspeed_unit.plugin", "--serve", args.serve,
               *(["--record", str(record)] if record else []), *args.pytest_args, *selection]
    return subprocess.run(command, cwd=tests, env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
