"""Decode processes: streams decoded outside the server's interpreter lock.

The server's side (:class:`DecodeHub`, :class:`RemoteReader`). A stream's decode thread spends
most of its time in FFmpeg, which runs without Python's interpreter lock, but it takes the lock
back several times a frame (demux, decode, convert), and beside busy Python threads (engine
workers, analytics, the event loop) each time waits for it: on an H200 machine 32 decode
threads in the server process reached 1458 frames/s with 6.3 of 16 cores busy while the GPU
engine took 2966 (``benchmarks/results/2026-12-01-nvidia-h200-gpu.json``;
``benchmarks/gil_bench.py`` shows the hand-over cost on its own).

With ``decode_processes`` above 0 the server starts that many child processes (``python -m
streams.decode_child``, that module) and spreads its streams over them. A child runs the same
:class:`~streams.reader.StreamReader` loop for each of its streams (open, reconnect with
backoff, keyframe-only decode, file pacing, ``max_fps`` sampling, motion gating) and writes
each sampled frame as RGB into a ring of slots in shared memory that it made for the stream.
The server process maps the ring, and a frame's array is a view of its slot, not a copy; the
slot goes back to the child when the last reference to the array is gone (the engine has run
and every viewer has had it). Where more than half of a stream's slots are taken (something
keeps its frames), the server copies frames out instead, so keeping frames costs copies, not
frames; a frame that finds every slot taken all the same (the server is not reading) is dropped
and counted, like any frame the engines could not take in time.

A stream's event clips are written in its process too (the recorder keeps the packets it
demuxes there): the server plans each event's clip with a :class:`~streams.clips.ClipPlanner`,
so the event names its clip at once, and the process's recorder takes the plan. Streams
decoded by NVDEC (frames already on the GPU) decode in the server process.

Messages (pickled tuples, one pipe each way per child):

- server to child: ``("init", options, slots, shm_dir, log_level, clip_options)``, ``("open",
  key, config)``, ``("set", key, max_fps, detect)``, ``("clip", key, clip_id, start, end,
  limit, event_id)``, ``("stop", key)``, ``("quit",)``;
- child to server: ``("ring", key, gen, path, slots, height, width, source)`` (frames of
  ``width`` x ``height``, scaled from the camera's ``source`` width and height), ``("frame",
  key, gen, slot, pts, decoded_mono, deltas)`` (``deltas``: the counters' increments since
  the last report, counted before the frame is offered), ``("state", key, state, error)``,
  ``("counts", key, deltas, latest)``, ``("clip-done", key, clip_id, path, error)``,
  ``("exited", key)``.

A child whose server goes away (its pipe closes) stops its streams and exits; a child that
dies is started again and its streams reopen on it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import mmap
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from engines.batching import PoolClosed
from engines.types import Image
from streams.clips import ENDED_KEPT, ClipDone, ClipOptions, ClipPlanner, ClipRecorder
from streams.decode_child import (
    HEADER,
    MAX_SLOTS,
    REPORT_S,
    ring_prefix,
    shm_dir,
    shm_warning,
)
from streams.detect import StreamDetect
from streams.jobs import JobCancelled, JobError, JobProgress, JobSpec
from streams.reader import (
    FrameSink,
    PublishFn,
    ReaderOptions,
    StateFn,
    StreamConfig,
    StreamReader,
    StreamState,
)

log = logging.getLogger(__name__)

STALE_S = 5 * REPORT_S
"""A rate not reported for this long is no longer shown."""
QUICK_EXIT_S = 2.0
"""A child that dies sooner than this after starting is not started again (it would again)."""


JOB_POLL_S = 0.25
"""How often a job waiting for its next frame looks at its cancel flag."""


def _progress(progress: JobProgress, counts: Sequence[Any]) -> None:
    """A decode process's progress of a job (frames read, decode errors, position, gaps,
    duration) into the job's."""
    if counts:
        read, errors, position, gaps, duration = counts
        progress.frames_read, progress.decode_errors, progress.position_s = read, errors, position
        progress.gaps_s = gaps
        if duration is not None:
            progress.duration_s = duration


def remove_rings_of(pid: int) -> None:
    """Remove the ring files the exited decode process ``pid`` left (made, but killed before
    the server mapped them: during ``posix_fallocate``, or with its "ring" message unread)."""
    directory = Path(shm_dir())
    for leftover in directory.glob(ring_prefix(pid) + "*"):
        with contextlib.suppress(OSError):
            leftover.unlink()


