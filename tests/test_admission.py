"""Admission control: the queueing prediction, the deadline header, and shedding under a
real burst against a real server (statuses and headers only; no timing assertions)."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import Iterator
from typing import Any, Never

import httpx
import pytest
from fastapi import HTTPException
from prometheus_client.parser import text_string_to_metric_families
from starlette.datastructures import Headers

from loadtest.client import closed_loop
from loadtest.frames import build_payloads
from loadtest.server import ServerProcess
from server.admission import parse_deadline_ms, predict
from tests.helpers import CACHE_DIR, MODEL_PT, VIDEOS

ADMISSION_MS = 600.0


def test_predict_idle_server_is_one_item_plus_decode() -> None:
    est = predict(ahead=0, busy=0, workers=1, max_batch=4, batch_s=0.2, item_s=0.2, decode_s=0.01)
    assert est.wait_s == 0
    assert est.finish_s == pytest.approx(0.21)
    assert est.retry_after_s == 1  # Retry-After is whole seconds, never 0


def test_predict_counts_full_rounds_busy_workers_and_own_batch() -> None:
    # 9 ahead, 2 workers x batch 2: 2 full rounds (4 items each, 2 x 0.5 s) after the busy
    # batch (0.3 s); its own batch holds it and the 1 item left over on its worker.
    est = predict(ahead=9, busy=2, workers=2, max_batch=2, batch_s=0.3, item_s=0.25)
    assert est.wait_s == pytest.approx(0.3 + 2 * 0.5)
    assert est.finish_s == pytest.approx(1.3 + 0.25)
    assert est.retry_after_s == 2
    # One worker still free: no wait for the busy one.
    free = predict(ahead=0, busy=1, workers=2, max_batch=2, batch_s=0.5, item_s=0.25)
    assert free.wait_s == 0


def test_predict_batch_time_grows_with_batch_size() -> None:
    # Measured at batch 1 (0.15 s), a full batch of 8 is predicted at 8 x 0.15 s, not 0.15 s.
    est = predict(ahead=8, busy=0, workers=1, max_batch=8, batch_s=0.15, item_s=0.15)
    assert est.wait_s == pytest.approx(1.2)


def test_predict_decode_queue_on_arrival() -> None:
    def finish(decoding: int) -> float:
        return predict(
            ahead=0,
            busy=0,
            workers=1,
            max_batch=1,
            batch_s=0.1,
            item_s=0.1,
            decode_s=0.02,
            decoding=decoding,
            decode_threads=2,
        ).finish_s

    assert finish(6) - finish(0) == pytest.approx(3 * 0.02)  # 6 ahead on 2 decode threads


def test_predict_cold_server_admits_one_round_only() -> None:
    def cold(ahead: int) -> float:
        return predict(
            ahead=ahead, busy=0, workers=1, max_batch=2, batch_s=0.0, item_s=0.0
        ).finish_s

    assert cold(0) == 0.0 and cold(1) == 0.0
    assert math.isinf(cold(2))


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "nan", "inf", ""])
def test_bad_deadline_header_is_400_naming_it(raw: str) -> None:
    with pytest.raises(HTTPException) as err:
        parse_deadline_ms(Headers({"x-request-deadline-ms": raw}))
    assert err.value.status_code == 400
    assert "X-Request-Deadline-Ms" in str(err.value.detail)


def test_deadline_header_parsed() -> None:
    assert parse_deadline_ms(Headers({"x-request-deadline-ms": "250.5"})) == 250.5
    assert parse_deadline_ms(Headers({})) is None


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("admission")
    settings: dict[str, object] = {
        "model": str(MODEL_PT),
        "cache_dir": str(CACHE_DIR),
        "max_batch": 2,
        "max_queue": 8,
        "admission_deadline_ms": ADMISSION_MS,
    }
    with ServerProcess(settings, log_path=logs / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    return [p.jpeg for p in build_payloads(VIDEOS[:1], per_clip=4)]


def mean_item_s(base_url: str) -> float:
    """Mean engine seconds per image so far, from /metrics."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    values = {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if family.name in ("streamdet_batch_duration_seconds", "streamdet_batch_size")
    }
    return values["streamdet_batch_duration_seconds_sum"] / values["streamdet_batch_size_sum"]


