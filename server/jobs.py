"""Video jobs' lifecycle: kept under ``<data-dir>/jobs/<id>/``, run one after another (or
``--job-concurrency`` at once) by :func:`streams.jobs.run_job`, and resumed after a restart.

Each job's directory holds ``job.json`` (what it is and how it ended), the uploaded video
(``source.*``) and the results (``frames.ndjson``, ``events.ndjson``). A job waiting or
running when the server stops is run again from the start at the next start: its results are
written anew, unless the server died during each of its last :data:`CRASHED_RUNS_MAX` runs
(the job itself kills it: out of memory, a decoder crash): it fails instead, rather than crash
the server at every start. At most ``--max-jobs`` are kept: a new one deletes the oldest
finished. A deleted job's directory holds :data:`DELETED_FILE` from the moment it is deleted
(a running job's files go once its thread stops): the next start finishes deleting it, as it
deletes a directory with no ``job.json`` (an upload a crash cut off).

Everything here runs on the event loop but the job itself, which runs in a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import logging
import os
import shutil
import threading
import time
import uuid
from asyncio import FIRST_COMPLETED
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engines.batching import WorkItem
from engines.types import class_name
from server.job_video import VIDEO_FILE, AnnotatedVideo
from server.routes.paths import link_base
from server.webhooks import http_client, label, post_json
from streams.detect import StreamDetect
from streams.jobs import (
    EVENTS_FILE,
    FRAMES_FILE,
    JOB_NICE,
    FrameSource,
    JobCancelled,
    JobError,
    JobProgress,
    JobSpec,
    local_frames,
    probe,
    run_job,
)
from streams.sources import SourceError, check_unmoved, upload_options
from streams.storage import DATA_DIR_HINT, storage_failure
from streams.store import private_dir, write_private

log = logging.getLogger(__name__)

JOB_FILE = "job.json"
DELETED_FILE = ".deleted"
"""Written in a job's directory before ``DELETE /jobs/{id}`` answers: the next start deletes
the directory (a crash left it there, a running job's thread not yet stopped)."""
CRASHED_RUNS_MAX = 3
"""A job whose runs the server died during this many times in a row fails at the next start."""
MB = 1024 * 1024  # as the settings count them
LIVE_ONLY = frozenset({"clips", "motion", "motion_mask", "motion_min_area", "motion_threshold"})
"""A live stream's settings, which a job has no use for."""
PROBE_THREADS = 4
"""New jobs' videos probed at once (each up to the open timeout where a URL does not answer)."""
CALLBACK_ATTEMPTS = 6
CALLBACK_BACKOFF_S = 1.0  # doubled after each failure: the last try about 31 s after the first


class JobState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINISHED = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED})


class JobLimitError(RuntimeError):
    """Every kept job is still waiting or running; the message names the setting."""


class JobStorageError(JobLimitError):
    """The jobs' files would take more than they may; the message names the setting."""


class JobsClosed(RuntimeError):
    """The server is stopping."""


