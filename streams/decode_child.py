"""A decode process (``python -m streams.decode_child``, started by
:class:`streams.decode_procs.DecodeHub`): its streams' readers, and their frames written into
rings of shared memory.

Each stream runs the same :class:`~streams.reader.StreamReader` loop as in the server (open,
reconnect with backoff, keyframe-only decode, file pacing, ``max_fps``, motion gating); a
sampled frame goes as RGB into a free slot of the stream's ring, a file in ``/dev/shm`` with one
busy flag per slot (the server clears it when it is done with the frame), and a message names
the slot. Event clips are written here (the recorder has the packets), as the server planned
them. What the messages are: :mod:`streams.decode_procs`. This module imports neither torch
nor the server.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import itertools
import logging
import mmap
import os
import signal
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import cv2
import numpy as np

from engines.batching import WorkItem
from streams.clips import ClipOptions, ClipRecorder
from streams.fanout import ProcessedFrame
from streams.frames import decoded_size, frame_rgb
from streams.jobs import (
    JOB_NICE,
    JobCancelled,
    JobError,
    JobProgress,
    JobSpec,
    lower_priority,
    sampled_frames,
)
from streams.reader import ReaderOptions, StreamConfig, StreamReader, StreamState

log = logging.getLogger("streams.decode_child")  # not __main__ in a decode process

HEADER = 64
"""Bytes before a ring's first slot: one busy flag per slot (so at most 64 slots)."""
MAX_SLOTS = HEADER
MIN_SLOTS = 2
SLOTS = 8
"""Frames in a stream's ring: the server's default (fewer where shared memory is short)."""
"""The fewest slots a ring is made with when shared memory is short (a frame in flight and
the next; frames kept beyond that are copied)."""
COUNTED = ("frames_in", "decoded", "skipped", "motion_skipped", "reconnects", "drops")
"""The counters a child keeps for the server's :class:`~streams.decode_procs.RemoteReader`
(sent as increments)."""
REPORT_S = 0.2
"""How often a child sends its streams' counters and rates."""


def shm_dir() -> str:
    """Where rings are made: ``/dev/shm`` (memory) where there is one."""
    memory = "/dev/shm"  # noqa: S108 (files made by mkstemp: private, unique)
    return memory if os.path.isdir(memory) else tempfile.gettempdir()


STREAMS_WARNED = 10
"""Where the shared memory holds the rings of fewer streams than this, a warning at the first
decode process."""
STREAMS_NEEDED = 5
"""Where it holds fewer than this (Docker's default is 64 MB), the default is no decode
processes."""


def ring_bytes(slots: int, max_side: int) -> int:
    """The shared memory a stream's ring of ``slots`` frames takes for a 1080p camera decoded
    at ``max_side`` (0: at 1080p): 5.3 MiB at 8 slots of 640x360, 47.5 MiB of 1920x1080."""
    width, height = decoded_size(1920, 1080, max_side)
    return HEADER + slots * width * height * 3


def rings_that_fit(size: int, slots: int, max_side: int) -> int:
    """How many such streams' rings ``size`` bytes of shared memory hold."""
    return size // ring_bytes(slots, max_side)


def shm_size(directory: str | None = None) -> int | None:
    """Bytes the shared-memory directory holds (used or not); None when unknown."""
    try:
        st = os.statvfs(directory or shm_dir())
    except OSError:
        return None
    return st.f_frsize * st.f_blocks


def shm_warning(directory: str, slots: int, max_side: int) -> str | None:
    """What to say when ``directory`` holds too little for more than a few streams' rings
    (frames of ``max_side``, as setting ``STREAMDET_STREAM_DECODE_SIZE`` says)."""
    size = shm_size(directory)
    if size is None or (fit := rings_that_fit(size, slots, max_side)) >= STREAMS_WARNED:
        return None
    width, height = decoded_size(1920, 1080, max_side)
    per_stream = ring_bytes(slots, max_side)
    return (
        f"{directory} holds {size / 2**20:.0f} MiB, room for the frames of about {fit} 1080p"
        f" streams decoded at {width}x{height} with {slots} slots ({per_stream / 2**20:.1f}"
        " MiB each); streams beyond that decode with fewer slots, then fail: give the server"
        " more (docker run --shm-size 2g), decode frames smaller (setting"
        " STREAMDET_STREAM_DECODE_SIZE) or in the server process (setting"
        " STREAMDET_DECODE_PROCESSES=0)"
    )


class SharedMemoryFull(OSError):
    """The ring's shared memory could not be reserved: the directory (``/dev/shm``) is full."""