def rejections(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "streamdet_rejections":
            out = {s.labels["reason"]: s.value for s in family.samples}
    return out


def post(client: httpx.Client, jpeg: bytes, deadline_ms: float | None = None) -> httpx.Response:
    headers = {"content-type": "image/jpeg"}
    if deadline_ms is not None:
        headers["x-request-deadline-ms"] = f"{deadline_ms:.0f}"
    return client.post("/detect", content=jpeg, headers=headers)


def test_tight_client_deadline_is_refused_early(server: ServerProcess, jpegs: list[bytes]) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        assert post(client, jpegs[0]).status_code == 200  # the estimate needs one batch
        # Shorter than one image takes alone: no retry can meet it, so 504 without a
        # Retry-After (it was 429 "server busy ... retry after 1 s" on an idle server).
        resp = post(client, jpegs[0], deadline_ms=1)
        assert resp.status_code == 504, resp.text
        assert "retry-after" not in resp.headers
        assert "no retry can meet it: raise X-Request-Deadline-Ms" in resp.json()["detail"]
        assert rejections(server.base_url).get("deadline", 0) >= 1
        bad = client.post(
            "/detect",
            content=jpegs[0],
            headers={"content-type": "image/jpeg", "x-request-deadline-ms": "x"},
        )
        assert bad.status_code == 400


def test_slow_uploads_are_not_work_ahead_of_the_calls_after_them(
    server: ServerProcess, jpegs: list[bytes]
) -> None:
    """30 clients a few bytes into their uploads (slow links) are not calls decoding ahead of
    the others: an idle server serves the calls that come meanwhile (every one was refused
    429, predicted past its deadline), and the uploads' own time, once they end, is not taken
    for decode time (5 uploads of 3 s had a call with its own 1 s deadline refused 429 from
    then on: refused at arrival, no call decoded to bring the estimate back down)."""
    jpeg = jpegs[0]
    head = (
        b"POST /detect HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: image/jpeg\r\n"
        b"Content-Length: %d\r\n\r\n" % len(jpeg)
    )
    slow = [socket.create_connection(("127.0.0.1", server.port), timeout=60) for _ in range(30)]
    try:
        for sock in slow:
            sock.sendall(head + jpeg[:1000])
        with httpx.Client(base_url=server.base_url, timeout=60) as client:
            for _ in range(3):
                during = post(client, jpeg)
                assert during.status_code == 200, during.text
            time.sleep(3.0)  # the uploads are slow: their time must not count as decoding
            for sock in slow[:5]:
                sock.sendall(jpeg[1000:])
            for sock in slow[:5]:  # five at once: some may not fit the 600 ms deadline
                assert sock.recv(64)[:13] in (b"HTTP/1.1 200 ", b"HTTP/1.1 429 ")
            for _ in range(3):
                after = post(client, jpeg, deadline_ms=1000)
                assert after.status_code == 200, after.text
    finally:
        for sock in slow:
            sock.close()


def test_burst_is_answered_with_200_or_429_never_5xx(
    server: ServerProcess, jpegs: list[bytes]
) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        post(client, jpegs[0])
    # Three times the work the admission deadline allows: some calls fit, the rest must not.
    item_s = mean_item_s(server.base_url)
    burst_size = min(64, max(8, math.ceil(3 * ADMISSION_MS / 1000 / item_s)))
    before = rejections(server.base_url)

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=burst_size)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as c:
            calls = [
                c.post(
                    "/detect", content=jpegs[i % len(jpegs)], headers={"content-type": "image/jpeg"}
                )
                for i in range(burst_size)
            ]
            return await asyncio.gather(*calls)

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(200) >= 1, statuses
    assert statuses.count(429) >= 1, statuses
    for resp in responses:
        if resp.status_code == 429:
            assert int(resp.headers["retry-after"]) >= 1
        else:
            assert resp.json()["detections"] is not None
    after = rejections(server.base_url)
    shed = sum(after.values()) - sum(before.values())
    assert shed == statuses.count(429)
    assert after["expired"] == before.get("expired", 0)  # refused early, not timed out


