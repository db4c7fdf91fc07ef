"""Checkpoint files written and read at the disk's speed.

[Note: checkpoint writes at disk speed]
Through the page cache a file written and then fsynced reaches the disk at a fraction of its
bandwidth (on the reference machine 365 MB/s against 1.3 GB/s for ``dd oflag=direct``): the
kernel writes dirty pages back in small pieces and fsync waits for all of them. So a shard
file is written with ``O_DIRECT`` in large aligned chunks: ``torch.save`` streams into one of
two page-aligned host buffers (``CHUNK_BYTES`` each) while a second thread writes the other,
full one; the CRC-32 of the stream is computed on the way in ([Note: checkpoint checksums]),
nothing is read back. The last chunk is padded to the alignment and the file truncated to
its true length before the fsync. The bytes are exactly what ``torch.save`` produced, so
every loader reads the file as before.

Where the file system refuses ``O_DIRECT`` (tmpfs, some network file systems: EINVAL at open
or at the first write) the same chunks go through the page cache, then fsync.

[Note: checkpoint loads at disk speed]
A load reads each rank's own file once (``FileInMemory``): with ``O_DIRECT`` where allowed,
in ``READ_CHUNK_BYTES`` aligned chunks, ``READ_AHEAD`` of them in flight on reader threads (one
request at a time leaves the disk idle between requests), straight into the memory they are
loaded from, while this thread runs the CRC-32 over the chunks already in, in order
(``zlib.crc32`` releases the GIL). That memory is an anonymous in-memory file (``memfd``),
so ``torch.load(mmap=True)`` maps the very pages read: no second read of the disk, no copy,
no separate checksum pass, the file format unchanged, and the bytes loaded are the bytes
verified. Its memory is one rank file, released when the last tensor loaded from it goes:
the load copies out what outlives it (``_OldShards.rank_state`` in ``zeropp/checkpoint.py``).
Where ``memfd`` or ``/proc`` is missing (not Linux) ``IN_MEMORY_LOADS`` is False and the load
memory-maps the file on disk, as do loads at another world size.

Other files (another rank's share of a verification, the files of a load at another world
size) go through the page cache: ``file_checksum`` keeps the same several large reads in
flight, and the memory-mapped load that follows finds the pages there.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

ALIGNMENT = 4096  # O_DIRECT needs offsets, lengths and addresses aligned to the block size
CHUNK_BYTES = 32 << 20  # large enough that each write keeps the disk streaming
READ_CHUNK_BYTES = 16 << 20
READ_AHEAD = 4  # chunks read at once: one stream of requests leaves the disk idle between
_O_DIRECT = getattr(os, "O_DIRECT", 0)
# A file read into memory is loaded through /proc/self/fd: torch.load maps only named files.
IN_MEMORY_LOADS = hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


class _ChunkBuffers:
    """Two page-aligned host buffers (anonymous mmap), made once per process and reused by
    every file this process writes: saves do not grow the process's memory."""

    _lock = threading.Lock()
    _pair: list[mmap.mmap] | None = None

    @classmethod
    def pair(cls) -> list[mmap.mmap]:
        with cls._lock:
            if cls._pair is None:
                cls._pair = [mmap.mmap(-1, CHUNK_BYTES) for _ in range(2)]
            return cls._pair