class _Ring:
    """A stream's frames of one size, in a file of shared memory (child side)."""

    def __init__(
        self, gen: int, slots: int, source: tuple[int, int], max_side: int, directory: str
    ) -> None:
        self.gen, self.slots, self.source = gen, slots, source
        self.width, self.height = width, height = decoded_size(*source, max_side)
        self.slot_bytes = height * width * 3
        size = HEADER + slots * self.slot_bytes
        # Named by this process's id: what a process killed leaves, the server removes.
        fd, self.path = tempfile.mkstemp(prefix=ring_prefix(os.getpid()), dir=directory)
        try:
            try:
                # Reserved now: a full /dev/shm fails here with a message, not later with a
                # SIGBUS on the first write.
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                os.unlink(self.path)
                full = exc.errno in (errno.ENOSPC, errno.ENOMEM)
                raise (SharedMemoryFull if full else OSError)(
                    f"cannot reserve {size / 2**20:.0f} MiB of shared memory in {directory} for"
                    f" {slots} frames of {width}x{height} ({exc.strerror}): give the server more"
                    " (docker run --shm-size) or decode in the server process"
                    " (setting STREAMDET_DECODE_PROCESSES=0)"
                ) from exc
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._next = 0
        self.announced = False
        """The server was sent it: it maps the file, then unlinks it (or fails and unlinks
        it); this side unlinks only a ring it never announced."""

    def announce(self, key: str) -> tuple[Any, ...]:
        """The message telling the server to map this ring for ``key``."""
        shape = (self.slots, self.height, self.width, self.source)
        return ("ring", key, self.gen, self.path, *shape)

    def take(self) -> int | None:
        """A free slot, marked busy; None when the server holds every one."""
        for i in range(self.slots):
            slot = (self._next + i) % self.slots
            if self.mm[slot] == 0:
                self.mm[slot] = 1
                self._next = slot + 1
                return slot
        return None

    def write(self, slot: int, frame: Any) -> None:
        dst = np.frombuffer(self.mm, np.uint8, self.slot_bytes, HEADER + slot * self.slot_bytes)
        frame_rgb(frame, (self.width, self.height), dst.reshape(self.height, self.width, 3))

    def retire(self, server_gone: bool = False) -> None:
        """Done with it (a new size, the stream or job ended): this side's mapping closed at
        once (the server keeps its own while it holds frames), the file unlinked if the
        server was never told of it, or is gone. (Every ring was kept mapped until the stream
        ended, a ring of /dev/shm per change of size; and unlinked then, announced or not: a
        job of a few frames could end before the server mapped its ring, and fail.)"""
        with contextlib.suppress(BufferError):  # no view of it outlives a write
            self.mm.close()
        if not self.announced or server_gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def ring_prefix(pid: int) -> str:
    """The start of the name of every ring file of the decode process ``pid``."""
    return f"streamdet-frames-{pid}-"