def test_load_clients_count_what_the_server_answers(
    server: ServerProcess, jpegs: list[bytes]
) -> None:
    """The clients of ``streamdet bench`` and ``benchmarks.overload`` (loadtest.client), against
    the real server: multipart and raw bodies both answered, every status counted, latencies
    of 200s only, and far past capacity refusals but never a 5xx or a timeout."""
    one = asyncio.run(
        closed_loop(server.base_url, jpegs, clients=1, seconds=2.0, warmup=0.5, multipart=True)
    )
    assert set(one.statuses) == {"200"} and one.statuses["200"] == len(one.latencies_ms) > 0
    assert one.goodput == pytest.approx(one.statuses["200"] / 2.0)
    assert 0 < one.pct(50) <= one.pct(99) < 2000
    many = asyncio.run(
        closed_loop(server.base_url, jpegs, clients=24, seconds=3.0, warmup=0.5, impatient=True)
    )
    assert set(many.statuses) <= {"200", "429"}, many.statuses
    assert many.errors.get("429", 0) > 0 and many.server_errors == many.timeouts == 0
    assert many.statuses["200"] == len(many.latencies_ms) > 0


def test_retry_after_spreads_when_many_are_refused() -> None:
    from engines.pool import EnginePool
    from server.admission import AdmissionController, Estimate
    from server.metrics import Metrics
    from server.settings import Settings

    def no_engine() -> Never:
        raise AssertionError("the pool is never started here")

    pool = EnginePool(no_engine, workers=1, max_batch=2, max_wait_ms=2, max_queue=8)
    controller = AdmissionController(pool, Settings(), Metrics())
    controller.observe_batch(2, 0.4)  # 0.2 s per image: 5 images/s
    short = Estimate(wait_s=0.3, finish_s=0.5)
    assert controller.retry_after_s(short) == 1  # one refusal: the queue clears in 0.3 s
    waits = [controller.retry_after_s(short) for _ in range(60)]
    # ~60 refusals in a 5 s window = 12/s for a pool serving 5/s: come back in >= 2 s.
    assert waits[-1] >= 2
    assert waits == sorted(waits)
    assert max(waits) <= 30


def test_item_time_mean_and_outcome_correction() -> None:
    from engines.pool import EnginePool
    from server.admission import AdmissionController
    from server.metrics import Metrics
    from server.settings import Settings

    def no_engine() -> Never:
        raise AssertionError("the pool is never started here")

    pool = EnginePool(no_engine, workers=1, max_batch=4, max_wait_ms=2, max_queue=8)
    controller = AdmissionController(pool, Settings(), Metrics())
    for _ in range(50):
        pool._observe(4, 0.4)  # 0.1 s per image, through the pool's own observers
    assert controller.item_s == pytest.approx(0.1)
    assert controller.correction == 1.0  # no outcome yet: the model as it is
    for _ in range(100):
        controller.calibrate(0.5, 0.25)  # the model was pessimistic by 2x
    assert controller.correction == pytest.approx(0.5, abs=0.01)
    for actual in (0.5, 1.0) * 50:
        controller.calibrate(0.5, actual)  # optimistic and noisy: mean 1.5, deviation 0.5
    assert controller.correction == pytest.approx(2.5, abs=0.1)
    for _ in range(200):
        controller.calibrate(0.01, 5.0)
    assert controller.correction == 4.0  # bounded


def test_idle_pool_never_refuses_under_the_server_deadline() -> None:
    assert predict(ahead=0, busy=0, workers=1, max_batch=4, batch_s=5.0, item_s=5.0).idle
    assert not predict(ahead=1, busy=0, workers=1, max_batch=4, batch_s=5.0, item_s=5.0).idle
    assert not predict(ahead=0, busy=1, workers=1, max_batch=4, batch_s=5.0, item_s=5.0).idle