class _Mapped:
    """A ring the server mapped: frames are views of its slots."""

    def __init__(
        self, gen: int, path: str, slots: int, height: int, width: int, *, source: tuple[int, int]
    ) -> None:
        self.gen, self.slots, self.height, self.width = gen, slots, height, width
        self.source = source
        self.slot_bytes = height * width * 3
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, HEADER + slots * self.slot_bytes)
        finally:
            os.close(fd)
        os.unlink(path)  # both sides have it mapped: gone with the last of them, crash or not
        self._refs: list[weakref.ref[np.ndarray[Any, Any]] | None] = [None] * slots

    def frame(self, slot: int) -> tuple[Image, bool]:
        """Slot ``slot`` as an image: a view of it, free again once no array refers to it; or,
        where more than half the slots are taken (someone keeps frames: a viewer's queue, a
        test's list), a copy, and the slot is free at once, so a consumer that keeps frames
        costs copies, never the stream's frames. Returns the image and whether it is a copy."""
        if self.mm[: self.slots].count(1) > self.slots // 2:
            return self.copy(slot), True
        flat = np.frombuffer(self.mm, np.uint8, self.slot_bytes, HEADER + slot * self.slot_bytes)
        # A bare weak reference kept per slot (weakref.finalize costs several times more, for
        # guarantees at exit a slot does not need); its callback frees the slot.
        self._refs[slot] = weakref.ref(flat, functools.partial(_free, self.mm, slot))
        return flat.reshape(self.height, self.width, 3), False

    def free(self, slot: int) -> None:
        _free(self.mm, slot)

    def copy(self, slot: int) -> Image:
        """Slot ``slot`` as an image of its own; the slot is free again at once."""
        flat = np.frombuffer(self.mm, np.uint8, self.slot_bytes, HEADER + slot * self.slot_bytes)
        image = flat.reshape(self.height, self.width, 3).copy()
        _free(self.mm, slot)
        return image


def _free(mm: mmap.mmap, slot: int, _: object = None) -> None:
    with contextlib.suppress(ValueError):  # closed
        mm[slot] = 0


_LENGTH = struct.Struct("!i")
_LONG_LENGTH = struct.Struct("!Q")


class _Inbox:
    """The messages waiting on a process's event pipe, all taken with one read.

    ``Connection.recv`` takes one message per call, through several Python layers and two
    reads; a frame's message is a few dozen bytes, so one read here takes every message
    waiting. The framing is ``Connection.send``'s: a 4-byte big-endian length (-1, then 8
    bytes, for a message over 2 GiB), then the pickle.
    """

    def __init__(self, conn: Connection) -> None:
        self.fd = conn.fileno()
        os.set_blocking(self.fd, False)
        self._buf = bytearray()

    def read(self) -> list[bytearray]:
        """The whole messages that arrived, pickled (none when nothing did).

        Raises:
            EOFError: the process closed its end (it exited).
        """
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        if not chunk:
            raise EOFError("decode process closed its pipe")
        buf = self._buf
        buf += chunk
        messages: list[bytearray] = []
        pos = 0
        while len(buf) - pos >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(buf, pos)
            head = _LENGTH.size
            if size == -1:
                if len(buf) - pos < head + _LONG_LENGTH.size:
                    break
                (size,) = _LONG_LENGTH.unpack_from(buf, pos + head)
                head += _LONG_LENGTH.size
            if len(buf) - pos - head < size:
                break
            messages.append(buf[pos + head : pos + head + size])
            pos += head + size
        del buf[:pos]
        return messages


@dataclass(eq=False)
class _Proc:
    index: int
    popen: subprocess.Popen[bytes]
    commands: Connection
    events: Connection
    started: float
    readers: dict[str, RemoteReader] = field(default_factory=dict)
    jobs: dict[str, queue.SimpleQueue[tuple[Any, ...]]] = field(default_factory=dict)
    rings: dict[str, _Mapped] = field(default_factory=dict)
    send_lock: threading.Lock = field(default_factory=threading.Lock)