def make_ring(
    gen: int, slots: int, source: tuple[int, int], max_side: int, directory: str, *, owner: str
) -> _Ring:
    """A ring of ``slots``, or of fewer (down to ``MIN_SLOTS``) where shared memory is short:
    a few more copies for a stream, a shorter lead for a job, not one that cannot start.
    ``owner`` (``stream cam1``, ``job job#3``) is named in the warning.

    Raises:
        SharedMemoryFull: not even ``MIN_SLOTS`` frames fit.
    """
    while True:
        try:
            return _Ring(gen, slots, source, max_side, directory)
        except SharedMemoryFull:
            if slots <= MIN_SLOTS:
                raise
            fewer = max(MIN_SLOTS, slots // 2)
            log.warning(
                "%s: no room for %d frames of %dx%d in %s: trying %d (setting"
                " STREAMDET_DECODE_PROCESSES=0 decodes in the server; docker run --shm-size"
                " makes room)",
                owner, slots, *decoded_size(*source, max_side), directory, fewer,
            )  # fmt: skip
            slots = fewer


def _unused_submit(stream_id: str, item: WorkItem) -> WorkItem | None:
    raise AssertionError("a decode process sends frames to the server, not to a pool")


def _unused_publish(frame: ProcessedFrame) -> None:
    raise AssertionError("a decode process publishes nothing")


class _ChildReader(StreamReader):
    """A stream's decode thread in a decode process: its frames go into shared memory and
    its states and counters to the server."""

    LOG_STATES = False  # the server's reader logs them

    def __init__(
        self, key: str, config: StreamConfig, child: _Child, options: ReaderOptions
    ) -> None:
        clips = None
        if child.clip_options is not None:
            clips = ClipRecorder(config.id, child.clip_options, self._clip_done)
        super().__init__(config, options, _unused_submit, _unused_publish, clips=clips)
        self._key = key
        self._child = child
        self._ring: _Ring | None = None
        self._gens = itertools.count(1)
        self._reported = dict.fromkeys(COUNTED, 0)
        self._report_lock = threading.Lock()

    def _set_state(self, state: StreamState, error: str | None = None) -> None:
        super()._set_state(state, error)
        self.report()
        self._child.post(("state", self._key, state.value, error))

    def _deliver(self, frame: Any, pts: float | None, now: float) -> None:
        ring = self._ring
        if ring is None or ring.source != (frame.width, frame.height):
            gen, child = next(self._gens), self._child
            source = (frame.width, frame.height)
            max_side, owner = self._opt.decode_max_side, f"stream {self.config.id}"
            if self._ring is not None:
                self._ring.retire(self._child.gone)
            ring = make_ring(gen, child.slots, source, max_side, child.dir, owner=owner)
            self._ring = ring
            ring.announced = self._child.post(ring.announce(self._key))
        slot = ring.take()
        if slot is None:
            self.count_drop()
            return
        ring.write(slot, frame)
        # Its counts go with it: sent on the 0.2 s timer only, a frame processed before the
        # next report had the server's frames_processed lead its frames_in.
        self.report(("frame", self._key, ring.gen, slot, pts, now))

    def _clip_done(self, clip_id: int, path: Path | None, error: str | None) -> None:
        self._child.post(
            ("clip-done", self._key, clip_id, None if path is None else str(path), error)
        )

    def report(self, frame: tuple[Any, ...] | None = None) -> None:
        """Send the counters that changed since the last report: on their own, or with
        ``frame`` (a ``("frame", ...)`` message), which the server counts before it offers
        the frame, so no read of its counts shows a frame processed that has not come in."""
        # One report at a time, sent in the order its increments were taken: the timer's
        # thread and the decode thread both report (two at once sent one increment twice).
        with self._report_lock:
            with self._lock:
                values = {name: getattr(self, name) for name in COUNTED}
                latest = None
                if frame is None:
                    latest = (
                        self.width,
                        self.height,
                        self.keyframes_only,
                        self._fps_in.rate(time.monotonic()),
                        self._last_frame_mono,
                        self._motion.area,
                    )
            old = self._reported
            deltas = {k: v - old[k] for k, v in values.items() if v != old[k]}
            self._reported = values
            if frame is None:
                self._child.post(("counts", self._key, deltas, latest))
            else:
                self._child.post((*frame, deltas))

    def _run(self) -> None:
        try:
            super()._run()
        except Exception:
            log.exception("stream %s: decode thread failed", self.config.id)
        finally:
            self.report()
            if self._ring is not None:
                self._ring.retire(self._child.gone)
            self._child.forget(self._key, self)
            self._child.post(("exited", self._key))


JOB_WAIT_S = 0.001
JOB_WAIT_MAX_S = 0.02
"""A job waiting for a free slot looks again after 1 ms, then twice as long each time, up to
20 ms (the server frees slots in place, and says nothing)."""


class _ChildJob:
    """A video job's decoding (:func:`streams.jobs.sampled_frames`) in a decode process:
    each sampled frame into a ring, waiting for a slot the server has let go of rather than
    dropping (a job loses no frame), its progress with it."""

    def __init__(self, key: str, spec: JobSpec, max_side: int, child: _Child) -> None:
        self._key, self._spec, self._max_side, self._child = key, spec, max_side, child
        self._stop = threading.Event()
        self._progress = JobProgress()
        self._ring: _Ring | None = None
        self._gens = itertools.count(1)
        self.thread = threading.Thread(target=self._run, name=f"job-{key}", daemon=True)

    def stop(self) -> None:
        self._stop.set()

    def _stopped(self) -> None:
        if self._stop.is_set():
            raise JobCancelled(interrupted=False)

    def _run(self) -> None:
        error: str | None = None
        lower_priority(JOB_NICE)  # and FFmpeg's threads, which this one starts
        try:
            self._decode()
        except JobCancelled:
            pass
        except (JobError, OSError) as exc:  # OSError: no room for its frames in /dev/shm
            error = str(exc)
        except Exception as exc:  # a bug costs this job, not the process
            log.exception("job %s: decoding failed", self._key)
            error = f"decoding failed: {exc!r}"
        finally:
            if self._ring is not None:
                self._ring.retire(self._child.gone)
            self._child.forget_job(self._key, self)
            self._child.post(("job-end", self._key, error, *self._progress_now()))

    def _progress_now(self) -> tuple[Any, ...]:
        p = self._progress
        return p.frames_read, p.decode_errors, p.position_s, p.gaps_s, p.duration_s

    def _decode(self) -> None:
        for index, t, frame in sampled_frames(self._spec, self._progress, self._stopped):
            source = (frame.width, frame.height)
            ring = self._ring
            if ring is None or ring.source != source:
                if ring is not None:
                    ring.retire(self._child.gone)
                gen, child = next(self._gens), self._child
                owner = f"job {self._key}"
                ring = make_ring(gen, child.slots, source, self._max_side, child.dir, owner=owner)
                self._ring = ring
                ring.announced = self._child.post(ring.announce(self._key))
            wait_s = JOB_WAIT_S
            while (slot := ring.take()) is None:  # the job is behind: the engines are busy
                if self._stop.wait(wait_s):
                    return
                wait_s = min(JOB_WAIT_MAX_S, 2 * wait_s)
            ring.write(slot, frame)
            self._child.post(
                ("job-frame", self._key, ring.gen, slot, index, t, *self._progress_now())
            )


class _Child:
    """A decode process: its streams' threads and the pipe to the server."""

    def __init__(
        self,
        events: Connection,
        options: ReaderOptions,
        slots: int,
        directory: str,
        clip_options: ClipOptions | None,
    ) -> None:
        self.slots, self.dir, self._opt = slots, directory, options
        self.clip_options = clip_options
        self._events = events
        self._send_lock = threading.Lock()
        self._readers: dict[str, _ChildReader] = {}
        self._jobs: dict[str, _ChildJob] = {}
        self._gone = threading.Event()  # the server stopped listening

    @property
    def gone(self) -> bool:
        """The server stopped listening (its rings left unmapped are this side's to unlink)."""
        return self._gone.is_set()

    def lost_server(self) -> None:
        """The server closed its end: what it was told of it will never map."""
        self._gone.set()

    def post(self, message: tuple[Any, ...]) -> bool:
        """Send ``message`` to the server; False where it is gone."""
        if self._gone.is_set():
            return False
        try:
            with self._send_lock:
                self._events.send(message)
        except OSError:  # the server is gone: stop everything
            self._gone.set()
            for reader in list(self._readers.values()):
                reader.stop()
            for job in list(self._jobs.values()):
                job.stop()
            return False
        return True

    def forget(self, key: str, reader: _ChildReader) -> None:
        if self._readers.get(key) is reader:
            del self._readers[key]

    def forget_job(self, key: str, job: _ChildJob) -> None:
        if self._jobs.get(key) is job:
            del self._jobs[key]

    def handle(self, message: tuple[Any, ...]) -> None:
        kind, key = message[0], message[1]
        if kind == "open":
            opened = self._readers[key] = _ChildReader(key, message[2], self, self._opt)
            opened.start()
            return
        if kind == "job":
            job = self._jobs[key] = _ChildJob(key, message[2], message[3], self)
            job.thread.start()
            return
        if kind == "job-stop":
            if (running := self._jobs.get(key)) is not None:
                running.stop()
            return
        # A stream whose thread has ended (failed, or stopping) takes no more changes.
        if (reader := self._readers.get(key)) is None:
            return
        if kind == "set":
            reader.max_fps, reader.detect = message[2], message[3]
        elif kind == "clip" and reader.clips is not None:
            reader.clips.reserve(*message[2:])
        elif kind == "stop":
            del self._readers[key]
            reader.stop()

    def report_loop(self) -> None:
        while not self._gone.wait(REPORT_S):
            for reader in list(self._readers.values()):
                if reader.alive:
                    reader.report()

    def shutdown(self, timeout_s: float) -> None:
        readers = list(self._readers.values())
        jobs = list(self._jobs.values())
        for reader in readers:
            reader.stop()
        for job in jobs:
            job.stop()
        end = time.monotonic() + timeout_s
        for reader in readers:
            reader.join(max(0.0, end - time.monotonic()))
        for job in jobs:
            job.thread.join(max(0.0, end - time.monotonic()))
        self._gone.set()


def child_main(argv: list[str] | None = None) -> int:
    """``python -m streams.decode_child --cmd-fd N --evt-fd M``: started by the hub."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cmd-fd", type=int, required=True)
    parser.add_argument("--evt-fd", type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    commands = Connection(args.cmd_fd, writable=False)
    events = Connection(args.evt_fd, readable=False)
    try:
        _, options, slots, directory, level, clip_options = commands.recv()
    except EOFError:
        return 0
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s [decode %(process)d] %(name)s: %(message)s",
    )
    # Streams and processes are the parallelism here: OpenCV's own thread pool (a thread per
    # core in each process) would only contend with them.
    cv2.setNumThreads(1)
    child = _Child(events, options, slots, directory, clip_options)
    threading.Thread(target=child.report_loop, name="decode-report", daemon=True).start()
    try:
        while True:
            try:
                message = commands.recv()
            except (EOFError, OSError):
                log.warning("the server closed its pipe: stopping")
                child.lost_server()
                break
            if message[0] == "quit":
                break
            try:
                child.handle(message)
            except Exception:  # one stream's bad command must not end the others
                log.exception("decode process: cannot %s", message[:2])
    finally:
        child.shutdown(options.read_timeout_s + 1.0)
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