def test_budget_scale_tracks_the_99th_percentile_of_outcomes() -> None:
    from engines.pool import EnginePool
    from server.admission import MIN_BUDGET_SCALE, AdmissionController
    from server.metrics import Metrics
    from server.settings import Settings

    def no_engine() -> Never:
        raise AssertionError("the pool is never started here")

    pool = EnginePool(no_engine, workers=1, max_batch=2, max_wait_ms=2, max_queue=8)
    metrics = Metrics()
    now = [100.0]
    # Time stands still unless the test moves it.
    controller = AdmissionController(pool, Settings(), metrics, clock=lambda: now[0])
    assert controller.budget_scale == 1.0
    for _ in range(500):
        controller.observe_outcome(0.8, 1.0)  # all in time: the whole deadline, never more
    assert controller.budget_scale == 1.0
    for _ in range(10):
        controller.observe_outcome(0.95, 1.0)  # late (past 85 %) calls shrink the planned share
    late = controller.budget_scale
    assert late == pytest.approx(math.exp(-0.05 * 10))
    assert f"streamdet_admission_budget_ratio {late}".encode() in metrics.render()
    # 1 late call in 100 is the equilibrium: the scale stays where it is.
    for _ in range(5):
        for _ in range(99):
            controller.observe_outcome(0.5, 1.0)
        controller.observe_outcome(1.3, 1.0)
    assert controller.budget_scale == pytest.approx(late, rel=0.02)
    for _ in range(200):
        controller.observe_outcome(5.0, 1.0)
    assert controller.budget_scale == pytest.approx(MIN_BUDGET_SCALE)  # bounded
    now[0] += 30.0  # nothing ran for 30 s: the shortfall decays by 1/e
    assert controller.budget_scale == pytest.approx(1 - (1 - MIN_BUDGET_SCALE) / math.e)


def test_cpu_backend_defaults_to_one_single_thread_worker_per_core_gpu_to_two() -> None:
    from engines.registry import default_threads, usable_cores
    from server.settings import Settings

    cpu = Settings(backend="onnxruntime")
    assert cpu.workers == min(4, usable_cores())
    assert default_threads(cpu.workers, cpu.threads_per_worker) == max(
        1, usable_cores() // cpu.workers
    )
    assert Settings(backend="onnxruntime", workers=3).workers == 3  # an explicit value stays
    # Two CUDA streams: one worker's host side overlaps the other's GPU work.
    assert Settings(backend="torch").workers == 2


def test_a_call_of_many_images_is_predicted_whole_and_calibrates_nothing() -> None:
    """A KServe call of 30 images is predicted with its 30 images, and does not calibrate
    the model of one image (compared with the one-image prediction, one such call took the
    correction to its cap, x4: /detect calls were refused for a while after it)."""
    from engines.pool import EnginePool
    from server.admission import AdmissionController
    from server.metrics import Metrics
    from server.settings import Settings

    def no_engine() -> Never:
        raise AssertionError("the pool is never started here")

    pool = EnginePool(no_engine, workers=1, max_batch=4, max_wait_ms=2, max_queue=64)
    controller = AdmissionController(pool, Settings(admission_deadline_ms=60_000), Metrics())
    for _ in range(50):
        pool._observe(4, 0.4)  # 0.1 s per image
    one = controller.estimate()
    many = controller.estimate(more=29)
    assert many.finish_s == pytest.approx(one.finish_s + 7 * 0.4, abs=0.2)  # 7 more rounds
    ticket = controller.admit(time.monotonic(), Headers(), "k1")
    ticket.decoded(0.01, images=30)
    time.sleep(0.05)
    ticket.release()
    assert controller.correction == 1.0


