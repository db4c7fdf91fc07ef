"""The commands the documentation gives still run.

Every ``python -m MODULE ...`` (also ``.venv/bin/python -m``, ``sudo ... python -m``) in
README.md and docs/*.md names a module of this tree whose ``--help`` exits 0, every
``scripts/...sh`` and ``configs/...`` path they name exists, and every relative link they make
points to a file of the tree. README.md stays a landing page: at most 260 lines, with a table
of links to the docs/ pages that hold the reference.

Each ``--help`` runs as ``python -m`` runs it (``runpy`` with ``__name__ == "__main__"``), in a
process of its own forked from the test's, which imported torch, transformers and this project
once: nearly all of a fresh interpreter's time would be importing them, 22 times over.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import runpy
import signal
import sys
import tempfile
import time
import traceback
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
HELP_TIMEOUT_S = 240  # for all of them; the machine running the tests may be busy
README_MAX_LINES = 260
# A markdown link or image target: ``[text](target)``, ``![alt](target)``.
LINK = re.compile(r"\]\(([^()\s]+)\)")


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


def named_paths(document: Path) -> list[str]:
    """``scripts/...sh`` and ``configs/...`` paths a document names (relative to the root)."""
    paths = []
    for raw in re.findall(r"(?<![\w/.-])((?:scripts|configs)/[\w./{},-]*)", document.read_text()):
        for path in _expand_braces(raw.rstrip(".,")):
            if path.startswith("configs/") or path.endswith(".sh"):
                paths.append(path)
    return sorted(set(paths))


def relative_links(document: Path) -> list[str]:
    """Targets of the document's links that are files of this tree, without their #anchor."""
    targets = []
    for target in LINK.findall(document.read_text()):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def readme_link_table() -> list[str]:
    """The link targets in the table of README.md's "Documentation" section."""
    section = re.search(r"^## Documentation\n(.*?)(?=^## |\Z)", (ROOT / "README.md").read_text(),
                        re.MULTILINE | re.DOTALL)
    assert section is not None, "README.md has no '## Documentation' section"
    rows = [line for line in section[1].splitlines() if line.startswith("|")]
    return [target.split("#", 1)[0] for row in rows for target in LINK.findall(row)]


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


# What the modules import, loaded once here so that each forked child imports only the rest.
PRELOAD = ["torch", "transformers", "zeropp", "megatron_lite.pretrain_gpt", "megatron_lite.hf",
           "data.preprocess"]


def _run_help(module: str, output: str) -> int:
    """``python -m module --help`` in this (forked) process; its output goes to ``output``."""
    with open(output, "w") as out, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(out):
        sys.argv = [module, "--help"]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit_:
            return exit_.code if isinstance(exit_.code, int) else int(exit_.code is not None)
        except BaseException:  # noqa: B036 - the module's failure, reported with its traceback
            traceback.print_exc()
            return 1
    return 0


def help_exit_codes(modules: list[str]) -> dict[str, tuple[int | str, str]]:
    """Module -> (exit code or "timeout", its output), each run in a child forked from here."""
    for name in PRELOAD:
        importlib.import_module(name)
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryDirectory() as directory:
        outputs = {module: str(Path(directory) / f"{module}.txt") for module in modules}
        running: dict[int, str] = {}
        for module in modules:
            pid = os.fork()
            if pid == 0:  # the child: never returns into the test runner
                code = 1
                try:
                    code = _run_help(module, outputs[module])
                finally:
                    os._exit(code)
            running[pid] = module
        codes: dict[str, int | str] = {}
        deadline = time.monotonic() + HELP_TIMEOUT_S
        while running and time.monotonic() < deadline:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.05)
            elif pid in running:
                codes[running.pop(pid)] = os.waitstatus_to_exitcode(status)
        for pid, module in running.items():
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes[module] = "timeout"
        return {module: (codes[module], Path(outputs[module]).read_text())
                for module in modules}


def test_documented_modules_answer_help(on_path):
    results = help_exit_codes(sorted(documented_modules()))
    failed = {module: (code, output) for module, (code, output) in results.items() if code != 0}
    assert failed == {}, "python -m MODULE --help failed:\n" + "\n".join(
        f"{module}: exit {code}\n{output[-2000:]}" for module, (code, output) in failed.items())
    # each really printed its usage (a module that exits 0 without parsing would not)
    silent = [module for module, (_, output) in results.items() if "usage:" not in output]
    assert silent == [], f"exited 0 without printing a usage: {silent}"


def test_documents_name_existing_scripts_and_configs():
    readme = named_paths(ROOT / "README.md")
    assert "scripts/quickstart.sh" in readme and "configs/ds_zero3_config.json" in readme
    missing = {document.name: absent for document in DOCUMENTS
               if (absent := [path for path in named_paths(document)
                              if not (ROOT / path).exists()])}
    assert missing == {}, f"paths the documents name that do not exist: {missing}"


def test_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, at most {README_MAX_LINES}"
    pages = readme_link_table()
    docs_pages = [page for page in pages if page.startswith("docs/")]
    # the reference lives in pages of one subject each
    for page in ("docs/data.md", "docs/training.md", "docs/configuration.md",
                 "docs/checkpoints.md", "docs/paper_setups.md", "docs/results.md"):
        assert page in docs_pages, page
    missing = [page for page in pages if not (ROOT / page).is_file()]
    assert missing == [], f"README.md's link table names pages that do not exist: {missing}"


def test_relative_links_point_to_files():
    links = {document: relative_links(document) for document in DOCUMENTS}
    assert "docs/img/throughput.png" in links[ROOT / "README.md"]
    broken = {document.name: absent for document, targets in links.items()
              if (absent := [target for target in targets
                             if not (document.parent / target).exists()])}
    assert broken == {}, f"relative links to files that do not exist: {broken}"
