"""The commands the documentation gives still run.

Every ``python -m MODULE ...`` (also ``.venv/bin/python -m``, ``sudo ... python -m``) in
README.md and docs/*.md names a module of this tree whose ``--help`` exits 0, and every
``scripts/...sh`` and ``configs/...`` path README.md names exists. The ``--help`` calls run
concurrently: nearly all of their time is interpreter start-up and importing torch.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A dotted name directly followed by a space, a backtick, a closing parenthesis, a line
# continuation or the end of the line: ``python -m scripts.bench.<name>`` is a placeholder,
# not a command, and does not match.
COMMAND = re.compile(r"(?:^|[\s`(])(?:\S*/)?python[0-9.]* -m "
                     r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?=[\s`)\\]|$)", re.MULTILINE)
# Modules the documents run that are not this project's: their --help is theirs to keep.
THIRD_PARTY = {"torch.distributed.run", "pytest", "pip", "venv", "deepspeed"}
# Placeholders the prose uses for "any of these modules".
PLACEHOLDERS = {"scripts.bench.X"}
HELP_TIMEOUT_S = 240  # per module; the machine running the tests may be busy


def documented_modules() -> dict[str, list[str]]:
    """Module -> the documents that run it as ``python -m``."""
    found: dict[str, list[str]] = {}
    for document in DOCUMENTS:
        for module in COMMAND.findall(document.read_text()):
            if module in THIRD_PARTY or module in PLACEHOLDERS:
                continue
            found.setdefault(module, [])
            if document.name not in found[module]:
                found[module].append(document.name)
    return found


def _expand_braces(path: str) -> list[str]:
    """``a_{1,2}.sh`` -> ``a_1.sh``, ``a_2.sh`` (the shell's brace expansion, one level)."""
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    return [expanded for choice in match[1].split(",")
            for expanded in _expand_braces(path[:match.start()] + choice + path[match.end():])]


def readme_paths() -> list[str]:
    """``scripts/...sh`` and ``configs/...`` paths README.md names."""
    text = (ROOT / "README.md").read_text()
    paths = []
    for raw in re.findall(r"(?<![\w/.-])((?:scripts|configs)/[\w./{},-]*)", text):
        for path in _expand_braces(raw.rstrip(".,")):
            if path.startswith("configs/") or path.endswith(".sh"):
                paths.append(path)
    return sorted(set(paths))


def test_the_documents_run_modules():
    modules = documented_modules()
    # the extraction itself: a few commands every reader meets must be among them
    for module in ("data.preprocess", "scripts.bench.run_lab", "scripts.bench.report",
                   "megatron_lite.simulate"):
        assert module in modules, module
    assert not any(name.endswith(".") or "<" in name for name in modules)


@pytest.fixture(scope="module")
def on_path():
    sys.path.insert(0, str(ROOT))
    yield
    sys.path.remove(str(ROOT))


def test_documented_modules_exist(on_path):
    missing = {module: documents for module, documents in documented_modules().items()
               if importlib.util.find_spec(module) is None}
    assert missing == {}, f"modules the documents run but the tree lacks: {missing}"


def _help(module: str) -> tuple[str, int | str, str]:
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT,
                              env=environment, capture_output=True, text=True,
                              timeout=HELP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return module, "timeout", ""
    return module, done.returncode, (done.stderr or done.stdout)[-2000:]


def test_documented_modules_answer_help():
    modules = sorted(documented_modules())
    with ThreadPoolExecutor(max_workers=min(len(modules), max(4, os.cpu_count() or 1))) as pool:
        results = list(pool.map(_help, modules))
    failed = {module: (code, output) for module, code, output in results if code != 0}
    assert failed == {}, "python -m MODULE --help failed:\n" + "\n".join(
        f"{module}: exit {code}\n{output}" for module, (code, output) in failed.items())


def test_readme_names_existing_scripts_and_configs():
    paths = readme_paths()
    assert "scripts/quickstart.sh" in paths and "configs/ds_zero3_config.json" in paths
    missing = [path for path in paths if not (ROOT / path).exists()]
    assert missing == [], f"README.md names paths that do not exist: {missing}"
