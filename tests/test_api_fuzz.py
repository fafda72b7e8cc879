"""What fuzzing the HTTP API from its own OpenAPI schema (schemathesis, against a real server
with the real model and streams of the shared clips) found, each kept as a plain test."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.helpers import CAR_CLIP, file_stream_app


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    with TestClient(file_stream_app(tmp_path_factory.mktemp("fuzz"))) as c:
        added = c.post("/streams", json={"url": f"file://{CAR_CLIP}", "id": "car", "max_fps": 2})
        assert added.status_code == 201, added.text
        yield c


# Bodies that are no JSON Python's parser can read, each with the words its answer must hold.
UNREADABLE = {
    "not-utf8": ('{"url": "caf\xe9"}'.encode("latin-1"), "UTF-8"),
    "nested-too-deep": (b"[" * 100_000 + b"]" * 100_000, "nested"),
    "huge-integer": (b'{"url": "x", "max_fps": ' + b"9" * 5000 + b"}", "digits"),
}
JSON_ROUTES = [
    ("POST", "/streams"),
    ("PUT", "/streams/fuzzed"),
    ("PATCH", "/streams/car"),
    ("POST", "/streams/car/events"),
    ("POST", "/webhooks"),
    ("POST", "/jobs"),
    ("POST", "/v2/models/yolov8n/infer"),
]


@pytest.mark.parametrize("body", UNREADABLE.values(), ids=UNREADABLE.keys())
@pytest.mark.parametrize("route", JSON_ROUTES, ids=[f"{m} {p}" for m, p in JSON_ROUTES])
def test_a_json_body_python_cannot_read_is_a_4xx_saying_why(
    client: TestClient, route: tuple[str, str], body: tuple[bytes, str]
) -> None:
    """Invalid UTF-8, nesting deeper than the parser recurses, an integer of more digits than
    Python converts: ``POST /jobs`` and KServe's ``infer`` answered a bare 500 (a traceback in
    the log), the other routes FastAPI's 400 "There was an error parsing the body", naming
    nothing. Now a 4xx (422; 400 under ``/v2``, as its other unreadable bodies) naming the body
    and what is wrong with it; nothing is added, and the server goes on serving."""
    method, path = route
    content, words = body
    got = client.request(
        method, path, content=content, headers={"content-type": "application/json"}
    )
    expected = 400 if path.startswith("/v2") else 422
    assert got.status_code == expected, got.text
    assert "body" in got.text and words in got.text, got.text
    assert client.get("/streams/fuzzed").status_code == 404
    assert client.get("/jobs").json() == {"jobs": []}
    assert client.get("/streams/car").json()["max_fps"] == 2
    assert client.get("/healthz").status_code == 200


TEXT_UNREADABLE = {k: v for k, v in UNREADABLE.items() if k != "not-utf8"}  # a form's text


@pytest.mark.parametrize("body", TEXT_UNREADABLE.values(), ids=TEXT_UNREADABLE.keys())
def test_a_jobs_settings_field_python_cannot_read_is_a_422_saying_why(
    client: TestClient, body: tuple[bytes, str]
) -> None:
    """The same in a job's multipart ``settings`` field (a 500)."""
    content, words = body
    video = ("car.mp4", CAR_CLIP.read_bytes(), "video/mp4")
    got = client.post("/jobs", files={"video": video}, data={"settings": content.decode()})
    assert got.status_code == 422, got.text
    assert words in got.text, got.text
    assert client.get("/jobs").json() == {"jobs": []}


def test_a_405_lists_every_method_its_path_answers(client: TestClient) -> None:
    """RFC 9110: a 405's ``Allow`` lists the resource's methods. Starlette took the first route
    of the path's that did not take the method, so ``OPTIONS /streams`` said ``Allow: POST``
    (not GET), ``/streams/{id}`` ``PUT`` (not GET, PATCH, DELETE), ``/healthz`` ``HEAD``. Each
    path of the schema now lists every method it has, under ``/v2`` too."""
    schema = client.get("/openapi.json").json()
    for template, operations in schema["paths"].items():
        path = template.replace("{", "").replace("}", "")  # any value: the path's methods
        got = client.request("OPTIONS", path)
        assert got.status_code == 405, (path, got.text)
        allowed = {m.strip() for m in got.headers["allow"].split(",")}
        assert {m.upper() for m in operations} <= allowed, (path, got.headers["allow"])