def write_chunk(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` of the file (one module-level function, so that a
    test can stand in for the disk)."""
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


class DirectFileWriter:
    """A binary file opened for writing through ``O_DIRECT`` where allowed, with the CRC-32
    and length of what went in ([Note: checkpoint writes at disk speed]).

    Only one writer may be open in a process at a time (they share the chunk buffers):
    saves are serialized by the checkpoint code.
    """

    def __init__(self, path: Path) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = bool(_O_DIRECT)
        try:
            self._fd = os.open(path, flags | _O_DIRECT, 0o644)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            self._fd = os.open(path, flags, 0o644)
            self.direct = False
        self.crc32 = 0
        self.nbytes = 0
        self._buffers = _ChunkBuffers.pair()
        self._filling = 0  # index of the buffer being filled
        self._used = 0  # bytes in it
        self._submitted = 0  # bytes handed to the writing thread: the next chunk's offset
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-write")
        self._in_flight: Future | None = None

    # ---- the file-like face torch.save writes to -----------------------------------------
    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc32 = zlib.crc32(view, self.crc32)
        self.nbytes += view.nbytes
        total = view.nbytes
        while view.nbytes:
            room = CHUNK_BYTES - self._used
            take = min(room, view.nbytes)
            buffer = self._buffers[self._filling]
            buffer[self._used : self._used + take] = view[:take]
            self._used += take
            view = view[take:]
            if self._used == CHUNK_BYTES:
                self._submit(CHUNK_BYTES)
        return total

    def flush(self) -> None:
        """Nothing to do: data reaches the disk in whole chunks, and at ``close``."""

    # ---- chunks ---------------------------------------------------------------------------
    def _submit(self, length: int) -> None:
        """Hand the full buffer to the writing thread and go on filling the other one."""
        self._wait_in_flight()
        buffer = memoryview(self._buffers[self._filling])[:length]
        self._in_flight = self._executor.submit(self._write, buffer, self._submitted)
        self._submitted += length
        self._filling ^= 1
        self._used = 0

    def _wait_in_flight(self) -> None:
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            in_flight.result()  # re-raises the thread's OSError (ENOSPC, EIO) here

    def _write(self, view: memoryview, offset: int) -> None:
        try:
            write_chunk(self._fd, view, offset)
        except OSError as error:
            if not (self.direct and error.errno == errno.EINVAL):
                raise
            # Opened with O_DIRECT, refused at the write (some FUSE and network mounts):
            # the same chunk again, through the page cache.
            fcntl.fcntl(self._fd, fcntl.F_SETFL,
                        fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
            self.direct = False
            write_chunk(self._fd, view, offset)

    def close(self) -> None:
        """Write what is left, make the file durable (fsync) and close it; on an error the
        file is closed and the error raised."""
        try:
            tail = self._used
            if tail:
                padded = tail
                if self.direct:
                    padded = -(-tail // ALIGNMENT) * ALIGNMENT
                    self._buffers[self._filling][tail:padded] = bytes(padded - tail)
                self._wait_in_flight()
                self._write(memoryview(self._buffers[self._filling])[:padded], self._submitted)
                if padded != tail:
                    os.ftruncate(self._fd, self.nbytes)
            self._wait_in_flight()
            os.fsync(self._fd)
        finally:
            self._used = 0
            self._executor.shutdown(wait=True)
            os.close(self._fd)

    def abort(self) -> None:
        """Close without making anything durable (the save failed elsewhere)."""
        try:
            self._wait_in_flight()
        except OSError:
            pass
        finally:
            self._executor.shutdown(wait=True)
            os.close(self._fd)


def save_to_file(state: dict, path: Path) -> tuple[int, int]:
    """``torch.save(state, path)`` at the disk's speed; returns (crc32, bytes) of the file as
    written ([Note: checkpoint checksums])."""
    writer = DirectFileWriter(path)
    try:
        torch.save(state, writer)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    return writer.crc32, writer.nbytes


def file_checksum(path: Path) -> tuple[int, int]:
    """(crc32, bytes) of a file, read once through the page cache (the load that follows
    finds it there), ``READ_AHEAD`` chunks in flight so the disk always has requests queued;
    the CRC runs over them in order."""
    size = os.path.getsize(path)
    offsets = range(0, size, READ_CHUNK_BYTES)
    crc = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        with ThreadPoolExecutor(max_workers=READ_AHEAD, thread_name_prefix="ckpt-read") as pool:
            chunks = [pool.submit(os.pread, fd, READ_CHUNK_BYTES, offset)
                      for offset in offsets[:READ_AHEAD]]
            for index in range(len(offsets)):
                data = chunks[index].result()
                chunks[index] = None  # read and checked: its memory goes
                if index + READ_AHEAD < len(offsets):
                    chunks.append(pool.submit(os.pread, fd, READ_CHUNK_BYTES,
                                              offsets[index + READ_AHEAD]))
                crc = zlib.crc32(data, crc)
    finally:
        os.close(fd)
    return crc, size


def read_chunk(fd: int, view: memoryview, offset: int) -> int:
    """Read into all of ``view`` from ``offset`` of the file, or up to its end; returns the
    bytes read (one module-level function, so that a test can stand in for the disk)."""
    done = 0
    while done < view.nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


class FileInMemory:
    """A file read whole into memory at the disk's speed, with the CRC-32 and length of its
    bytes ([Note: checkpoint loads at disk speed]). ``load`` deserializes it (once) and frees
    this object's hold on the memory; ``close`` frees it unread."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.crc32 = 0
        self.nbytes = 0
        self._memfd: int | None = os.memfd_create("zeropp-checkpoint", os.MFD_CLOEXEC)
        try:
            self._read(path)
        except BaseException:
            self.close()
            raise

    def _read(self, path: Path) -> None:
        self.direct = bool(_O_DIRECT)
        try:
            fd = os.open(path, os.O_RDONLY | _O_DIRECT)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            fd = os.open(path, os.O_RDONLY)
            self.direct = False
        try:
            size = os.fstat(fd).st_size
            # Direct reads need whole aligned blocks in memory too: room up to the alignment.
            padded = -(-size // ALIGNMENT) * ALIGNMENT
            os.ftruncate(self._memfd, padded)
            if padded:
                self.nbytes = self._read_and_check(fd, size, padded)
            os.ftruncate(self._memfd, self.nbytes)  # exactly the file: torch reads its end
        finally:
            os.close(fd)

    def _read_and_check(self, fd: int, size: int, padded: int) -> int:
        """Read the file into the memfd, ``READ_AHEAD`` chunks in flight, running the CRC
        over the chunks in order as they arrive; returns the bytes read."""
        memory = mmap.mmap(self._memfd, padded)
        view = memoryview(memory)
        offsets = range(0, padded, READ_CHUNK_BYTES)
        crc, total = 0, 0
        try:
            with ThreadPoolExecutor(max_workers=READ_AHEAD,
                                    thread_name_prefix="ckpt-read") as pool:
                def submit(offset: int) -> Future:
                    chunk = view[offset : offset + READ_CHUNK_BYTES]
                    return pool.submit(self._read_chunk, fd, chunk, offset)

                chunks = [submit(offset) for offset in offsets[:READ_AHEAD]]
                for index, offset in enumerate(offsets):
                    got = chunks[index].result()
                    chunks[index] = None
                    if index + READ_AHEAD < len(offsets):
                        chunks.append(submit(offsets[index + READ_AHEAD]))
                    got = min(got, size - offset)  # a file that shrank reads short
                    if got <= 0:
                        break
                    crc = zlib.crc32(view[offset : offset + got], crc)
                    total = offset + got
                    if got < min(READ_CHUNK_BYTES, size - offset):
                        break  # the file ended early: what is here is all it holds
                for pending in chunks:  # stopped early: let the readers finish first
                    if pending is not None:
                        pending.result()
        finally:
            view.release()
            try:
                memory.close()
            except BufferError:  # a reader's error holds its chunk: unmapped when it goes
                pass
        self.crc32 = crc
        return total

    def _read_chunk(self, fd: int, view: memoryview, offset: int) -> int:
        try:
            return read_chunk(fd, view, offset)
        except OSError as error:
            if not (self.direct and error.errno == errno.EINVAL):
                raise
            # Opened with O_DIRECT, refused at the read (some FUSE and network mounts, or a
            # short read that left an unaligned offset): the same chunk through the page cache.
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_O_DIRECT)
            self.direct = False
            return read_chunk(fd, view, offset)

    def load(self) -> dict:
        """``torch.load`` of the bytes read, tensors mapping that memory (no copy); the
        memory goes when the last of them does."""
        if self._memfd is None:
            raise ValueError(f"{self.path}: its bytes in memory were already loaded or freed")
        try:
            return torch.load(f"/proc/self/fd/{self._memfd}", map_location="cpu",
                              weights_only=True, mmap=True)
        finally:
            self.close()

    def close(self) -> None:
        if self._memfd is not None:
            os.close(self._memfd)
            self._memfd = None
