"""Checkpoint integrity: a checksum for every file, verified before a load, and a fallback to
the newest checkpoint that verifies.

[Note: checkpoint checksums]
Each rank's shard file is checksummed while ``torch.save`` writes it (``DirectFileWriter``,
``zeropp/checkpoints/checkpoint_io.py``: CRC-32 and byte count of the stream, nothing read back);
rank 0 gathers every rank's pair and records them in ``meta.json`` under ``"checksums"``. CRC-32
because it runs at several GB/s
and catches any error burst up to 32 bits and all but 2^-32 of the rest: this guards against
bad disk blocks and torn copies, not against someone forging a file.

A load verifies first (``verify``): the files are shared round-robin among the loading ranks,
each reads its share once in 16 MiB chunks (the page cache then serves the memory-mapped load)
and every rank learns whether all passed through one all-reduce, so all ranks agree. The
checksums in ``meta.json`` also say which files must exist: a missing or truncated one fails
the same way. A checkpoint from before checksums loads, with one line saying it is not
verified.

``choose`` picks what ``--load`` resumes from: ``latest``'s tag if it verifies, else the
newest complete checkpoint that does (by the time its ``meta.json`` was written), with one
line naming the one that failed and why; nothing is deleted or overwritten.
``fallback=False`` raises instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from zeropp.checkpoints.checkpoint_files import CheckpointError, shard_file
from zeropp.checkpoints.checkpoint_io import file_checksum
from zeropp.comm.collectives import all_gather_into_tensor


def gather_checksums(crc: int, nbytes: int, device: torch.device) -> list[list[int]]:
    """Every rank's (crc32, bytes), in rank order (collective; a tensor, so NCCL takes it)."""
    mine = torch.tensor([crc, nbytes], dtype=torch.int64, device=device)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [mine.tolist()]
    every = torch.empty(dist.get_world_size(), 2, dtype=torch.int64, device=device)
    all_gather_into_tensor(every.view(-1), mine)
    return every.tolist()


def _problem(tag_dir: Path, rank: int, world: int) -> str | None:
    """What is wrong with this rank's share of ``tag_dir``'s files, or None."""
    try:
        meta = json.loads((tag_dir / "meta.json").read_text())
    except FileNotFoundError:
        return f"{tag_dir / 'meta.json'} is missing (an incomplete checkpoint)"
    except (OSError, ValueError) as error:
        return f"{tag_dir / 'meta.json'} cannot be read: {error}"
    checksums = meta.get("checksums")
    if checksums is None:
        return None  # written before checksums: nothing to verify against
    for index in range(rank, len(checksums), world):
        path = shard_file(tag_dir, index)
        if not path.is_file():
            return f"{path} is missing"
        expected_crc, expected_size = checksums[index]
        crc, size = file_checksum(path)
        if size != expected_size:
            return f"{path} has {size} bytes, {expected_size} were written (truncated?)"
        if crc != expected_crc:
            return f"{path} fails its checksum (crc32 {crc:08x}, written {expected_crc:08x})"
    return None


def has_checksums(tag_dir: Path) -> bool:
    try:
        return "checksums" in json.loads((tag_dir / "meta.json").read_text())
    except (OSError, ValueError):
        return False


def verify(tag_dir: Path, device: torch.device) -> str | None:
    """Collective: None when every file of ``tag_dir`` verifies, else what failed (as the
    first rank that found a problem saw it; the same text on every rank)."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    problem = _problem(tag_dir, rank, world)
    failed = torch.tensor([0 if problem is None else 1], device=device)
    if distributed:
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() == 0:
        return None
    if distributed:  # rare: every rank learns the first rank's finding, to name the file
        found: list = [None] * world
        dist.all_gather_object(found, problem)
        problem = next(p for p in found if p is not None)
    return problem


def candidates(root: Path, latest: str | None) -> list[str]:
    """Tags to try, in order: ``latest``'s, then every other complete-looking checkpoint
    directory, newest ``meta.json`` first (unfinished ``.tmp`` and replaced ``.old`` skipped)."""
    others = []
    for entry in root.iterdir() if root.is_dir() else []:
        meta = entry / "meta.json"
        if entry.name == latest or entry.suffix in (".tmp", ".old") or not meta.is_file():
            continue
        others.append((meta.stat().st_mtime, entry.name))
    ordered = [name for _mtime, name in sorted(others, reverse=True)]
    return ([latest] if latest is not None else []) + ordered


def choose(root: Path, latest: str | None, device: torch.device, fallback: bool,
           log=print) -> str:
    """The tag to load (collective; see [Note: checkpoint checksums])."""
    failures = []
    for tag in candidates(root, latest):
        problem = verify(root / tag, device)
        if problem is None:
            if failures:
                log(f"checkpoint {failures[0][0]} is not usable ({failures[0][1]}); "
                    f"resuming from {tag}, the newest one that verifies (nothing was deleted)")
            elif not has_checksums(root / tag):
                log(f"checkpoint {root / tag} predates checksums: loaded unverified")
            return tag
        if not fallback:
            raise CheckpointError(f"checkpoint {root / tag}: {problem}")
        failures.append((root / tag, problem))
    if failures:
        raise CheckpointError(f"no checkpoint in {root} verifies; the newest: "
                              f"{failures[0][0]}: {failures[0][1]}")
    raise CheckpointError(f"{root} holds no checkpoint")


def newest_verified(root: Path) -> str | None:
    """In one process (no ranks): the tag ``--load root`` would resume from, or None."""
    latest_file = root / "latest"
    latest = latest_file.read_text().strip() if latest_file.is_file() else None
    for tag in candidates(root, latest):
        if _problem(root / tag, 0, 1) is None:
            return tag
    return None