def test_the_schema_documents_the_answers_each_route_gives(client: TestClient) -> None:
    """Schemathesis checked the real answers against the document: ``422``'s message form
    (``{"detail": "roi: 0 points; ..."}``) broke the declared list, ``404``/``409``/``400``/
    ``415`` were in no operation, ``/v2`` errors are ``{"error"}``, ``/v2/health/*`` answer an
    empty 200 declared JSON, and YAML, CSV, NDJSON and event-stream answers were undeclared."""
    schema = client.get("/openapi.json").json()
    components = schema["components"]["schemas"]
    detail = components["HTTPValidationError"]["properties"]["detail"]
    assert {"type": "string"} in detail["anyOf"]
    refused = client.post("/streams", json={"url": f"file://{CAR_CLIP}", "roi": []})
    assert refused.status_code == 422 and isinstance(refused.json()["detail"], str)
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert {"4XX", "5XX"} <= set(responses), (method, path)
            wanted = "V2Error" if path.startswith("/v2") else "Error"
            ref = responses["4XX"]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/" + wanted), (method, path)
    # POST /jobs reads its body itself: FastAPI declares no 422, its list falls under 4XX.
    assert {"type": "string"} in components["Error"]["properties"]["detail"]["anyOf"]
    listed = client.post("/jobs", json={"url": f"file://{CAR_CLIP}", "name": "x" * 201})
    assert listed.status_code == 422 and isinstance(listed.json()["detail"], list)
    assert "422" not in schema["paths"]["/jobs"]["post"]["responses"]
    assert "ValidationError" in json.dumps(components["Error"])
    missing = client.get("/streams/nope")
    assert missing.status_code == 404 and isinstance(missing.json()["detail"], str)
    assert set(client.get("/v2/models/nope").json()) == {"error"}
    paths = schema["paths"]
    assert "content" not in paths["/v2/health/live"]["get"]["responses"]["200"]
    assert client.get("/v2/health/live").content == b""
    assert "application/yaml" in paths["/streams"]["get"]["responses"]["200"]["content"]
    assert "text/event-stream" in paths["/events"]["get"]["responses"]["200"]["content"]
    assert "text/csv" in paths["/events/counts"]["get"]["responses"]["200"]["content"]
    frames = paths["/jobs/{job_id}/frames"]["get"]["responses"]["200"]["content"]
    assert {"application/x-ndjson", "text/csv"} <= set(frames)
    assert client.get("/openapi.json").json() == schema  # the same each time


def test_the_error_answers_name_every_status_the_routes_give(client: TestClient) -> None:
    """The 4XX/5XX descriptions list each status a route answers: a 405 (its Allow), a
    long poll or /detect whose client hung up (499) and a client deadline no retry can meet
    (504, without Retry-After) were in neither."""
    detect = client.get("/openapi.json").json()["paths"]["/detect"]["post"]["responses"]
    for status in ("405", "499"):
        assert status in detect["4XX"]["description"], status
    assert "504" in detect["5XX"]["description"]