class DecodeHub:
    """The server's decode processes: starts them (at the first stream), gives each stream
    to the one with the fewest, and hands what they send to the streams' readers on one
    receiving thread.

    Args:
        processes: how many.
        options: every stream's reader options.
        slots: frames of one stream the server may hold at once (waiting for an engine, in
            a batch, with viewers) without copies.
        clips: where streams' event clips go (``None``: no clips).
    """

    def __init__(
        self,
        processes: int,
        options: ReaderOptions,
        slots: int = 8,
        clips: ClipOptions | None = None,
    ) -> None:
        if not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots must be 1..{MAX_SLOTS}, not {slots}")
        self._n = processes
        self._opt = options
        self._slots = slots
        self._clips = clips
        self._procs: list[_Proc | None] = [None] * processes
        self._lock = threading.Lock()
        self._keys = itertools.count(1)
        self._closed = False
        self._changes = 0  # bumped when a process starts or ends (the receiving thread looks)
        self._wake_r, self._wake_w = Pipe(duplex=False)
        self._thread: threading.Thread | None = None
        self._shm_checked = False
        self.exits = 0
        """Processes that died (or closed their pipe) while the hub was open."""

    # ---- streams ---------------------------------------------------------------------------
    def reader(
        self,
        config: StreamConfig,
        submit: FrameSink,
        publish: PublishFn,
        *,
        on_state: StateFn | None = None,
        on_clip_done: ClipDone | None = None,
    ) -> RemoteReader:
        """A reader for ``config`` that decodes in one of the processes once started;
        ``on_clip_done`` is told of each of its event clips (from the receiving thread)."""
        key = f"{config.id}#{next(self._keys)}"
        reader = RemoteReader(
            self, key, config, options=self._opt, submit=submit, publish=publish, on_state=on_state
        )
        if self._clips is not None:
            reader.plan_clips(self._clips, on_clip_done)
        return reader

    def open(self, reader: RemoteReader) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("decode processes are shut down")
            if not reader.stopping:
                proc = self._least_busy()
                proc.readers[reader.key] = reader
                # Sent with the lock held: a stop (which finds the process under it) can
                # only follow it, never overtake it and leave the stream opened.
                self._send(proc, ("open", reader.key, reader.remote_config()))
                return
        # Stopped before it could open (while its process was being started again): a stop
        # that found no process sent nothing, so it must not open now.
        reader.remote_exited()

    # ---- video jobs ------------------------------------------------------------------------
    def job_frames(
        self, spec: JobSpec, progress: JobProgress, stopped: Callable[[], None], max_side: int
    ) -> Generator[tuple[int, float, Image, tuple[int, int]], None, None]:
        """A video job's frames decoded in the process with the fewest streams and jobs
        (:class:`streams.decode_child._ChildJob`: it waits for slots, so no frame is lost),
        as :func:`streams.jobs.local_frames` gives them; ``progress`` follows the process's.

        Raises:
            JobError: the video cannot be read, or its decode process died.
            JobCancelled: from ``stopped``, or the hub shut down (interrupted).
        """
        key = f"job#{next(self._keys)}"
        inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        with self._lock:
            if self._closed:
                raise JobCancelled(interrupted=True)
            proc = self._least_busy()
            proc.jobs[key] = inbox
        self._send(proc, ("job", key, spec, max_side))
        ended = False
        try:
            while True:
                stopped()
                try:
                    item = inbox.get(timeout=JOB_POLL_S)
                except queue.Empty:
                    continue
                if item[0] == "frame":
                    _, index, t, ring, slot, counts = item
                    _progress(progress, counts)
                    # Copied out as the job takes it, its slot free at once: the ring's slots
                    # bound what the process decodes ahead of the job, whatever the job
                    # holds (its frames in flight can outnumber the slots).
                    yield index, t, ring.copy(slot), ring.source
                    continue
                if item[0] == "end":  # the process's job has ended
                    ended = True
                    _progress(progress, item[2])
                    if item[1] is not None:
                        raise JobError(item[1])
                    return
                if item[0] == "interrupted":
                    raise JobCancelled(interrupted=True)
                raise JobError(item[1])  # "failed" here, or "lost" with its process
        finally:
            with self._lock:
                proc.jobs.pop(key, None)
            if not ended:
                with contextlib.suppress(OSError):
                    self._send(proc, ("job-stop", key))

    def update(self, reader: RemoteReader) -> None:
        if (proc := self._proc_of(reader)) is not None:
            self._send(proc, ("set", reader.key, reader.max_fps, reader.detect))

    def reserve_clip(self, reader: RemoteReader, *plan: float | int) -> None:
        if (proc := self._proc_of(reader)) is not None:
            self._send(proc, ("clip", reader.key, *plan))

    def close(self, reader: RemoteReader) -> None:
        if (proc := self._proc_of(reader)) is not None:
            self._send(proc, ("stop", reader.key))

    def process_of(self, reader: RemoteReader) -> int | None:
        proc = self._proc_of(reader)
        return None if proc is None else proc.index

    def pids(self) -> list[int]:
        """The processes' ids (those started)."""
        with self._lock:
            return [p.popen.pid for p in self._procs if p is not None]

    def stats(self) -> tuple[int, int]:
        """Processes running now, and how many have died since the hub started."""
        with self._lock:
            return sum(p is not None for p in self._procs), self.exits

    def shutdown(self, timeout_s: float) -> None:
        """Ask every process to stop its streams and exit; kill what has not after
        ``timeout_s``."""
        with self._lock:
            self._closed = True
            procs = [p for p in self._procs if p is not None]
        for proc in procs:
            with contextlib.suppress(OSError):
                self._send(proc, ("quit",))
        end = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.popen.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("decode process %d did not exit: killed", proc.popen.pid)
                proc.popen.kill()
                proc.popen.wait()
        for proc in procs:
            remove_rings_of(proc.popen.pid)
        with self._lock:
            left = [r for p in procs for r in p.readers.values()]
            jobs = [j for p in procs for j in p.jobs.values()]
            self._procs = [None] * self._n
            self._changes += 1
        for reader in left:
            reader.remote_exited()
        for job in jobs:
            job.put(("interrupted",))
        self._wake()
        if self._thread is not None:
            self._thread.join(2.0)

    # ---- processes -------------------------------------------------------------------------
    def _ensure_thread(self) -> None:
        """The receiving thread, started at the first stream or job (``self._lock`` held)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._receive, name="decode-hub", daemon=True)
            self._thread.start()

    def _least_busy(self) -> _Proc:
        """The process with the fewest streams and jobs, started if it is not running, and
        the receiving thread (``self._lock`` held)."""
        self._ensure_thread()
        index = min(
            range(self._n),
            key=lambda i: -1 if (p := self._procs[i]) is None else len(p.readers) + len(p.jobs),
        )
        return self._procs[index] or self._start(index)

    def _start(self, index: int) -> _Proc:
        """Start process ``index`` (with ``self._lock`` held)."""
        cmd_r, cmd_w = Pipe(duplex=False)
        evt_r, evt_w = Pipe(duplex=False)
        try:
            popen = self._popen(cmd_r, evt_w)
        except OSError:
            for end in (cmd_r, cmd_w, evt_r, evt_w):
                end.close()
            raise
        cmd_r.close()
        evt_w.close()
        level = logging.getLogger().getEffectiveLevel()
        directory = shm_dir()
        if not self._shm_checked:
            self._shm_checked = True
            if warning := shm_warning(directory, self._slots, self._opt.decode_max_side):
                log.warning("decode processes: %s", warning)
        cmd_w.send(("init", self._opt, self._slots, directory, level, self._clips))
        proc = _Proc(index, popen, cmd_w, evt_r, time.monotonic())
        self._procs[index] = proc
        self._changes += 1
        log.info("decode process %d started (pid %d)", index, popen.pid)
        self._wake()
        return proc

    @staticmethod
    def _popen(cmd_r: Connection, evt_w: Connection) -> subprocess.Popen[bytes]:
        """A decode process on the pipe ends ``cmd_r`` (its commands) and ``evt_w`` (its
        messages)."""
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "streams.decode_child",
                "--cmd-fd",
                str(cmd_r.fileno()),
                "--evt-fd",
                str(evt_w.fileno()),
            ],
            pass_fds=(cmd_r.fileno(), evt_w.fileno()),
            env=env,
            stdin=subprocess.DEVNULL,
        )

    def _send(self, proc: _Proc, message: tuple[Any, ...]) -> None:
        try:
            with proc.send_lock:
                proc.commands.send(message)
        except OSError as exc:  # it died: the receiving thread restarts it
            log.warning("decode process %d: cannot send %s: %s", proc.index, message[0], exc)

    def _proc_of(self, reader: RemoteReader) -> _Proc | None:
        with self._lock:
            for proc in self._procs:
                if proc is not None and reader.key in proc.readers:
                    return proc
        return None

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w.fileno(), b"x")

    def _receive(self) -> None:
        """The receiving thread: every message waiting on each ready pipe per turn (one read
        each, :class:`_Inbox`), from one epoll set kept across turns."""
        poller = select.epoll()
        wake_fd = self._wake_r.fileno()
        poller.register(wake_fd, select.EPOLLIN)
        watched: dict[int, tuple[_Proc, _Inbox]] = {}
        seen = -1
        try:
            while True:
                if seen != self._changes:  # a process started or ended
                    with self._lock:
                        seen = self._changes
                        if self._closed and all(p is None for p in self._procs):
                            return
                        live = {p.events.fileno(): p for p in self._procs if p is not None}
                    for fd, (gone, _) in list(watched.items()):
                        if live.get(fd) is not gone:
                            poller.unregister(fd)
                            del watched[fd]
                            gone.events.close()
                            with gone.send_lock:  # not while a send is writing to it
                                gone.commands.close()
                    for fd, proc in live.items():
                        if fd not in watched:
                            watched[fd] = (proc, _Inbox(proc.events))
                            poller.register(fd, select.EPOLLIN)
                for fd, _ in poller.poll(1.0):
                    if fd == wake_fd:
                        os.read(wake_fd, 4096)
                        continue
                    if (entry := watched.get(fd)) is None:
                        continue
                    proc, inbox = entry
                    try:
                        messages = inbox.read()
                    except (EOFError, OSError):
                        try:
                            self._lost(proc)
                        except Exception:  # this thread reads every process: it goes on
                            log.exception("decode process %d: handling its exit", proc.index)
                        continue
                    for message in messages:
                        try:
                            # Our own child's pipe, as Connection.recv would unpickle it.
                            self._dispatch(proc, pickle.loads(message))  # noqa: S301
                        except Exception:
                            log.exception("decode process %d: bad message", proc.index)
        finally:
            poller.close()

    def _dispatch(self, proc: _Proc, message: tuple[Any, ...]) -> None:
        kind, key = message[0], message[1]
        reader = proc.readers.get(key)
        if kind == "job-frame":
            _, _, gen, slot, index, t, *counts = message
            ring, job = proc.rings.get(key), proc.jobs.get(key)
            if ring is None or ring.gen != gen:  # not mapped: the job was told, and ended
                return
            if job is None:  # the job stopped taking frames
                ring.free(slot)
                return
            job.put(("frame", index, t, ring, slot, counts))
        elif kind == "job-end":
            proc.rings.pop(key, None)
            if (job := proc.jobs.get(key)) is not None:
                job.put(("end", message[2], message[3:]))
        elif kind == "frame":
            _, _, gen, slot, pts, decoded_mono, deltas = message
            if reader is not None:  # counted in before it is offered (and maybe processed)
                reader.remote_counts(deltas, None)
            ring = proc.rings.get(key)
            if ring is None or ring.gen != gen:  # its ring could not be mapped: counted
                if reader is not None:
                    reader.count_drop()
                return
            if reader is None or reader.stopping:
                ring.free(slot)
                if reader is not None:  # counted in above: it ends as a drop (its heir's)
                    reader.count_drop()
                return
            image, copied = ring.frame(slot)
            reader.remote_frame(image, pts, decoded_mono, ring.source, copied=copied)
        elif kind == "ring":
            _, _, gen, path, slots, height, width, source = message
            try:
                proc.rings[key] = _Mapped(gen, path, slots, height, width, source=source)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(path)  # the server's to unlink, mapped or not
                log.warning("stream %s: cannot map its frames: %s", key, exc)
                proc.rings.pop(key, None)
                if reader is not None:
                    reader.remote_state(reader.state, f"cannot map its frames: {exc}")
                if (job := proc.jobs.get(key)) is not None:
                    job.put(("failed", f"cannot map its frames: {exc}"))
        elif kind == "counts" and reader is not None:
            reader.remote_counts(message[2], message[3])
        elif kind == "state" and reader is not None:
            reader.remote_state(StreamState(message[2]), message[3])
        elif kind == "clip-done" and reader is not None:
            _, _, clip_id, path, error = message
            reader.remote_clip_done(clip_id, None if path is None else Path(path), error)
        elif kind == "exited":
            proc.rings.pop(key, None)
            with self._lock:
                proc.readers.pop(key, None)
            if reader is not None:
                reader.remote_exited()

    def _lost(self, proc: _Proc) -> None:
        """Process ``proc`` died (or closed its pipe): start it again and reopen its streams
        there, unless it died at once or the hub is shutting down."""
        code = proc.popen.poll()
        if code is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.popen.wait(1.0)
        with self._lock:
            readers = [r for r in proc.readers.values() if not r.stopping]
            stopped = [r for r in proc.readers.values() if r.stopping]
            jobs = list(proc.jobs.values())
            proc.readers.clear()
            proc.jobs.clear()
            proc.rings.clear()
            if self._procs[proc.index] is proc:
                self._procs[proc.index] = None
            self._changes += 1
            quick = time.monotonic() - proc.started < QUICK_EXIT_S
            closed = self._closed
            if not closed:
                self.exits += 1
        remove_rings_of(proc.popen.pid)  # those it made and the server never mapped
        why = f"decode process {proc.index} (pid {proc.popen.pid}) exited with code {code}"
        for job in jobs:
            job.put(("interrupted",) if closed else ("lost", f"{why}: run the job again"))
        for reader in [*readers, *stopped]:
            reader.remote_lost(why)
        for reader in stopped:
            reader.remote_exited()
        if closed:
            for reader in readers:
                reader.remote_exited()
            return
        if quick:
            log.error("%s right after it started: not starting it again", why)
            for reader in readers:
                reader.remote_state(
                    StreamState.FAILED,
                    f"{why} right after it started (its log says why); setting"
                    " STREAMDET_DECODE_PROCESSES=0 decodes in the server process",
                )
                reader.remote_exited()
            return
        log.error("%s: starting it again for its %d streams", why, len(readers))
        for reader in readers:
            reader.remote_state(StreamState.RECONNECTING, f"{why}; started again", lost=True)
            try:
                self.open(reader)
            except RuntimeError:  # shut down meanwhile
                reader.remote_exited()
            except Exception as exc:  # e.g. no process can start (EAGAIN, ENOMEM, EMFILE)
                log.error("stream %s: cannot start a decode process: %s", reader.key, exc)
                reader.remote_state(StreamState.FAILED, f"{why}; starting it again failed: {exc}")
                reader.remote_exited()


class RemoteReader(StreamReader):
    """The server's side of a stream decoded in a decode process: the same counts, state,
    analytics and publishing as a :class:`StreamReader`, with frames, states and the input
    counters coming from the process."""

    def __init__(
        self,
        hub: DecodeHub,
        key: str,
        config: StreamConfig,
        *,
        options: ReaderOptions,
        submit: FrameSink,
        publish: PublishFn,
        on_state: StateFn | None = None,
    ) -> None:
        self._hub = hub
        self.key = key
        self._started = False
        self._exited = threading.Event()
        self._remote_fps_in = 0.0
        self._remote_at = 0.0  # when the process last reported
        self._remote_motion_area = 0.0
        self._process_lost = False  # its process died: live again is a reconnect
        self._planner: ClipPlanner | None = None
        self._on_clip_done: ClipDone | None = None
        self._clips_open: set[int] = set()  # reserved, not yet written or failed
        self._clips_ended: deque[int] = deque(maxlen=ENDED_KEPT)  # written or failed
        super().__init__(config, options, submit, publish, on_state=on_state)

    def plan_clips(self, options: ClipOptions, on_done: ClipDone | None) -> None:
        """Keep event clips (written by the process's recorder)."""
        self._planner = ClipPlanner(options, self._reserve_clip)
        self._on_clip_done = on_done

    def _reserve_clip(
        self, clip_id: int, start: float, end: float, limit: float, event: int
    ) -> None:
        with self._lock:
            # A plan made just before the clip-done came (the recorder drops it) is not open.
            if clip_id not in self._clips_ended:
                self._clips_open.add(clip_id)
        self._hub.reserve_clip(self, clip_id, start, end, limit, event)

    @property
    def clip_requests(self) -> ClipRecorder | ClipPlanner | None:
        return self._planner

    # detect and max_fps are read by the process's thread: changes are sent there.
    @property
    def detect(self) -> StreamDetect:
        return self._detect

    @detect.setter
    def detect(self, detect: StreamDetect) -> None:
        self._detect = detect
        if self._started:
            self._hub.update(self)

    @property
    def max_fps(self) -> float | None:
        return self._max_fps

    @max_fps.setter
    def max_fps(self, max_fps: float | None) -> None:
        self._max_fps = max_fps
        if self._started:
            self._hub.update(self)

    def remote_config(self) -> StreamConfig:
        """What the process opens: the stream as it is now."""
        return StreamConfig(
            self.config.id, self.config.spec, self.config.name, self.max_fps, self.detect
        )

    def start(self) -> None:
        self._started = True
        self._hub.open(self)

    def stop(self) -> None:
        self._stop.set()
        if self._started and not self._exited.is_set():
            self._hub.close(self)

    def join(self, timeout_s: float) -> bool:
        return not self._started or self._exited.wait(timeout_s)

    @property
    def alive(self) -> bool:
        return self._started and not self._exited.is_set()

    @property
    def waiting_on_source(self) -> bool:
        """Whether it still runs in its process after the server's short wait: all but
        always in FFmpeg's open of a silent camera or read of a frozen one, which no close
        interrupts. Let go of as a thread is (DELETE, a disable or a new source waited up to
        the whole open or read timeout); its process's late messages still reach it under
        its own key, and its late counts go on in the stream's next reader (its heir)."""
        return self.alive

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def snapshot(self) -> dict[str, Any]:
        snap = super().snapshot()
        with self._lock:  # a rate the process stopped reporting (its stream ended) is none
            fresh = time.monotonic() - self._remote_at < STALE_S
            snap["fps_in"] = round(self._remote_fps_in, 2) if fresh else 0.0
        if self.detect.motion:
            snap["motion_area"] = round(self._remote_motion_area, 4)
        snap["decode_process"] = self._hub.process_of(self)
        return snap

    # ---- from the hub's receiving thread ---------------------------------------------------
    def remote_frame(
        self,
        image: Image,
        pts: float | None,
        decoded_mono: float,
        source: tuple[int, int],
        *,
        copied: bool,
    ) -> None:
        if copied:
            with self._lock:
                self.copied += 1
        try:
            self._offer(image, pts, decoded_mono, source)
        except PoolClosed:  # the server is stopping: so is the stream
            self.stop()

    def remote_state(self, state: StreamState, error: str | None, *, lost: bool = False) -> None:
        """The stream's state as its process says it (``lost``: as the hub says it, its
        process having died). Live again after its process died is one reconnect, as after
        its camera dropped: the new process's reader knew nothing of the loss, and
        ``reconnects`` did not count it."""
        with self._lock:
            if lost:
                self._process_lost = True
            elif state is StreamState.LIVE and self._process_lost:
                self.reconnects += 1
            if state is not StreamState.RECONNECTING and state is not StreamState.CONNECTING:
                self._process_lost = False
        self._set_state(state, error)

    def remote_counts(self, deltas: dict[str, int], latest: tuple[Any, ...] | None) -> None:
        """The process's increments of its counters, and (``latest``: its timer's reports,
        not a frame's) its size, rate and last frame's time. Those that come once the stream
        went on in another reader (:meth:`carry_over`) are added to its counters."""
        if not self._add_counts(deltas) or latest is None:
            return
        with self._lock:
            self._remote_at = time.monotonic()
            (
                self.width,
                self.height,
                self.keyframes_only,
                self._remote_fps_in,
                self._last_frame_mono,
                self._remote_motion_area,
            ) = latest

    def remote_clip_done(self, clip_id: int, path: Path | None, error: str | None) -> None:
        """The process's recorder wrote or gave up on a clip, maybe before its planned end (a
        source lost or reopened, a file looped): the planner hears of it first, so the next
        event starts a new clip instead of naming this one."""
        with self._lock:
            self._clips_open.discard(clip_id)
            self._clips_ended.append(clip_id)
        if self._planner is not None:
            self._planner.ended(clip_id)
        if self._on_clip_done is not None:
            self._on_clip_done(clip_id, path, error)

    def remote_lost(self, why: str) -> None:
        """Its process died: the clips it was making fail (said so) and what it had written
        of them is deleted (it stayed until the next start, outside --event-clips-max-mb);
        the next event starts a new clip."""
        if self._planner is None:
            return
        self._planner.forget()
        with self._lock:
            lost, self._clips_open = self._clips_open, set()
        for clip_id in sorted(lost):
            for part in self._planner.options.parts(clip_id):
                part.unlink(missing_ok=True)
            self.remote_clip_done(clip_id, None, f"{why} while it was being made")

    def remote_exited(self) -> None:
        if not self._exited.is_set():
            if self.state not in (StreamState.FAILED, StreamState.STOPPED):
                self._set_state(StreamState.STOPPED)
            self._exited.set()