def test_a_bursts_lesson_fades_and_refusals_name_the_deadlines_setting() -> None:
    """The correction relaxes towards the model as it is once calls stop calibrating it (only
    admitted calls do: a client's own deadline was refused for ever after a burst), and a
    refusal names the setting that set its deadline."""
    from engines.pool import EnginePool
    from server.admission import AdmissionController
    from server.metrics import Metrics
    from server.settings import Settings

    def no_engine() -> Never:
        raise AssertionError("the pool is never started here")

    pool = EnginePool(no_engine, workers=1, max_batch=4, max_wait_ms=2, max_queue=8)
    now = [100.0]
    controller = AdmissionController(pool, Settings(), Metrics(), clock=lambda: now[0])
    for _ in range(200):
        controller.calibrate(0.1, 0.3)  # a burst: 3x the model
    assert controller.correction == pytest.approx(3.0, abs=0.05)
    now[0] += 30.0
    assert controller.correction == pytest.approx(1 + 2 / math.e, abs=0.05)
    now[0] += 300.0
    assert controller.correction == pytest.approx(1.0, abs=0.001)
    controller.calibrate(0.1, 0.1)  # from where it had relaxed to
    assert controller.correction == pytest.approx(1.0, abs=0.001)

    def source(admission_ms: float, timeout_ms: float) -> str:
        settings = Settings(admission_deadline_ms=admission_ms, request_timeout_ms=timeout_ms)
        return AdmissionController(pool, settings, Metrics()).deadline_source()

    assert source(1000, 10_000) == "setting STREAMDET_ADMISSION_DEADLINE_MS"
    assert source(0, 10_000) == "setting STREAMDET_REQUEST_TIMEOUT_MS"
    assert source(5000, 800) == "setting STREAMDET_REQUEST_TIMEOUT_MS"
    ticket = controller.admit(time.monotonic(), Headers({"x-request-deadline-ms": "50"}), "r1")
    assert ticket.source == ticket.hard_source == "X-Request-Deadline-Ms"
    ticket.release()
    # A client's longer deadline than the setting's: the setting's planned, and named.
    longer = controller.admit(time.monotonic(), Headers({"x-request-deadline-ms": "5000"}), "r2")
    assert longer.source == "setting STREAMDET_ADMISSION_DEADLINE_MS"
    assert longer.hard_source == "X-Request-Deadline-Ms"  # under the 10 s timeout: the header's
    longer.release()


def test_a_deadline_shorter_than_the_call_alone_is_504_and_the_earliest_deadline_holds() -> None:
    """A client's deadline no idle pool can meet is 504 without ``Retry-After`` (a 429 said
    to retry after 1 s, for ever); a deadline learnt from the body (Triton's ``timeout``)
    tightens the ticket's planned and hard deadlines, never loosens them, and is named."""
    from engines.pool import EnginePool
    from server.admission import AdmissionController
    from server.metrics import Metrics
    from server.settings import Settings

    def no_engine() -> Never:
        raise AssertionError("the pool is never started here")

    pool = EnginePool(no_engine, workers=1, max_batch=4, max_wait_ms=2, max_queue=8)
    controller = AdmissionController(pool, Settings(admission_deadline_ms=1000), Metrics())
    for _ in range(50):
        pool._observe(1, 0.1)  # 0.1 s per image
    with pytest.raises(HTTPException) as short:
        controller.admit(time.monotonic(), Headers({"x-request-deadline-ms": "50"}), "s1")
    assert short.value.status_code == 504 and not short.value.headers
    assert "50 ms deadline is less than the 100 ms one image takes" in str(short.value.detail)
    assert str(short.value.detail).endswith("raise X-Request-Deadline-Ms")
    # The server's own deadline: an idle pool runs the call, whatever it takes.
    ticket = controller.admit(time.monotonic(), Headers(), "s2")
    ticket.tighten(600_000, "the request's timeout parameter")  # later than both: no change
    assert ticket.source == "setting STREAMDET_ADMISSION_DEADLINE_MS"
    assert ticket.hard_source == "setting STREAMDET_REQUEST_TIMEOUT_MS"
    ticket.tighten(50, "the request's timeout parameter")
    assert ticket.deadline == ticket.hard_deadline == pytest.approx(ticket.arrived + 0.05)
    assert ticket.source == ticket.hard_source == "the request's timeout parameter"
    with pytest.raises(HTTPException) as timed:
        ticket.decoded(0.001)
    assert timed.value.status_code == 504
    assert str(timed.value.detail).endswith("raise the request's timeout parameter")
    ticket.release()
    # Meetable alone: a tight deadline that only the queue would miss stays a 429 to retry.
    fits = controller.admit(time.monotonic(), Headers({"x-request-deadline-ms": "900"}), "s3")
    fits.decoded(0.001)
    fits.release()