# The operations fuzzed from the schema in CI: those that take JSON or many query parameters,
# on the module's app (a live stream "car"). Not /detect (inference on every example: the
# engine's own tests), nor GET /events (a wait_s long poll of up to 60 s each).
FUZZED = [
    ("POST", "/streams"),
    ("PUT", "/streams/{stream_id}"),
    ("PATCH", "/streams/{stream_id}"),
    ("GET", "/streams/{stream_id}/latest.jpg"),
    ("POST", "/streams/{stream_id}/events"),
    ("GET", "/events/counts"),
    ("POST", "/webhooks"),
    ("GET", "/jobs"),
    ("GET", "/clips"),
]


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("operation", FUZZED, ids=[f"{m} {p}" for m, p in FUZZED])
def test_fuzzed_from_the_schema_every_answer_is_the_one_it_declares(
    client: TestClient, operation: tuple[str, str], mode: str
) -> None:
    """Schemathesis' examples from the document, valid and invalid (20 of each, the same
    every run): no 5xx, and every answer's status, media type and body are those the
    document declares (the 422 messages and 404s were not)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
    method, path = operation
    strategy = schema[path][method].as_strategy(generation_mode=schemathesis.GenerationMode(mode))

    @given(case=strategy)
    @settings(
        max_examples=20,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def answers_as_declared(case: Any) -> None:
        if method != "PUT" and case.path_parameters:  # the live stream, not a 404 each time
            case.path_parameters["stream_id"] = "car"
        kwargs = case.as_transport_kwargs(base_url=str(client.base_url))
        kwargs.pop("cookies", None)  # none declared; httpx deprecates them per request
        if isinstance(kwargs.get("data"), str | bytes):  # a body that is no JSON: raw
            kwargs["content"] = kwargs.pop("data")
        response = client.request(**kwargs)
        case.validate_response(response, checks=checks)

    answers_as_declared()
    assert client.get("/streams/car").json()["state"] in ("connecting", "live", "disabled")


def test_with_api_keys_the_schema_says_which_routes_need_none(tmp_path: Path) -> None:
    """Keys on, the document said every operation needs a bearer key; the health probes
    answer without one (on purpose: load balancers, Kubernetes), so a client or fuzzer took
    their 200 without a key for a hole. They say ``security: []`` now; the rest need the key."""
    with TestClient(file_stream_app(tmp_path, api_keys=["k1"])) as c:
        schema = c.get("/openapi.json").json()
        assert schema["security"] == [{"apiKey": []}]
        for path, operations in schema["paths"].items():
            for method, operation in operations.items():
                anonymous = c.request(method.upper(), path.replace("{", "").replace("}", ""))
                if path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"):
                    assert operation["security"] == [], path
                    assert anonymous.status_code == 200, (path, anonymous.text)
                else:
                    assert "security" not in operation, path
                    assert anonymous.status_code == 401, (method, path, anonymous.text)


def test_the_event_filters_times_are_documented_as_they_are_taken(client: TestClient) -> None:
    """``since``/``until`` take Unix seconds or ISO 8601, as the README says; the document
    declared a date-time string only, so ``until=0.5`` (taken) read as a schema violation
    and generated clients could not send seconds."""
    schema = client.get("/openapi.json").json()
    for path in ("/events", "/events/counts"):
        for parameter in schema["paths"][path]["get"]["parameters"]:
            if parameter["name"] in ("since", "until"):
                assert {"type": "number"} in parameter["schema"]["anyOf"], (path, parameter)
    assert client.get("/events/counts", params={"since": 1.5e9, "until": "2100-01-01"}).is_success


def test_a_refusal_does_not_echo_a_huge_value_back(client: TestClient) -> None:
    """FastAPI's 422 echoes each refused value whole: a 20 MB ``url`` (its limit is 2,048
    characters) or webhook ``secret`` came back as a 20 MB answer. The value is cut to its
    first 200 characters, saying how long it was; the message still names the field."""
    huge = "rtsp://camera/" + "a" * 1_000_000
    for path, body in (("/streams", {"url": huge}), ("/webhooks", {"url": huge})):
        got = client.post(path, json=body)
        assert got.status_code == 422 and len(got.content) < 4000, (path, len(got.content))
        (error,) = got.json()["detail"]
        assert error["loc"] == ["body", "url"] and "2048" in error["msg"], error
        assert error["input"].startswith("rtsp://camera/aaa") and "1000014" in error["input"]
    nested = client.patch("/streams/car", json={"roi": [[0.5, 0.5]] * 50_000})
    assert nested.status_code == 422 and len(nested.content) < 4000, len(nested.content)


def test_with_api_keys_a_refusal_under_v2_is_its_error_answer(tmp_path: Path) -> None:
    """KServe's routes answer every error as ``{"error": ...}`` (tritonclient reads it), and
    the document says so; a missing or read-only key got ``{"detail": ...}`` there."""
    with TestClient(file_stream_app(tmp_path, api_keys=["k1"], api_keys_readonly=["r1"])) as c:
        refused = c.get("/v2/models/yolov8n")
        assert refused.status_code == 401 and "STREAMDET_API_KEYS" in refused.json()["error"]
        assert "bearer" in refused.headers["www-authenticate"].lower()
        assert set(c.get("/streams").json()) == {"detail"}  # elsewhere as before
        wrote = c.delete("/streams/x", headers={"Authorization": "Bearer r1"})
        assert wrote.status_code == 403 and set(wrote.json()) == {"detail"}
        assert c.get("/v2/models/yolov8n", headers={"Authorization": "Bearer r1"}).is_success


SETTINGS_ROUTES = [r for r in JSON_ROUTES if not r[1].startswith(("/jobs", "/v2"))]


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
@pytest.mark.parametrize("route", SETTINGS_ROUTES, ids=[f"{m} {p}" for m, p in SETTINGS_ROUTES])
def test_a_settings_body_over_a_megabyte_is_413(
    client: TestClient, route: tuple[str, str], chunked: bool
) -> None:
    """A settings route read a body of any size whole and parsed it before any check (a 200 MB
    ``POST /webhooks`` took 6 s and its size in memory): past 1 MiB it is a 413 saying so, at
    once where its length is declared, else as it arrives; nothing is added."""
    method, path = route
    big = json.dumps({"url": "x" * (1 << 20)}).encode()
    content: Any = iter([big[i : i + 65536] for i in range(0, len(big), 65536)]) if chunked else big
    got = client.request(
        method, path, content=content, headers={"content-type": "application/json"}
    )
    assert got.status_code == 413, got.text
    assert "body larger than 1024 kB" in got.json()["detail"]
    assert client.get("/streams/fuzzed").status_code == 404
    assert client.get("/streams/car").json()["url"].endswith(CAR_CLIP.name)
