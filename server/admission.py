"""Admission control for ``POST /detect``: refuse early what cannot finish in time.

Every call has a deadline: the server's (``STREAMDET_ADMISSION_DEADLINE_MS``, capped by
``STREAMDET_REQUEST_TIMEOUT_MS``) or a tighter one the client asks for with the
``X-Request-Deadline-Ms`` header. A call is admitted only while its predicted finish time
fits the deadline, checked twice:

1. on arrival, before its body is read (so shedding costs almost nothing under overload);
2. after its image is decoded, just before it is queued.

A call counts as decoding (ahead of those arriving after it) from when its body is in, not
while it is still uploading: a slow upload enters the queue after calls that come later
(30 clients on slow links, each a few bytes into its photo, had an idle server refuse every
call 429).

The prediction is the queueing model of the pool (:func:`predict`): the items ahead of it
(queued, plus, on arrival, admitted calls still decoding) fill ``ahead // (max_batch *
workers)`` full rounds, one more batch if every worker is busy, plus its own batch; times
come from the pool's recent batch and per-item EWMAs. A refused call gets ``429`` with
``Retry-After`` (whole seconds until the backlog ahead of it should have cleared), so
accepted calls keep their latency and the rest come back later instead of every call
timing out. A client's deadline shorter than the call takes alone on an idle pool is no
matter of load: no retry can meet it, so it is ``504`` (gRPC ``DEADLINE_EXCEEDED``, the
mapping of the two) without ``Retry-After``, naming the deadline to raise (it was ``429``
"server busy ... retry after 1 s" on an idle server, for ever).

The server's deadline is a latency target for admission; ``STREAMDET_REQUEST_TIMEOUT_MS``
stays the hard limit after which a queued call is answered ``503`` instead of run. A client
deadline is both: a call still queued when its own deadline passes is not run (and is
counted as ``expired``), since the client has stopped waiting for it.

A refused call yields no measurement, so a prediction that is too high could only fade on a
timer: after a burst of slow calls (1.2-3.5 s while 47 streams opened) the correction sat at
its cap and steady-state calls (100-450 ms) were refused 429 for about 45 s. So while calls
are being refused, one is let through as a *probe* whenever no interactive call is queued,
running or decoding ahead of it and the model alone (the correction applied only where it
lowers the prediction) says it fits: it delays nobody, and its time measured at the worker
(enqueue to batch done, not the wall time around it) calibrates the correction with a gain
of its own (:data:`PROBE_ALPHA`). A server overloaded by calls always has one queued or
running, so it admits no probe; one slowed by other work measures that in its probes and
keeps refusing the rest.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from starlette.datastructures import Headers

from engines.pool import EnginePool
from server.metrics import Metrics, get_metrics
from server.request_ids import request_id
from server.settings import Settings
from server.state import get_state

log = logging.getLogger(__name__)

DEADLINE_HEADER = "x-request-deadline-ms"
DEADLINE_HEADER_NAME = "X-Request-Deadline-Ms"
"""The header as errors name it."""
DECODE_ALPHA = 0.2
ITEM_ALPHA = 0.125
"""EWMA gain of the mean per-image time (TCP's gain for the smoothed RTT)."""
RATIO_ALPHA = 0.1
"""EWMA gain of the real/predicted ratio (about the last 10 calls)."""
PROBE_ALPHA = 0.5
"""Gain of a probe's ratio: the only measurement since calls began to be refused, of a lesson
as old as the refusals (at 0.1, 10 probes of 0.3 s at 1 s apart were needed to undo a burst)."""
MIN_CORRECTION, MAX_CORRECTION = 0.25, 4.0
TAIL_QUANTILE = 0.99
"""Share of admitted calls that should finish within their deadline (the p99 target)."""
TAIL_HEADROOM = 0.85
"""A call counts as late past 85 % of its deadline: the rest is left for what the server
cannot time (the network, the client's own scheduling: 20-100 ms at 64 clients on 2 cores)."""
TAIL_GAIN = 0.05
"""Budget shrink per late call (5 %); each call in time grows it by 1/99th of that."""
MIN_BUDGET_SCALE = 0.3
BUDGET_RELAX_S = 30.0
"""Time constant with which a shrunk budget scale returns to 1 when nothing is late."""
FLOOR_MIN_SHARE = 0.25
"""The floors (the fastest one-image decode and batch) count only images of at least this
share of the engine's square input: a 64x1 strip's 2 ms batch made every deadline "meetable",
and impossible ones were refused 429 "retry after 1 s" for ever instead of 504."""
SHED_WINDOW_S = 5.0
"""Time constant of the recent-refusals rate that spreads ``Retry-After``."""
MAX_RETRY_AFTER_S = 30


@dataclass(frozen=True, slots=True)
class Estimate:
    """Predicted seconds until a new call would be answered, and the part spent waiting."""

    wait_s: float
    finish_s: float
    idle: bool = False
    """Nothing is ahead and a worker is free: the call would run at once."""

    @property
    def retry_after_s(self) -> int:
        """Whole seconds (``Retry-After`` takes no fractions), at least 1."""
        return max(1, math.ceil(self.wait_s))


def predict(
    *,
    ahead: int,
    busy: int,
    workers: int,
    max_batch: int,
    batch_s: float,
    item_s: float,
    decode_s: float = 0.0,
    decoding: int = 0,
    decode_threads: int = 1,
) -> Estimate:
    """Queueing prediction for one more call (pure; see the module docstring).

    A full round is ``max_batch * workers`` items; each takes ``item_s * max_batch`` (batch
    time grows about linearly with batch size on a CPU: 177 ms at 1, 1216 ms at 8 for
    yolov8n on 2 cores), or the measured ``batch_s`` if larger. The call's own batch holds it
    and the items left over from the full rounds. On a CPU a latency target needs a small
    ``max_batch``: at 8, one busy batch alone is ~1.2 s.

    Args:
        ahead: interactive items queued (or, on arrival, decoding) before this one.
        busy: workers running a batch now.
        workers: engine workers.
        max_batch: largest batch a worker runs.
        batch_s: recent seconds per batch (EWMA).
        item_s: recent seconds per item within a batch (EWMA); 0 before the first batch.
            With no figures yet, one round is admitted and the rest refused (finish ``inf``,
            retry after 1 s): a cold server hit by a burst would otherwise queue all of it.
        decode_s: recent seconds to read and decode one upload; 0 once decoded.
        decoding: uploads being decoded now, sharing ``decode_threads``.
        decode_threads: threads decoding uploads.
    """
    workers = max(1, workers)
    per_round = max(1, max_batch * workers)
    idle = ahead == 0 and busy < workers
    if item_s <= 0:
        return Estimate(wait_s=1.0, finish_s=0.0 if ahead < per_round else math.inf, idle=idle)
    full_round_s = max(batch_s, item_s * max_batch)
    busy_s = batch_s if busy >= workers else 0.0
    wait = busy_s + (ahead // per_round) * full_round_s
    own_batch = min(max_batch, (ahead % per_round) // workers + 1)
    decode = decode_s * (1 + decoding // max(1, decode_threads)) if decode_s else 0.0
    return Estimate(wait_s=wait, finish_s=decode + wait + own_batch * item_s, idle=idle)


def parse_deadline_ms(headers: Headers) -> float | None:
    """The client's ``X-Request-Deadline-Ms``; raises HTTP 400 when malformed."""
    raw = headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or value <= 0:
        raise HTTPException(
            400,
            f"X-Request-Deadline-Ms must be a positive number of milliseconds, got {raw[:40]!r}",
        )
    return value


class AdmissionController:
    """Decides, per call, whether it can still finish within its deadline.

    ``admit`` and the ticket methods run on the event loop only.

    The queueing model (:func:`predict`, fed with the mean per-image time from the pool's
    batch observer) is calibrated by outcomes: for every call that ran, the ratio of its
    real queue-to-answer time to the model's prediction is tracked as a mean and a mean
    deviation (like TCP's RTT estimator), and predictions are multiplied by mean + 2
    deviations. The model alone was wrong both ways on 2 shared cores: pessimistic at light
    load (26 % of calls refused at a quarter of capacity when it assumed every batch fills
    up) and optimistic under overload (CPU and GIL contention from decoding and refusing:
    accepted p99 1.3-1.6 s against a 1 s target).

    What the model cannot see (event-loop lag, response encoding, a host shared with other
    work) is closed by a second loop on the outcome itself: :attr:`budget_scale` is the
    share of each call's deadline that admission plans for. It tracks the 99th percentile
    (stochastic quantile tracking): every admitted call that ends past 85 % of its deadline
    (``TAIL_HEADROOM``, room for the network and the client) shrinks
    it by ``TAIL_GAIN``, every call in time grows it by 1/99th of that, so it settles where
    1 % of admitted calls are late; it also relaxes back towards 1 with a 30 s time constant,
    so the lesson of a past burst does not refuse calls at a light load long after. The
    mean + 2 deviations correction alone left the server-side p99 at 1.0-1.25 s for a 1 s
    deadline with 64 clients on 2 cores.
    """

    def __init__(
        self,
        pool: EnginePool,
        settings: Settings,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock`` times the relaxation of :attr:`budget_scale` (tests pass their own)."""
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.decoding = 0
        self.running = 0
        """Admitted calls queued in the pool or running there (decoded, not yet released)."""
        self.decode_ewma_s = 0.0
        # The fastest one-image decode and one-image batch seen: what a call alone on an idle
        # server takes at best. The averages above are measured under load too, and only
        # admitted calls move them: after a burst, every call with a deadline was refused
        # 504 "deadline too short" (or 429) on an idle server, for good.
        self.decode_floor_s = math.inf
        self.single_floor_s = math.inf
        self._shed_score = 0.0
        self._shed_at = time.monotonic()
        self.item_mean_s = 0.0
        self.ratio_mean = 1.0
        self.ratio_dev = 0.0
        self.clock = clock
        self._ratio_at = self.clock()
        self._budget_scale = 1.0
        self._budget_at = self.clock()
        pool.batch_observers.append(self.observe_batch)
        metrics.set_wait_source(lambda: self.estimate().wait_s)

    def _relaxed(self) -> tuple[float, float]:
        """The ratio's mean and deviation, relaxed towards the model as it is (1, 0) with
        :data:`BUDGET_RELAX_S`'s time constant since the last call calibrated them: only
        admitted calls calibrate, so a lesson of a burst was kept for ever where every call
        after it was refused (a client's own deadline: 10 lone calls 2 s apart on an idle
        server, all refused)."""
        decay = math.exp(-(self.clock() - self._ratio_at) / BUDGET_RELAX_S)
        return 1.0 + (self.ratio_mean - 1.0) * decay, self.ratio_dev * decay

    @property
    def correction(self) -> float:
        """Factor applied to model predictions: mean + 2 deviations of real/predicted."""
        mean, dev = self._relaxed()
        return min(MAX_CORRECTION, max(MIN_CORRECTION, mean + 2 * dev))

    def calibrate(self, predicted_s: float, actual_s: float, *, probe: bool = False) -> None:
        """One call ran: compare its queue-to-answer time with the model's prediction.

        ``probe``: it was admitted as a probe (:data:`PROBE_ALPHA`). A ratio below the mean
        grows the deviation with an eighth of the gain (Linux's TCP RTT estimator, after
        Eifel): news that calls got faster must not raise the correction (a probe of 0.3 s
        after a burst raised mean + 2 deviations further above the cap)."""
        if predicted_s < 0.001 or math.isinf(predicted_s):
            return
        self.ratio_mean, self.ratio_dev = self._relaxed()
        self._ratio_at = self.clock()
        ratio = actual_s / predicted_s
        gain = PROBE_ALPHA if probe else RATIO_ALPHA
        error = abs(ratio - self.ratio_mean) - self.ratio_dev
        if ratio < self.ratio_mean and error > 0:
            error /= 8
        self.ratio_dev += gain * error
        self.ratio_mean += gain * (ratio - self.ratio_mean)

    def may_probe(self, decode_left: bool) -> bool:
        """Whether no interactive call is queued, running, or (``decode_left``: the call has
        its upload to decode) decoding ahead: a probe then delays nobody."""
        interactive, _ = self.pool.queue.depth()
        return interactive == 0 and self.running == 0 and not (decode_left and self.decoding)

    @property
    def budget_scale(self) -> float:
        """Share of a call's deadline that admission plans for (see the class docstring)."""
        elapsed = self.clock() - self._budget_at
        return 1.0 - (1.0 - self._budget_scale) * math.exp(-elapsed / BUDGET_RELAX_S)

    def observe_outcome(self, total_s: float, deadline_s: float) -> None:
        """An admitted call was answered ``total_s`` after arrival, against a deadline
        ``deadline_s`` after arrival:
        move :attr:`budget_scale` towards the point where 1 % of calls are late."""
        scale = self.budget_scale
        if total_s > TAIL_HEADROOM * deadline_s:
            scale *= math.exp(-TAIL_GAIN)
        else:
            scale *= math.exp(TAIL_GAIN * (1 - TAIL_QUANTILE) / TAIL_QUANTILE)
        self._budget_scale = min(1.0, max(MIN_BUDGET_SCALE, scale))
        self._budget_at = self.clock()
        self.metrics.admission_budget_scale.set(self._budget_scale)

    def observe_batch(self, size: int, elapsed_s: float) -> None:
        """Pool batch observer (a worker thread): update the mean per-image time.

        One float written by one worker at a time and read by the loop; a stale read only
        delays the estimate by a batch.
        """
        item = elapsed_s / max(1, size)
        if self.item_mean_s == 0.0:
            self.item_mean_s = item
            return
        self.item_mean_s += ITEM_ALPHA * (item - self.item_mean_s)

    @property
    def item_s(self) -> float:
        """Mean per-image engine seconds (the model's input); before any batch, one image's
        time on the warm engine (the pool's warmup)."""
        return self.item_mean_s or self.pool.warm_item_s

    def counts_for_floor(self, pixels: int) -> bool:
        """Whether an image of ``pixels`` (as decoded for the engine) is large enough for
        the floors (:data:`FLOOR_MIN_SHARE`)."""
        side = self.settings.imgsz
        return pixels >= FLOOR_MIN_SHARE * side * side

    def server_deadline_ms(self) -> float:
        """The deadline a call gets when it asks for none."""
        target = self.settings.admission_deadline_ms
        timeout = self.settings.request_timeout_ms
        return min(target, timeout) if target > 0 else timeout

    def estimate(self, decode_left: bool = False, more: int = 0) -> Estimate:
        """Prediction for a call now.

        Args:
            decode_left: the call has yet to read and decode its upload (the arrival check):
                calls decoding now are ahead of it too. Once decoded, only the queue is.
            more: images of the call besides its last (a call of several images ends
                with its last).
        """
        interactive, _ = self.pool.queue.depth()
        stats = self.pool.stats
        if self.item_s <= 0:
            more = 0  # no figures yet: a cold server admits one round, a call's images too
        return predict(
            ahead=interactive + more + (self.decoding if decode_left else 0),
            busy=self.pool.busy,
            workers=self.pool.workers,
            max_batch=self.pool.max_batch,
            batch_s=stats.ewma_batch_s,
            item_s=self.item_s,
            decode_s=self.decode_ewma_s if decode_left else 0.0,
            decoding=self.decoding if decode_left else 0,
            decode_threads=self.settings.decode_threads,
        )

    def alone(self, more: int = 0) -> Estimate:
        """Prediction for a call on an idle pool (nothing ahead, no worker busy, nothing
        decoding): the best any retry of it can meet. ``more``: its images besides one."""
        return predict(
            ahead=more,
            busy=0,
            workers=self.pool.workers,
            max_batch=self.pool.max_batch,
            batch_s=self.pool.stats.ewma_batch_s,
            item_s=self.item_s,
            decode_s=self.decode_ewma_s,
            decode_threads=self.settings.decode_threads,
        )

    def best_alone_s(self, more: int = 0) -> float:
        """What a call alone on an idle pool takes at best: :meth:`alone`, brought down to
        the fastest one-image decode and batch seen (the averages may be a burst's)."""
        alone = self.alone(more).finish_s
        one = self.alone().finish_s
        floor = self.decode_floor_s + self.single_floor_s
        if math.isinf(alone) or math.isinf(floor) or one <= 0 or floor >= one:
            return alone
        return alone * floor / one

    def retry_after_s(self, estimate: Estimate) -> int:
        """Seconds a refused client should wait: until the queue ahead clears, or longer
        when many are being refused, so their retries spread over the time the pool needs
        to serve them (refusals per second / images per second) instead of coming back
        together. Counts this refusal.

        With 64 clients that honour it on a pool serving 5 images/s, they settle at about
        one retry every 3 s instead of every second: a third of the wasted uploads.
        """
        now = time.monotonic()
        decay = math.exp(-(now - self._shed_at) / SHED_WINDOW_S)
        self._shed_score = self._shed_score * decay + 1.0
        self._shed_at = now
        item_s = self.item_mean_s
        spread = (self._shed_score / SHED_WINDOW_S) * item_s / max(1, self.pool.workers)
        wait = max(estimate.wait_s, spread)
        return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(wait))))

    def refuse(
        self, reason: str, detail: str, retry_after_s: int, request_id: str
    ) -> HTTPException:
        """Count a rejection and build its 429."""
        self.metrics.reject(reason)
        log.info("request %s: 429 (%s): %s", request_id, reason, detail)
        return HTTPException(429, detail, headers={"Retry-After": str(retry_after_s)})

    def deadline_source(self) -> str:
        """The setting that gives a call that asks for no deadline its deadline."""
        target = self.settings.admission_deadline_ms
        if 0 < target < self.settings.request_timeout_ms:
            return "setting STREAMDET_ADMISSION_DEADLINE_MS"
        return "setting STREAMDET_REQUEST_TIMEOUT_MS"

    def admit(
        self,
        arrived: float,
        headers: Headers,
        request_id: str,
        client_deadline: str = DEADLINE_HEADER_NAME,
        *,
        body_read: bool = True,
    ) -> Ticket:
        """Admit a call that arrived at ``arrived`` (monotonic), or raise HTTP 429.
        ``client_deadline`` names where a client's deadline comes from, in errors (the
        header; gRPC: the call's own deadline). ``body_read=False``: the call has yet to
        receive its body, and counts as decoding only once :meth:`Ticket.body_read` says so.

        Raises:
            HTTPException: 400 bad deadline header, 429 predicted to miss its deadline, 504
                a client's deadline shorter than the call takes alone on an idle server.
        """
        self.metrics.calls.inc()
        client_ms = parse_deadline_ms(headers)
        server_ms = self.server_deadline_ms()
        budget_ms = min(server_ms, client_ms) if client_ms is not None else server_ms
        hard_ms = (
            min(self.settings.request_timeout_ms, client_ms)
            if client_ms is not None
            else self.settings.request_timeout_ms
        )
        ticket = Ticket(
            self,
            request_id,
            arrived,
            arrived + budget_ms / 1000.0,
            arrived + hard_ms / 1000.0,
            # The client's deadline binds only where it is the earlier: a longer one leaves
            # the server's rules (an idle pool runs the call) as if none was sent (it lost
            # that, and a slow host's call was refused 504 for sending a generous deadline).
            from_client=client_ms is not None and client_ms < server_ms,
            source=client_deadline
            if client_ms is not None and client_ms < server_ms
            else self.deadline_source(),
            hard_source=client_deadline
            if client_ms is not None and client_ms < self.settings.request_timeout_ms
            else "setting STREAMDET_REQUEST_TIMEOUT_MS",
        )
        ticket.check(self.estimate(decode_left=True), decode_left=True)
        if body_read:
            ticket.body_read()
        return ticket


@dataclass
class Ticket:
    """One admitted call. ``deadline`` is the latency it was admitted for; ``hard_deadline``
    is when the pool answers it with an error instead of running it."""

    controller: AdmissionController
    request_id: str
    arrived: float
    deadline: float
    hard_deadline: float
    from_client: bool
    source: str = field(default="")
    """What set ``deadline``, for errors: the client's header (or gRPC deadline), or the
    setting."""
    hard_source: str = field(default="setting STREAMDET_REQUEST_TIMEOUT_MS")
    """What set ``hard_deadline``, for errors."""
    decoding: bool = field(default=False)
    queued_at: float | None = field(default=None)
    predicted_s: float = field(default=0.0)
    calibrates: bool = field(default=True)
    refused: bool = field(default=False)
    checked: bool = field(default=False)
    """Admission had a say (the pool was not idle): the outcome tunes the budget scale."""
    probe: bool = field(default=False)
    """Admitted as a probe (the module docstring): refused by the corrected prediction, let
    through to measure the server again."""
    served_s: float | None = field(default=None)
    """Seconds from its queueing to its answer, measured at the worker."""
    running: bool = field(default=False)
    pixels: int | None = field(default=None)
    """The call's largest image as decoded for the engine (None: not known)."""

    def check(self, estimate: Estimate, more: int = 0, *, decode_left: bool = False) -> None:
        """Raise 429 if ``estimate`` (corrected by past outcomes) says this call finishes
        after its deadline, unless it may go as a probe; 504 where its own deadline is
        shorter than the call takes alone on an idle pool (``more``: its images besides
        one), which no retry can meet. ``decode_left``: the arrival check."""
        self.probe = False
        # Under the server's deadline a call that would run at once is never refused:
        # refusing it shortens nobody's wait, and on a slow or loaded host one image alone
        # may exceed the target. A client's own deadline is honoured even then.
        if estimate.idle and not self.from_client:
            self._check_meetable(more)  # within the hard limit, at least
            return
        self.checked = True
        finish_s = estimate.finish_s * self.controller.correction
        scale = self.controller.budget_scale
        planned_s = (self.deadline - self.arrived) * scale
        now = time.monotonic()
        if now + finish_s <= self.arrived + planned_s:
            return
        uncorrected_s = estimate.finish_s * min(1.0, self.controller.correction)
        if estimate.idle:  # at best what a call alone takes (the averages may be a burst's)
            uncorrected_s = min(uncorrected_s, self.controller.best_alone_s(more))
        # Only a call of one image probes: one of several does not calibrate (decoded), so
        # it would measure nothing and be counted as a probe all the same.
        if (
            more == 0
            and self.controller.may_probe(decode_left)
            and now + uncorrected_s <= self.arrived + planned_s
        ):
            self.probe = True
            return
        self.refused = True
        self._check_meetable(more)
        deadline = _ms(self.deadline - self.arrived)
        spent_ms = (now - self.arrived) * 1000
        # What took the time is named: the 429 blamed the prediction alone where most of
        # the deadline had gone to the upload and the wait for a decode thread.
        spent = (
            f", {spent_ms:.0f} ms after it arrived (its upload, the wait for a decode thread"
            " and its decode)"
            if spent_ms >= 1
            else ""
        )
        planned = (
            f"; admission plans for {scale:.0%} of a deadline while recent calls run late"
            if scale < 0.995
            else ""
        )
        retry_after_s = self.controller.retry_after_s(estimate)
        why = (
            "no batch has run yet to predict its finish by, for this"
            if math.isinf(finish_s)
            else f"predicted to finish in {finish_s * 1000:.0f} ms more{spent}, past this"
        )
        raise self.controller.refuse(
            "deadline",
            f"server busy: {why} request's {deadline} deadline ({self.source}){planned};"
            f" retry after {retry_after_s} s",
            retry_after_s,
            self.request_id,
        )

    def _check_meetable(self, more: int) -> None:
        """Raise 504 (no ``Retry-After``) if the client's deadline, or the hard limit after
        which the call is answered 503 instead of run, is shorter than this call alone takes
        on an idle pool, by the model corrected down but never up: a correction above 1 is a
        recent burst's, which fades (a retry may meet less), one below 1 the model's own
        pessimism. Under the server's latency target alone an idle pool runs the call
        whatever it takes; past the hard limit it would run for nobody (64 images under a
        1.5 s limit ran 1.5 s, then were answered 503 ``Retry-After: 1``)."""
        c = self.controller
        alone_s = c.best_alone_s(more) * min(1.0, c.correction)
        if c.item_s <= 0 or math.isinf(alone_s):
            return
        deadline_s, source = self.deadline - self.arrived, self.source
        if not self.from_client or alone_s <= deadline_s:
            deadline_s, source = self.hard_deadline - self.arrived, self.hard_source
        if alone_s <= deadline_s:
            return
        images = f"its {more + 1} images take" if more else "one image takes"
        fewer = " (or send fewer images a call)" if more else ""
        detail = (
            f"deadline too short: this request's {_ms(deadline_s)} deadline is less"
            f" than the {alone_s * 1000:.0f} ms {images} here on an idle server (decode and"
            f" inference), so no retry can meet it: raise {source}{fewer}"
        )
        c.metrics.reject("deadline")
        log.info("request %s: 504 (deadline): %s", self.request_id, detail)
        raise HTTPException(504, detail)

    def tighten(self, deadline_ms: float, source: str) -> None:
        """A deadline the client gave after arrival (Triton's ``timeout`` parameter, in the
        request's body): the earliest of it and the ticket's own deadlines holds, for
        admission (checked when the call is decoded) and as the hard limit."""
        at = self.arrived + deadline_ms / 1000.0
        if at < self.deadline:
            self.deadline, self.source, self.from_client = at, source, True
        if at < self.hard_deadline:
            self.hard_deadline, self.hard_source = at, source

    def body_read(self) -> None:
        """The call's body is in: it decodes now, ahead of the calls that arrive after it."""
        if not self.decoding and self.queued_at is None:
            self.decoding = True
            self.controller.decoding += 1

    def decoded(
        self, seconds: float, images: int = 1, *, pixels: int | None = None, raw: bool = False
    ) -> None:
        """The upload (``images`` pictures, the largest of ``pixels`` as decoded for the
        engine) is decoded: record the time and check the deadline again (429). ``raw``:
        pixels were sent, nothing was decoded, and the decode figures are left as they are
        (such a call's 0 s brought the decode estimate and floor of every upload down)."""
        c = self.controller
        self._stop_decoding()
        self.pixels = pixels
        if not raw:
            alpha = DECODE_ALPHA if c.decode_ewma_s else 1.0
            c.decode_ewma_s += alpha * (seconds - c.decode_ewma_s)
            if images == 1 and pixels is not None and c.counts_for_floor(pixels):
                c.decode_floor_s = min(c.decode_floor_s, seconds)
        # Decoding is done: only the queue and this call's own images are left. A call of
        # several images does not calibrate the model of one (one call of 30 took it to its
        # cap, x4, and every /detect after it was refused for a while).
        self.calibrates = images == 1
        estimate = c.estimate(more=images - 1)
        if images > 1 and c.estimate().idle:
            # Its own images are nobody else's wait: a call of several on an idle server is
            # run, as a call of one is (it was refused 429 on every retry, for ever).
            estimate = replace(estimate, idle=True)
        self.check(estimate, more=images - 1)
        if self.probe:
            c.metrics.admission_probes.inc()
            log.info(
                "request %s: admitted as a probe (correction x%.2f refused it)",
                self.request_id,
                c.correction,
            )
        self.queued_at = time.monotonic()
        self.predicted_s = estimate.finish_s
        self.running = True
        c.running += 1

    def served(self, seconds: float, alone_s: float | None = None) -> None:
        """The pool answered the call ``seconds`` after queueing it (its worker's figures:
        time queued plus its batch's), which calibrates the model instead of the wall time
        around it (result delivery, the event loop's lag: the budget scale's to close).
        ``alone_s``: its one image ran in a batch of its own, that long (a floor's figure
        where the image is large enough)."""
        self.served_s = seconds
        c = self.controller
        if alone_s is not None and self.pixels is not None and c.counts_for_floor(self.pixels):
            c.single_floor_s = min(c.single_floor_s, alone_s)

    def abandon(self) -> None:
        """Not run to its end (its client went away, or it could never be queued): not
        counted as a refusal, and no calibration from it."""
        self.refused = True

    def reject(self, reason: str) -> None:
        """Count a refusal decided elsewhere (queue full, expired, shutting down)."""
        self.refused = True
        self.controller.metrics.reject(reason)

    def _stop_decoding(self) -> None:
        if self.decoding:
            self.decoding = False
            self.controller.decoding -= 1

    def release(self) -> None:
        """The call is over (answered, refused or abandoned); a call that ran calibrates."""
        self._stop_decoding()
        if self.running:
            self.running = False
            self.controller.running -= 1
        if self.queued_at is not None and not self.refused:
            now = time.monotonic()
            if self.calibrates:
                actual_s = self.served_s if self.served_s is not None else now - self.queued_at
                self.controller.calibrate(self.predicted_s, actual_s, probe=self.probe)
            if self.checked:
                self.controller.observe_outcome(now - self.arrived, self.deadline - self.arrived)

    def retry_after(self) -> dict[str, str]:
        """``Retry-After`` for a refusal decided after admission (queue full, expired):
        the same estimate and spreading as admission's own refusals."""
        c = self.controller
        return {"Retry-After": str(c.retry_after_s(c.estimate()))}


def _ms(seconds: float) -> str:
    """``seconds`` as milliseconds for a message: whole, or to 3 figures under 10 ms (a 1 µs
    Triton ``timeout`` was "this request's 0 ms deadline")."""
    ms = seconds * 1000
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.3g} ms"


async def admit(request: Request) -> AsyncIterator[Ticket]:
    """FastAPI dependency: admit the call (or answer 429/503) and release it afterwards."""
    state = get_state(request)
    controller: AdmissionController | None = getattr(request.app.state, "admission", None)
    rid = request_id(request.headers.get("x-request-id"))
    if controller is None or not state.ready:
        get_metrics(request).refuse_unready(state.shutting_down)
        raise HTTPException(503, "model not loaded yet", headers={"Retry-After": "1"})
    # Its body is still to come: it counts as decoding once the route has read it.
    ticket = controller.admit(time.monotonic(), request.headers, rid, body_read=False)
    try:
        yield ticket
    finally:
        ticket.release()


AdmissionTicket = Annotated[Ticket, Depends(admit)]
"""Declare a route parameter with this type to put the route under admission control."""