@dataclass
class Job:
    """One video job.

    Attributes:
        source: what the API shows of the video: ``{"upload", "bytes"}`` or ``{"url"}`` (its
            password masked).
        target: what FFmpeg opens (a path in the job's directory, or the URL).
        video: the video as probed when the job was made (size, duration, fps, codec).
    """

    id: str
    name: str
    created_at: float
    source: dict[str, Any]
    target: str
    options: dict[str, str]
    video: dict[str, Any]
    detect: StreamDetect
    fps: float | None
    render: bool = False
    callback_url: str | None = None
    callback: dict[str, Any] | None = None
    """How the callback went: ``state`` (``pending``, ``sent``, ``failed``), ``attempts``,
    ``last_error``."""
    state: JobState = JobState.QUEUED
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    counts: dict[str, Any] | None = None
    progress: JobProgress = field(default_factory=JobProgress)
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    cancel: threading.Event = field(default_factory=threading.Event)
    deleted: bool = False
    crashed_runs: int = 0
    """Its runs begun and never ended (the server died during them): counted in
    ``job.json`` as each run begins, back to 0 when one ends."""
    bytes: int = 0
    """Its files' size on disk, measured when it was added and when it ended."""

    def to_json(self, names: Mapping[int, str], root: str = "") -> dict[str, Any]:
        """What ``GET /jobs/{id}`` answers, its paths under ``root`` (the request's root
        path, ``--root-path``: ``job.json`` keeps them without; a callback's, the public URL
        where one is set)."""
        return {
            "id": self.id,
            "name": self.name,
            "state": str(self.state),
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "source": self.source,
            "video": self.video,
            "settings": self.settings(names),
            "progress": self.progress.to_json(),
            "error": self.error,
            "counts": self.counts,
            "bytes": self.bytes,
            "frames_url": f"{root}/jobs/{self.id}/frames",
            "events_url": f"{root}/jobs/{self.id}/events",
            "video_url": f"{root}/jobs/{self.id}/video.mp4" if self.render else None,
            "callback": None
            if self.callback_url is None
            else {"url": label(self.callback_url), **(self.callback or {})},
        }

    def settings(self, names: Mapping[int, str]) -> dict[str, Any]:
        """The detection settings (those a live stream only has left out) and ``fps``."""
        return job_settings(self.detect, names, self.fps, self.render)

    def record(self, names: Mapping[int, str]) -> dict[str, Any]:
        """What ``job.json`` keeps: the API's form and what reopens the video."""
        data = self.to_json(names)
        data.pop("progress")
        return {
            **data,
            "callback_url": self.callback_url,
            "target": self.target,
            "options": self.options,
            "final_progress": self.progress.to_json() if self.state in FINISHED else None,
            "crashed_runs": self.crashed_runs,
        }


def job_settings(
    detect: StreamDetect, names: Mapping[int, str], fps: float | None, render: bool
) -> dict[str, Any]:
    """A job's settings as the API and ``streamdet analyze`` show them: the detection
    settings, those only a live stream has left out, with ``fps`` and ``render``."""
    described = detect.describe(names)
    kept = {key: value for key, value in described.items() if key not in LIVE_ONLY}
    return {**kept, "fps": fps, "render": render}