def test_a_client_deadline_longer_than_the_servers_keeps_the_idle_pool_running_the_call() -> None:
    """On a host where one image takes longer than the server's deadline, an idle pool runs a
    call that asks for none; one asking for a longer deadline than the server's was refused
    504 ("raise X-Request-Deadline-Ms"), though it asked to wait more, not less."""
    from engines.pool import EnginePool
    from server.admission import AdmissionController
    from server.metrics import Metrics
    from server.settings import Settings

    def no_engine() -> Never:
        raise AssertionError("the pool is never started here")

    pool = EnginePool(no_engine, workers=1, max_batch=4, max_wait_ms=2, max_queue=8)
    controller = AdmissionController(pool, Settings(admission_deadline_ms=1000), Metrics())
    for _ in range(50):
        pool._observe(1, 2.0)  # 2 s per image: over the server's 1 s deadline
    for headers in (Headers(), Headers({"x-request-deadline-ms": "5000"})):
        ticket = controller.admit(time.monotonic(), headers, "slow")
        assert ticket.source == "setting STREAMDET_ADMISSION_DEADLINE_MS"
        ticket.decoded(0.001)  # queued, not refused
        ticket.release()
    with pytest.raises(HTTPException) as short:  # a client's own shorter deadline still binds
        controller.admit(time.monotonic(), Headers({"x-request-deadline-ms": "500"}), "short")
    assert short.value.status_code == 504


def test_after_a_burst_a_probe_measures_the_server_again_and_overload_still_refuses() -> None:
    """A burst's lesson (the correction at its cap, x4) is tested by probes instead of waiting
    for its relaxation: a call is let through when no interactive call is queued or running
    and the model alone says it fits, and its time measured at the worker calibrates. Calls
    in steady state (0.3 s predicted, 1 s deadline) were refused 429 at 1.2 s predicted for
    about 45 s after a burst of 1.2-3.5 s calls (only admitted calls calibrate, so the
    lesson only faded on the 30 s relaxation). A really overloaded server still refuses."""
    import numpy as np

    from engines.batching import WorkItem
    from engines.pool import EnginePool
    from engines.types import DetectParams
    from server.admission import AdmissionController
    from server.metrics import Metrics
    from server.settings import Settings

    def no_engine() -> Never:
        raise AssertionError("the pool is never started here")

    def probes(metrics: Metrics) -> float:
        for family in text_string_to_metric_families(metrics.render().decode()):
            if family.name == "streamdet_admission_probes":
                return sum(s.value for s in family.samples if s.name.endswith("_total"))
        raise AssertionError("no streamdet_admission_probes_total")

    def ask(controller: AdmissionController, worker_s: float) -> str:
        """One call: 'refused', or how it was admitted; run for ``worker_s`` at the worker."""
        try:
            ticket = controller.admit(time.monotonic(), Headers(), "c")
            ticket.decoded(0.001)
        except HTTPException as exc:
            return "refused" if exc.status_code == 429 else str(exc.status_code)
        ticket.served(worker_s)
        ticket.release()
        return "probe" if ticket.probe else "admitted"

    pool = EnginePool(no_engine, workers=1, max_batch=4, max_wait_ms=2, max_queue=8)
    now = [100.0]
    metrics = Metrics()
    settings = Settings(admission_deadline_ms=1000)
    controller = AdmissionController(pool, settings, metrics, clock=lambda: now[0])
    for _ in range(50):
        pool._observe(1, 0.15)  # 0.15 s an image
    pool._busy = 1  # the worker runs stream frames: a call waits for that batch, then its own
    for _ in range(20):
        controller.calibrate(0.3, 2.0)  # the burst: 1.2-3.5 s calls while streams opened
    assert controller.correction == 4.0
    outcomes = []
    # A call of several images is no probe: it calibrates nothing, so it would learn nothing.
    several = controller.admit(time.monotonic(), Headers(), "c")
    with pytest.raises(HTTPException) as refused:
        several.decoded(0.001, images=2)
    assert refused.value.status_code == 429, refused.value
    assert probes(metrics) == 0
    for _ in range(10):  # one call every 0.5 s, each 0.3 s at the worker, as in steady state
        now[0] += 0.5
        outcomes.append(ask(controller, 0.3))
    assert "refused" not in outcomes, outcomes  # every one was refused 429 (1200 ms predicted)
    assert outcomes[0] == "probe"
    assert "admitted" in outcomes[:6], outcomes  # the correction itself came down in 3 s
    assert outcomes[-1] == "admitted"
    assert probes(metrics) == outcomes.count("probe")

    # Overloaded for real: probes measure 4x the model, so the lesson stands, and a call
    # arriving with another queued (no probe then) is refused at once.
    for _ in range(20):
        controller.calibrate(0.3, 2.0)
    for _ in range(5):
        now[0] += 0.5
        assert ask(controller, 1.2) in ("probe", "refused")
    assert controller.correction == 4.0
    queued = WorkItem(np.zeros((8, 8, 3), np.uint8), DetectParams(), math.inf, lambda _: None)
    pool.submit(queued)
    assert ask(controller, 0.3) == "refused"
    before = probes(metrics)
    for _ in range(5):
        assert ask(controller, 0.3) == "refused"
    assert probes(metrics) == before


