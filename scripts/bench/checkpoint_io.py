"""Checkpoint save and load speed against the disk's own, side by side in one run.

    python -m scripts.bench.checkpoint_io [--ranks 2] [--blocks 6] [--async-saves 10]
        [--threads 1] [--dir D]

Spawns ``--ranks`` gloo ranks on the CPU, each holding about 1.1 GiB of checkpoint state with
the defaults (fp32 masters and AdamW moments of a 200M-parameter model of wide MLP blocks),
and measures, every rank at once, between barriers:

- sync save: ``engine.save_checkpoint`` until the checkpoint is published (after one untimed
  save, as in a run, where every save after the first reuses its staging buffers);
- async save: training blocked (the call, plus any wait of the next optimizer update for the
  staging copy), and the time until the checkpoint is published, with training running
  meanwhile; the median over ``--async-saves`` saves;
- what a save costs training ([Note: what a save costs training]), async and sync;
- load: ``engine.load_checkpoint`` (checksums verified, then the shards restored), with the
  files evicted from the page cache first (the rank's own file is read with ``O_DIRECT``
  anyway; rank 0's, whose small records every rank reads, from the disk too), and how far
  the rank's RSS rose above where it stood before the load, at its peak (VmHWM, reset first);
- dd: ``dd oflag=direct`` writing, then ``dd iflag=direct`` reading, one file of each rank's
  shard size per rank, concurrently, into the same directory;
- RSS of each rank after the first and after the last async save (staging is reused).

[Note: what a save costs training]
Timing the save call says little: an async save returns at once and then competes with
training for cores, memory bandwidth and the GIL while it stages and writes. So each
repetition times three windows of ``--window`` iterations back to back: with no save, with
an async save issued at its start (prolonged until the checkpoint is published, as the
training loop checks at each boundary), and with a sync save at its start. A save's cost is
its window's time beyond as many iterations at the no-save window's pace; the medians over
``--async-saves`` repetitions are reported, and the async cost as a fraction of the sync one.
Adjacent windows see the same machine, so a change in load shifts all three alike.

Prints a markdown table; the throughput column counts every rank's bytes.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

DD_BLOCK = 32 << 20


class WideBlocks(nn.Module):
    """An embedding, ``blocks`` MLP blocks of width x 4*width, and a tied head."""

    def __init__(self, blocks: int, width: int = 2048, vocab: int = 512) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(blocks))

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return F.linear(x, self.embed.weight)


def _iteration(engine, rank: int) -> None:
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(rank))
    logits = engine(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    engine.backward(loss)
    engine.step()


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _save_async(engine, ckpt: Path, tag: str, waited: list[float], blocked: list[float]):
    """An async save whose call, and any wait of the next optimizer update for the staging
    copy (added to ``waited``), is what training is blocked by."""
    start = time.perf_counter()
    engine.save_checkpoint(ckpt, tag=tag, async_save=True)
    blocked.append(time.perf_counter() - start)
    guard = engine.optimizer.before_update

    def timed_guard():
        start = time.perf_counter()
        guard()
        waited[0] += time.perf_counter() - start

    engine.optimizer.before_update = timed_guard


def _window(engine, rank: int, iterations: int, save=None, published=None):
    """(seconds, iterations) of a training window starting with ``save()``: at least
    ``iterations``, and on until an async save in flight is published (the training loop
    checks at each boundary); its publication time is appended to ``published``."""
    dist.barrier()
    start = time.perf_counter()
    if save is not None:
        save()
    done, in_flight = 0, published is not None
    while done < iterations or in_flight:
        _iteration(engine, rank)
        done += 1
        if in_flight and engine.finish_checkpoint(wait=False) is not None:
            published.append(time.perf_counter() - start)
            in_flight = False
    return time.perf_counter() - start, done


def _rss_bytes(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> bool:
    """Start VmHWM again from the current RSS (Linux: clear_refs 5); False where refused."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _evict(paths) -> None:
    """Drop these files' pages from the page cache (only ours: no global drop_caches)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _dd(args: list[str]) -> None:
    result = subprocess.run(["dd", *args, "status=none"], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"dd {' '.join(args)} failed: {result.stderr.strip()}")


def rank_main(rank: int, world: int, options: argparse.Namespace, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(options.threads)
    dist.init_process_group("gloo", init_method=f"file://{options.dir}/store", rank=rank,
                            world_size=world)
    from zeropp.deepspeed_api.initialize import build_engine
    from zeropp.sharded_model import ShardingOptions

    torch.manual_seed(0)
    engine = build_engine(WideBlocks(options.blocks), lr=1e-4,
                          sharding=ShardingOptions(stage=3, persistence_threshold=0))
    _iteration(engine, rank)  # the optimizer's moments exist from the first step
    ckpt = Path(options.dir) / "ckpt"
    engine.save_checkpoint(ckpt, tag="warmup")  # makes the staging buffers, as any run's first
    row: dict[str, float] = {}
    row["sync_save"] = _timed(lambda: engine.save_checkpoint(ckpt, tag="sync"))
    mine = ckpt / "sync" / f"zero_rank{rank:05d}.pt"
    shard_bytes = mine.stat().st_size
    _evict([ckpt / "sync" / f"zero_rank{r:05d}.pt" for r in range(world)])
    dist.barrier()
    peak_known = _reset_peak_rss()
    before_load = _rss_bytes()
    row["load"] = _timed(lambda: engine.load_checkpoint(ckpt, tag="sync"))
    row["load_peak_growth"] = (_rss_bytes("VmHWM") - before_load) if peak_known else -1

    blocked, published, rss, overlapped = [], [], [], []
    lost = {"async": [], "sync": []}
    for index in range(options.async_saves):
        # Paired windows, adjacent in time so that a change in the machine's load hits both:
        # --window iterations with no save, then with an async save issued at the start, then
        # with a sync one. What a save costs training is its window's time beyond as many
        # iterations at the no-save window's pace ([Note: what a save costs training]).
        plain, _ = _window(engine, rank, options.window)
        pace = plain / options.window
        waited = [0.0]
        seconds, iterations = _window(engine, rank, options.window, functools.partial(
            _save_async, engine, ckpt, f"async{index}", waited, blocked), published)
        blocked[-1] += waited[0]
        lost["async"].append(seconds - iterations * pace)
        overlapped.append(iterations)
        rss.append(_rss_bytes())
        seconds, iterations = _window(engine, rank, options.window, functools.partial(
            engine.save_checkpoint, ckpt, tag=f"sync{index}"))
        lost["sync"].append(seconds - iterations * pace)
        for tag in (f"async{index}", f"sync{index}"):
            shutil.rmtree(ckpt / tag, ignore_errors=True)  # keep the disk use small
    row["async_blocked"] = _median(blocked)
    row["async_published"] = _median(published)
    row["async_training_lost"] = _median(lost["async"])
    row["sync_training_lost"] = _median(lost["sync"])
    row["async_overlapped_iterations"] = _median(overlapped)
    row["iteration"] = pace

    dd_file = Path(options.dir) / f"dd_rank{rank}"
    count = -(-shard_bytes // DD_BLOCK)
    row["dd_write"] = _timed(lambda: _dd(["if=/dev/zero", f"of={dd_file}", f"bs={DD_BLOCK}",
                                          f"count={count}", "oflag=direct"]))
    row["dd_read"] = _timed(lambda: _dd([f"if={dd_file}", "of=/dev/null", f"bs={DD_BLOCK}",
                                         "iflag=direct"]))
    row.update(shard_bytes=shard_bytes, dd_bytes=count * DD_BLOCK, rss_first=rss[0],
               rss_last=rss[-1], staging_bytes=engine._checkpoint_staging.nbytes)
    engine.close()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, row)
    if rank == 0:
        results.put(gathered)
    dist.barrier()
    dist.destroy_process_group()


def render(rows: list[dict], options: argparse.Namespace) -> str:
    def slowest(key):
        return max(r[key] for r in rows)

    total = sum(r["shard_bytes"] for r in rows)
    dd_total = sum(r["dd_bytes"] for r in rows)
    rate = {key: total / slowest(key) for key in ("sync_save", "load")}
    dd_rate = {key: dd_total / slowest(key) for key in ("dd_write", "dd_read")}
    gib = total / len(rows) / 2**30
    lines = [
        f"{len(rows)} ranks x {gib:.2f} GiB of checkpoint state each (gloo, CPU), "
        f"{options.async_saves} async saves, {options.threads} torch thread(s) per rank",
        "",
        "| operation | time (s) | GB/s, all ranks | vs dd direct |",
        "|---|---:|---:|---:|",
        f"| sync save (until published) | {slowest('sync_save'):.2f} | "
        f"{rate['sync_save'] / 1e9:.2f} | {rate['sync_save'] / dd_rate['dd_write']:.0%} |",
        f"| async save: training blocked | {slowest('async_blocked'):.3f} | | "
        f"1/{slowest('sync_save') / slowest('async_blocked'):.0f} of sync save |",
        f"| async save: until published | {slowest('async_published'):.2f} | | |",
        f"| sync save: training lost over a {options.window}-iteration window "
        f"({slowest('iteration'):.2f} s per iteration without a save) | "
        f"{slowest('sync_training_lost'):.2f} | | |",
        f"| async save: training lost over the "
        f"{slowest('async_overlapped_iterations'):.0f} iterations until published | "
        f"{slowest('async_training_lost'):.2f} | | "
        f"{slowest('async_training_lost') / slowest('sync_training_lost'):.2f} of sync save's |",
        f"| load (verify + restore) | {slowest('load'):.2f} | {rate['load'] / 1e9:.2f} | "
        f"{rate['load'] / dd_rate['dd_read']:.0%} |",
        f"| dd oflag=direct write | {slowest('dd_write'):.2f} | "
        f"{dd_rate['dd_write'] / 1e9:.2f} | |",
        f"| dd iflag=direct read | {slowest('dd_read'):.2f} | {dd_rate['dd_read'] / 1e9:.2f} | |",
        "",
        "RSS per rank after async save 1 / after save "
        f"{options.async_saves}: " + ", ".join(
            f"{r['rss_first'] / 2**30:.2f} / {r['rss_last'] / 2**30:.2f} GiB "
            f"({(r['rss_last'] - r['rss_first']) / r['rss_first']:+.1%})" for r in rows)
        + f"; staging {rows[0]['staging_bytes'] / 2**30:.2f} GiB per rank",
        "",
        "Load: RSS at its peak above where it stood before, per rank (rank file "
        f"{rows[0]['shard_bytes'] / 2**30:.2f} GiB): " + ", ".join(
            f"{r['load_peak_growth'] / 2**30:+.2f} GiB" if r["load_peak_growth"] >= 0
            else "not measured (no clear_refs)" for r in rows),
    ]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.checkpoint_io",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=6,
                        help="MLP blocks of 33.6M parameters (default 6: 1.1 GiB per rank "
                        "at 2 ranks)")
    parser.add_argument("--async-saves", type=int, default=10)
    parser.add_argument("--window", type=int, default=4,
                        help="iterations per timed window: with no save, with an async save "
                        "issued at its start, with a sync one (default 4, a save every 4 "
                        "iterations)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per rank (default 1); as many as the cores leaves "
                        "the writer no core to spare")
    parser.add_argument("--dir", default=None,
                        help="where to write (default: a new directory in the temp dir); "
                        "removed at the end")
    options = parser.parse_args(argv)
    for name in ("ranks", "blocks", "async_saves", "window", "threads"):
        if getattr(options, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return options


def main(argv=None) -> int:
    options = parse_args(argv)
    base = Path(options.dir) if options.dir else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    options.dir = tempfile.mkdtemp(prefix="checkpoint-io-", dir=base)
    try:
        results = mp.get_context("spawn").SimpleQueue()
        mp.spawn(rank_main, args=(options.ranks, options, results), nprocs=options.ranks)
        print(render(results.get(), options))
    finally:
        shutil.rmtree(options.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