class JobManager:
    """The kept jobs, their queue and the tasks that run them."""

    def __init__(
        self,
        directory: Path,
        submit: Callable[[WorkItem], None],
        names: Mapping[int, str],
        *,
        max_jobs: int,
        max_bytes: int = 1 << 62,
        concurrency: int,
        inflight: int,
        max_pixels: int,
        decode_max_side: int = 0,
        source_timeout_s: tuple[float, float] = (10.0, 5.0),
        frames: FrameSource | None = None,
        callback_secret: str | None = None,
        callback_timeout_s: float = 5.0,
        root_path: str = "",
        public_url: str | None = None,
    ) -> None:
        self.directory = directory
        # A callback's paths: no request in scope, so the setting's prefix, or absolute URLs
        # under the public URL (--public-url), which the receiver can fetch.
        self._base = link_base(root_path, public_url)
        self._callback_secret = callback_secret
        self._callback_timeout_s = callback_timeout_s
        self._callbacks: set[asyncio.Task[None]] = set()
        self._submit = submit
        self._names = names
        self._max_jobs = max_jobs
        self._max_bytes = max_bytes
        self._concurrency = concurrency
        self._inflight = inflight
        self._max_pixels = max_pixels
        self._decode_max_side = decode_max_side
        self._source_timeout_s = source_timeout_s  # open, read: the streams' settings
        self._frames = frames or local_frames  # decode processes, where the server has them
        self._jobs: dict[str, Job] = {}  # in creation order
        self._held: dict[str, int] = {}  # room held for jobs being received: bytes by id
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._runners: list[asyncio.Task[None]] = []
        self._interrupt = threading.Event()
        self._closed = False
        # Set when shutdown begins (the signal), before the HTTP server waits for open
        # requests: long-polls and followers of jobs answer then, and no job starts.
        self._going = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Threads of their own: a job lowers its thread's CPU priority for good.
        self._executor = ThreadPoolExecutor(concurrency, thread_name_prefix="job")
        # And for probing a new job's video: a URL that answers slowly or not at all holds
        # its thread up to the open timeout, which in the shared default pool (6 threads on
        # 2 cores) held up every other route's blocking work (a dozen such URLs: 18 s).
        self._probes = ThreadPoolExecutor(PROBE_THREADS, thread_name_prefix="job-probe")

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Load the kept jobs; those that were waiting or running wait again."""
        self._loop = asyncio.get_running_loop()
        for job in await asyncio.to_thread(self._load):
            self._jobs[job.id] = job
            if job.state is JobState.QUEUED:
                self._queue.put_nowait(job.id)
            elif job.callback is not None and job.callback.get("state") == "pending":
                self._call_back(job)  # the server stopped before it was sent
        self._runners = [
            asyncio.create_task(self._run_forever(), name=f"jobs-{i}")
            for i in range(self._concurrency)
        ]

    def going_away(self) -> None:
        """Shutdown begins (from a signal handler or any thread): waits and follows of jobs
        end now with what there is (they held the server's exit until its graceful timeout,
        then ended in a 500 or a cut body), and no queued job starts (it runs at the next
        start)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop has already stopped
                loop.call_soon_threadsafe(self._going.set)

    @property
    def leaving(self) -> bool:
        """Shutdown has begun (:meth:`going_away`)."""
        return self._going.is_set()

    async def stop(self, timeout_s: float) -> None:
        """Interrupt the running jobs (they run again at the next start) and wait for their
        threads for up to ``timeout_s``."""
        self._closed = True
        self._going.set()
        self._interrupt.set()
        for task in self._callbacks:  # kept as pending: sent at the next start
            task.cancel()
        if not self._runners:
            return
        for _ in self._runners:  # wakes the idle ones
            self._queue.put_nowait("")
        _, waiting = await asyncio.wait(self._runners, timeout=max(timeout_s, 0.1))
        for task in waiting:
            task.cancel()
        if waiting:
            log.warning("%d video job(s) still running after %.1f s", len(waiting), timeout_s)
            # Still in a frame when the wait ended: the server stopped them, they did not
            # crash it. Left counted, three graceful restarts failed a good job as a crasher.
            for job in list(self._jobs.values()):
                if job.state is JobState.RUNNING and not job.deleted:
                    job.state, job.started_at = JobState.QUEUED, None
                    job.crashed_runs = max(0, job.crashed_runs - 1)
                    await self._save_logged(job)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._probes.shutdown(wait=False, cancel_futures=True)

    # ---- the API's side ------------------------------------------------------------------
    def new_id(self) -> str:
        return uuid.uuid4().hex[:12]

    def directory_of(self, job_id: str) -> Path:
        return self.directory / job_id

    async def make_room(self, incoming: int = 0, job_id: str | None = None) -> None:
        """Check that a new job fits: one more job, and ``incoming`` more bytes (its video,
        uploaded), once the oldest finished jobs are deleted, which :meth:`add` does when the
        job is accepted (a request refused later, not a video, deleted nothing). With
        ``job_id``, the room is held for that job until it is added or released
        (:meth:`release`): requests that come at once each count the others' (they were all
        let through, past ``--max-jobs`` and ``--jobs-max-mb``, while their uploads and
        probes ran).

        Raises:
            JobLimitError: every kept job is waiting or running.
            JobStorageError: the video does not fit beside the jobs waiting or running, or
                alone passes what every job together may keep.
            JobsClosed: the server is stopping.
        """
        if self._closed:
            raise JobsClosed("the server is shutting down")
        if incoming > self._max_bytes:
            raise JobStorageError(
                f"a video of {incoming / MB:.1f} MB is more than the {self._max_bytes / MB:.0f}"
                " MB every job together may keep (setting STREAMDET_JOBS_MAX_MB)"
            )
        jobs, used = self._taken(job_id)
        for oldest in self._finished_oldest_first():
            if jobs < self._max_jobs and used + incoming <= self._max_bytes:
                break
            jobs, used = jobs - 1, used - oldest.bytes
        if jobs >= self._max_jobs:
            raise JobLimitError(
                f"{jobs} video jobs are already waiting or running (setting STREAMDET_MAX_JOBS)"
            )
        if used + incoming > self._max_bytes:
            more = f"another {incoming / MB:.1f} MB would pass" if incoming else "the most,"
            raise JobStorageError(
                f"jobs waiting or running keep {used / MB:.1f} MB: {more}"
                f" {self._max_bytes / MB:.0f} MB (setting STREAMDET_JOBS_MAX_MB)"
            )
        if job_id is not None:
            self._held[job_id] = incoming

    def _taken(self, job_id: str | None) -> tuple[int, int]:
        """Jobs and bytes kept, or held for requests other than ``job_id``'s."""
        held = [b for key, b in self._held.items() if key != job_id]
        return len(self._jobs) + len(held), self.bytes_used() + sum(held)

    def _finished_oldest_first(self) -> Iterator[Job]:
        """The jobs that may go to make room: ended, and their callback no longer being
        tried (one was deleted between its tries: the caller never told, nothing logged)."""
        return (
            j
            for j in self._jobs.values()
            if j.state in FINISHED and (j.callback is None or j.callback["state"] != "pending")
        )

    async def _evict_for(self, job_id: str) -> None:
        """Delete the oldest finished jobs until the room :meth:`make_room` found for
        ``job_id`` is free (as many as it counted, unless jobs ended or went meanwhile)."""
        incoming = self._held.get(job_id, 0)
        while (taken := self._taken(job_id))[0] >= self._max_jobs or (
            taken[1] + incoming > self._max_bytes
        ):
            oldest = next(self._finished_oldest_first(), None)
            if oldest is None:
                return  # a running job grew meanwhile: this one goes over, once
            await self.delete(oldest.id)

    async def probe(
        self, target: str, options: dict[str, str], timeout_s: tuple[float, float]
    ) -> dict[str, Any]:
        """:func:`streams.jobs.probe` in the probes' own threads, a video of frames over
        ``--max-image-pixels`` refused before a frame of it is decoded.

        Raises:
            FramesTooLarge: its frames have more pixels than ``--max-image-pixels``.
            JobError: as ``probe`` does.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._probes, probe, target, options, timeout_s, self._max_pixels
        )

    def release(self, job_id: str) -> None:
        """Let go of the room :meth:`make_room` held for ``job_id`` (its request failed)."""
        self._held.pop(job_id, None)

    def bytes_used(self) -> int:
        """What the kept jobs' files take (each measured when it was added and when it
        ended)."""
        return sum(job.bytes for job in self._jobs.values())

    async def add(self, job: Job) -> Job:
        """Keep ``job`` and queue it, deleting the oldest finished jobs where it needs their
        room (:meth:`make_room`)."""
        if self._closed:
            raise JobsClosed("the server is shutting down")
        await self._evict_for(job.id)  # accepted: the finished jobs it needs room of go
        job.bytes = await asyncio.to_thread(_size, self.directory_of(job.id))
        # Stored before it is kept: a save refused (a full disk: 507) left a job listed as
        # queued that never ran, and held its place under --max-jobs until deleted.
        await asyncio.to_thread(self._save, job)
        self._jobs[job.id] = job
        self._held.pop(job.id, None)  # counted as itself from now on
        self._queue.put_nowait(job.id)
        log.info("job %s: queued (%s)", job.id, job.source)
        return job

    def get(self, job_id: str) -> Job | None:
        return self._jobs.get(job_id)

    def all(self) -> list[Job]:
        """Newest first."""
        return list(reversed(self._jobs.values()))

    def position(self, job: Job) -> int | None:
        """How many queued jobs are ahead of ``job`` (None unless it is queued)."""
        if job.state is not JobState.QUEUED:
            return None
        ahead = 0
        for other in self._jobs.values():
            if other is job:
                return ahead
            ahead += other.state is JobState.QUEUED
        return None

    async def delete(self, job_id: str) -> bool:
        """Cancel a job if it waits or runs, and delete it and its files; False if unknown.
        A running job's files go once its thread has stopped."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return False
        job.deleted = True
        job.cancel.set()
        # On disk first: a server killed before a running job's thread stops (or in the
        # middle of deleting its files) must not bring it back, run it again and call back.
        await asyncio.to_thread(_mark_deleted, self.directory_of(job_id))
        if job.state is not JobState.RUNNING:
            job.finished.set()  # nothing more will come of it: its waiters answer
            await asyncio.to_thread(shutil.rmtree, self.directory_of(job_id), True)
        log.info("job %s: deleted", job_id)
        return True

    async def wait(self, job: Job, timeout_s: float) -> None:
        """Return once ``job`` has finished or is deleted, after ``timeout_s``, or when the
        server begins to stop."""
        ended = asyncio.ensure_future(job.finished.wait())
        going = asyncio.ensure_future(self._going.wait())
        try:
            await asyncio.wait((ended, going), timeout=timeout_s, return_when=FIRST_COMPLETED)
        finally:
            ended.cancel()
            going.cancel()

    def counts(self) -> dict[str, int]:
        """Kept jobs by state (for metrics)."""
        out = {str(state): 0 for state in JobState}
        for job in self._jobs.values():
            out[str(job.state)] += 1
        return out

    # ---- running -------------------------------------------------------------------------
    async def _run_forever(self) -> None:
        while True:
            job_id = await self._queue.get()
            if self._closed or self._going.is_set():
                return  # stopping: a queued job stays queued, and runs at the next start
            job = self._jobs.get(job_id)
            if job is None or job.state is not JobState.QUEUED or job.deleted:
                continue
            try:
                await self._run(job)
            except Exception:  # a bug must cost this job, never the queue behind it
                log.exception("job %s: the runner failed on it", job.id)
                if not job.finished.is_set():  # it did not get to its end
                    self._end(job, JobState.FAILED, "internal error: see the server's log")

    async def _run(self, job: Job) -> None:
        job.state, job.started_at, job.progress = JobState.RUNNING, time.time(), JobProgress()
        job.crashed_runs += 1  # kept so until the run ends: a crash leaves it counted
        await self._save_logged(job)
        log.info("job %s: running", job.id)
        spec = JobSpec(
            job.target,
            job.detect,
            job.fps,
            job.options,
            self._max_pixels,
            self._source_timeout_s,
            decode_max_side=self._decode_max_side,
        )
        sink = None
        if job.render:
            path = self.directory_of(job.id) / VIDEO_FILE
            sink = AnnotatedVideo(path, job.detect, job.fps, job.video)
        try:
            if str(job.source.get("url", "")).startswith("file:"):
                try:  # checked when it was sent; queued since
                    await asyncio.to_thread(check_unmoved, Path(job.target))
                except SourceError as exc:
                    raise JobError(str(exc)) from None
            job.counts = await asyncio.get_running_loop().run_in_executor(
                self._executor,
                functools.partial(
                    run_job,
                    spec,
                    self._submit,
                    self.directory_of(job.id),
                    functools.partial(class_name, self._names),
                    inflight=self._inflight,
                    cancel=job.cancel,
                    interrupt=self._interrupt,
                    progress=job.progress,
                    job_id=job.id,
                    nice=JOB_NICE,
                    sink=sink,
                    frames=self._frames,
                ),
            )
            ended, error = JobState.DONE, None
        except JobCancelled as exc:
            if exc.interrupted and not job.deleted:
                job.state, job.started_at = JobState.QUEUED, None
                job.crashed_runs -= 1  # the server stopped it: not the job's doing
                await self._save_logged(job)
                log.info("job %s: interrupted; it runs again at the next start", job.id)
                return
            ended, error = JobState.CANCELLED, None
        except JobError as exc:
            ended, error = JobState.FAILED, str(exc)
            job.counts = exc.counts  # of the frames it finished, where it failed part way
        except Exception as exc:  # a bug must cost this job, not the runner
            if storage_failure(exc):
                log.error("job %s: cannot write its results: %s", job.id, exc)
                ended, error = JobState.FAILED, f"cannot write its results: {exc} ({DATA_DIR_HINT})"
            else:
                log.exception("job %s: failed", job.id)
                ended, error = JobState.FAILED, f"internal error: {exc!r}"
        if not job.deleted:
            job.bytes = await asyncio.to_thread(_size, self.directory_of(job.id))
        self._end(job, ended, error)
        if job.deleted:  # before its run ended, or while its files were measured
            await asyncio.to_thread(shutil.rmtree, self.directory_of(job.id), True)
            return
        await self._save_logged(job)
        if job.callback_url is not None:
            self._call_back(job)
        p = job.progress
        log.info(
            "job %s: %s after %d frame(s) processed%s",
            job.id,
            job.state,
            p.frames_processed,
            f" ({job.error})" if job.error else "",
        )

    # ---- callbacks -----------------------------------------------------------------------
    def _call_back(self, job: Job) -> None:
        task = asyncio.create_task(self._send_callback(job), name=f"job-callback-{job.id}")
        self._callbacks.add(task)
        task.add_done_callback(self._callbacks.discard)

    async def _send_callback(self, job: Job) -> None:
        """POST ``{"job": ...}`` (as ``GET /jobs/{id}`` gives it) to the job's
        ``callback_url``, signed as webhooks are; retried with backoff, then given up."""
        assert job.callback_url is not None and job.callback is not None
        # Tries made before a restart count (each is saved): a callback the server stopped
        # during went on with 6 more, 8 in all.
        first = int(job.callback.get("attempts") or 0) + 1
        delay = CALLBACK_BACKOFF_S * 2 ** (first - 1)
        if first > CALLBACK_ATTEMPTS:
            job.callback["state"] = "failed"
        async with http_client(self._callback_timeout_s) as client:
            for attempt in range(first, CALLBACK_ATTEMPTS + 1):
                if job.deleted:  # its caller deleted it: nothing left to tell of
                    job.callback["state"] = "cancelled"
                    break
                # Counted and saved before it is made: a server stopped while the call was
                # out (its answer not yet saved) made it again after its restart, 7 in all.
                job.callback["attempts"] = attempt
                await self._save_logged(job)
                payload = {"job": job.to_json(self._names, self._base)}
                error = await post_json(client, job.callback_url, payload, self._callback_secret)
                job.callback["last_error"] = error
                if error is None:
                    job.callback["state"] = "sent"
                    break
                log.warning("job %s: callback not delivered (%s)", job.id, error)
                if attempt == CALLBACK_ATTEMPTS:
                    job.callback["state"] = "failed"
                    break
                if not job.deleted:
                    await self._save_logged(job)
                await asyncio.sleep(delay)
                delay *= 2
        if not job.deleted:
            await self._save_logged(job)

    # ---- files ---------------------------------------------------------------------------
    async def _save_logged(self, job: Job) -> None:
        """:meth:`_save` where the runner goes on whatever the disk says: a full disk raised
        out of the runner, and every later job stayed queued for ever. What is on disk may
        then lag what the API says until a later save (at a restart: a job that was running
        runs again)."""
        try:
            await asyncio.to_thread(self._save, job)
        except Exception as exc:
            hint = f" ({DATA_DIR_HINT})" if storage_failure(exc) else ""
            log.error("job %s: cannot save its state: %s%s", job.id, exc, hint)

    def _save(self, job: Job) -> None:
        if job.deleted:  # its directory is going (it would outlive it: see _mark_deleted)
            return
        where = self.directory_of(job.id)
        private_dir(where)  # under jobs/, made 0700 by _load at the start
        tmp = where / (JOB_FILE + ".tmp")
        # Its source URL's password and its callback_url: 0600 (it was 0644, in a 0755 dir).
        write_private(tmp, json.dumps(job.record(self._names)).encode())
        os.replace(tmp, where / JOB_FILE)

    def _load(self) -> list[Job]:
        """The kept jobs, oldest first. Deletes what a crash left of deleted jobs and of
        uploads never made into a job (no ``job.json``): at startup nothing is arriving."""
        jobs: list[Job] = []
        # Made here, 0700 (one an earlier version made readable by everyone closed): made as
        # an upload's parent, before any job was kept, it was 0755.
        private_dir(self.directory)
        for where in sorted(self.directory.iterdir()):
            if not where.is_dir() or where.is_symlink():
                continue
            path = where / JOB_FILE
            deleted = (where / DELETED_FILE).exists()
            if deleted or not path.exists():
                why = (
                    "deleted before the server stopped"
                    if deleted
                    else f"no {JOB_FILE}: an upload the server stopped during"
                )
                size = _size(where)
                shutil.rmtree(where, ignore_errors=True)
                log.warning("jobs: deleted %s (%d bytes): %s", where, size, why)
                continue
            try:
                job = self._from_record(json.loads(path.read_text(encoding="utf-8")))
                job.bytes = _size(where)
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                # (AttributeError: a field of another type, a "callback" string: it stopped
                # the server's start)
                log.warning(
                    "job %s: not loaded (%s: %s); its files are kept",
                    where.name,
                    path,
                    exc,
                )
                continue
            if job.state is JobState.QUEUED and job.crashed_runs >= CRASHED_RUNS_MAX:
                self._give_up(job)
            jobs.append(job)
        jobs.sort(key=lambda job: job.created_at)
        return jobs

    @staticmethod
    def _end(job: Job, state: JobState, error: str | None) -> None:
        """A run's ending (a run that finished, or one given up at start), all at once, so no
        reader sees half of it: its state and error, its finish time, its progress frozen, no
        crashed run counted, its waiters woken (what they read is complete: its size is
        measured before) and its callback pending (unless it was deleted)."""
        job.state, job.error, job.finished_at = state, error, time.time()
        job.progress.freeze()
        job.crashed_runs = 0
        job.finished.set()
        if job.callback_url is not None and not job.deleted:
            job.callback = {"state": "pending", "attempts": 0, "last_error": None}

    def _give_up(self, job: Job) -> None:
        """Fail a job the server died during each of its last runs (loading, in a thread)."""
        error = (
            f"the server stopped (crashed or was killed) during each of its last"
            f" {job.crashed_runs} runs, so it is not run again: the job may need more memory"
            " than the server has, or its video may crash the decoder; post it again to retry"
        )
        self._end(job, JobState.FAILED, error)
        # What its last run wrote before the crash goes: its progress says it ran no frame
        # (GET /jobs/{id}/frames served 125 of a run its progress did not count).
        for partial in (FRAMES_FILE, EVENTS_FILE, VIDEO_FILE):  # its video: a 48-byte 200
            with contextlib.suppress(OSError):
                (self.directory_of(job.id) / partial).unlink(missing_ok=True)
        try:
            self._save(job)
        except OSError as exc:  # it fails all the same this time, and again at the next start
            log.warning("job %s: %s not saved (%s)", job.id, JOB_FILE, exc)
        log.warning("job %s: failed: %s", job.id, job.error)

    def _from_record(self, data: dict[str, Any]) -> Job:
        state = JobState(data["state"])
        job = Job(
            id=data["id"],
            name=data["name"],
            created_at=float(data["created_at"]),
            source=data["source"],
            target=data["target"],
            # A local video (uploaded, or a file under the allowed directory) is read by
            # demuxers of one file, whatever an older server stored with it.
            options=data["options"] if "://" in data["target"] else upload_options(),
            video=data["video"],
            detect=StreamDetect.from_description(data["settings"], self._names),
            fps=data["settings"].get("fps"),
            render=bool(data["settings"].get("render", False)),
            callback_url=data.get("callback_url"),
            callback={k: v for k, v in (data.get("callback") or {}).items() if k != "url"} or None,
            state=JobState.QUEUED if state is JobState.RUNNING else state,
            started_at=data.get("started_at") if state in FINISHED else None,
            finished_at=data.get("finished_at"),
            error=data.get("error"),
            counts=data.get("counts"),
            crashed_runs=int(data.get("crashed_runs") or 0),
        )
        final = data.get("final_progress")
        if job.state in FINISHED:
            job.finished.set()
            if final:
                job.progress = _progress_from(final)
        return job