def test_after_a_burst_a_client_deadline_call_on_an_idle_server_is_run_again() -> None:
    """A burst measured decodes and batches slow (40 clients on 2 cores): every later call
    with a 300 ms deadline was refused 504 "deadline too short" on an idle server, for good:
    only admitted calls move the averages. The fastest one-image decode and batch seen say
    what a call alone takes at best; it is let through (a probe) and measures again."""
    from engines.pool import EnginePool
    from server.admission import AdmissionController
    from server.metrics import Metrics
    from server.settings import Settings

    def no_engine() -> Never:
        raise AssertionError("the pool is never started here")

    pool = EnginePool(no_engine, workers=1, max_batch=4, max_wait_ms=2, max_queue=8)
    controller = AdmissionController(pool, Settings(), Metrics())
    pool._observe(1, 0.05)  # idle: 50 ms an image, decoded in 20 ms
    first = controller.admit(time.monotonic(), Headers({"x-request-deadline-ms": "300"}), "a")
    first.decoded(0.02, pixels=640 * 480)
    first.served(0.05, alone_s=0.05)  # its image ran alone: the fastest batch of one
    first.release()
    for _ in range(200):  # the burst's figures
        pool._observe(4, 1.6)
        controller.decode_ewma_s += 0.1 * (0.5 - controller.decode_ewma_s)
    assert controller.alone().finish_s > 0.3  # the averages alone: refused for good
    ticket = controller.admit(time.monotonic(), Headers({"x-request-deadline-ms": "300"}), "b")
    ticket.decoded(0.02)  # run, not refused
    assert ticket.probe
    ticket.release()
    with pytest.raises(HTTPException) as short:  # shorter than the best seen: still 504
        controller.admit(time.monotonic(), Headers({"x-request-deadline-ms": "40"}), "c")
    assert short.value.status_code == 504


def idle_controller(**settings: Any) -> tuple[Any, Any]:
    """An admission controller over a pool that never starts, with what one call alone
    measured: a 640x480 image decoded in 20 ms, run alone in 50 ms."""
    from engines.pool import EnginePool
    from server.admission import AdmissionController
    from server.metrics import Metrics
    from server.settings import Settings

    def no_engine() -> Never:
        raise AssertionError("the pool is never started here")

    pool = EnginePool(no_engine, workers=1, max_batch=4, max_wait_ms=2, max_queue=256)
    controller = AdmissionController(pool, Settings(**settings), Metrics())
    pool._observe(1, 0.05)
    first = controller.admit(time.monotonic(), Headers(), "first")
    first.decoded(0.02, pixels=640 * 480)
    first.served(0.05, alone_s=0.05)
    first.release()
    return pool, controller


@pytest.mark.parametrize(
    ("headers", "settings", "source"),
    [
        ({}, {"request_timeout_ms": 2000}, "raise setting STREAMDET_REQUEST_TIMEOUT_MS"),
        ({"x-request-deadline-ms": "1001"}, {}, "raise X-Request-Deadline-Ms"),
    ],
)
def test_a_call_that_cannot_end_within_its_hard_limit_even_alone_is_refused_504_up_front(
    headers: dict[str, str], settings: dict[str, Any], source: str
) -> None:
    """64 images on an idle server, under a hard limit (the setting, or a client deadline
    above the admission target) shorter than they take alone: they ran the whole limit for
    nobody, then were answered 503 with ``Retry-After: 1``, which no retry could meet."""
    _, controller = idle_controller(**settings)
    ticket = controller.admit(time.monotonic(), Headers(headers), "many")
    with pytest.raises(HTTPException) as refused:
        ticket.decoded(0.02, images=64, pixels=640 * 480)
    assert refused.value.status_code == 504 and refused.value.headers is None
    assert "its 64 images take" in refused.value.detail and source in refused.value.detail
    assert "send fewer images a call" in refused.value.detail
    ticket.release()
    few = controller.admit(time.monotonic(), Headers(headers), "few")
    few.decoded(0.02, images=8, pixels=640 * 480)  # 8 x 50 ms fits: run
    few.release()


def test_tiny_or_raw_images_do_not_lower_what_a_call_alone_takes_at_best() -> None:
    """A raw tensor (nothing decoded: 0 s) or a 64x1 strip (2 ms alone) made the floors of
    every call's "alone" time near 0: an impossible 5 ms deadline was refused 429 "retry
    after 1 s" for ever instead of 504."""
    _, controller = idle_controller()
    for pixels, raw in ((64, True), (640 * 48, False)):
        strip = controller.admit(time.monotonic(), Headers(), "strip")
        strip.decoded(0.0, pixels=pixels, raw=raw)
        strip.served(0.002, alone_s=0.002)
        strip.release()
    assert controller.decode_floor_s == 0.02 and controller.single_floor_s == 0.05
    with pytest.raises(HTTPException) as short:
        controller.admit(time.monotonic(), Headers({"x-request-deadline-ms": "5"}), "x")
    assert short.value.status_code == 504 and "5 ms deadline" in short.value.detail
    with pytest.raises(HTTPException) as tiny:  # a 1 µs Triton timeout is not "0 ms"
        controller.admit(time.monotonic(), Headers({"x-request-deadline-ms": "0.001"}), "y")
    assert "this request's 0.001 ms deadline" in tiny.value.detail


def test_a_burst_right_after_ready_is_planned_by_the_warm_engines_time() -> None:
    """Before its first batch the pool had no figures, and admission let one round through
    and refused the rest: 8 calls right after ``/readyz`` said ready were 4 answered and 4
    refused 429 "predicted to finish in unknown (no batch has run yet)", whatever the
    deadline. The warmup's time of one image plans them."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings
    from tests.helpers import ultralytics_assets

    settings = Settings(model=str(MODEL_PT), cache_dir=CACHE_DIR, admission_deadline_ms=30_000)
    bus = (ultralytics_assets() / "bus.jpg").read_bytes()
    with TestClient(create_app(settings)) as c:
        controller = c.app.state.admission  # type: ignore[attr-defined]
        assert controller.pool.stats.batches == 0 and controller.item_s > 0
        assert c.get("/readyz").status_code == 200

        def call(_: int) -> int:
            files = {"image": ("bus.jpg", bus, "image/jpeg")}
            return c.post("/detect", files=files).status_code

        with ThreadPoolExecutor(8) as burst:
            assert list(burst.map(call, range(8))) == [200] * 8