def _mark_deleted(directory: Path) -> None:
    """Mark a job's directory deleted, durably (a crash right after leaves it marked), and
    remove its ``job.json``: the next start deletes whatever is left of it."""
    with contextlib.suppress(FileNotFoundError):  # no directory: nothing to mark
        fd = os.open(directory / DELETED_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        (directory / JOB_FILE).unlink(missing_ok=True)
        _sync_directory(directory)


def _sync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem opens a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _size(directory: Path) -> int:
    """Bytes of the files in ``directory`` (0 if it is gone)."""
    total = 0
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def _progress_from(data: Mapping[str, Any]) -> JobProgress:
    """A finished job's progress as it was kept (it no longer moves)."""
    return JobProgress(
        frames_read=int(data.get("frames_read", 0)),
        frames_processed=int(data.get("frames_processed", 0)),
        frames_failed=int(data.get("frames_failed", 0)),
        decode_errors=int(data.get("decode_errors", 0)),
        events=int(data.get("events", 0)),
        position_s=float(data.get("position_s") or 0.0),
        gaps_s=float(data.get("gaps_s") or 0.0),
        duration_s=data.get("duration_s"),
        elapsed_s=data.get("elapsed_s"),
    )


__all__ = [
    "EVENTS_FILE",
    "FRAMES_FILE",
    "VIDEO_FILE",
    "Job",
    "JobLimitError",
    "JobManager",
    "JobState",
    "JobStorageError",
]
