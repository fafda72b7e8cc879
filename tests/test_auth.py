"""API keys and CORS against a real uvicorn process (HTTP and the WebSocket handshake)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.datastructures import Headers, QueryParams
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from loadtest.server import ServerProcess, free_port
from server.auth import Access, ApiKeys, authorize
from server.settings import Settings
from tests.helpers import CACHE_DIR, MODEL_PT, ultralytics_assets

FULL = "full-7d1c0e9a4b"
READONLY = "read-52aa1f03c8"
ORIGIN = "https://viewer.example"
GRPC_PORT = free_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    logs = tmp_path_factory.mktemp("auth")
    settings: dict[str, object] = {
        "model": str(MODEL_PT),
        "cache_dir": str(CACHE_DIR),
        "max_batch": 1,
        "admission_deadline_ms": 0,
        "api_keys": [FULL, "second-key-0b9e"],
        "api_keys_readonly": [READONLY],
        "cors_origins": [ORIGIN],
        "grpc_port": GRPC_PORT,
    }
    with ServerProcess(settings, log_path=logs / "server.log") as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def bus() -> bytes:
    return Path(ultralytics_assets() / "bus.jpg").read_bytes()


def test_health_and_viewer_stay_open(http: httpx.Client) -> None:
    """Without a key, GET or HEAD (probes send either; HEAD was 405), and KServe's health
    routes too (a Triton deployment's Kubernetes probes ask them, and got 401)."""
    for path in ("/healthz", "/readyz", "/v2/health/live", "/v2/health/ready"):
        assert http.get(path).status_code == 200, path
        assert http.head(path).status_code == 200, path
    assert http.get("/").status_code == 200
    assert http.get("/v2/models/yolov8n").status_code == 401  # the rest of /v2 is not open


def test_the_docs_page_opens_in_a_browser_and_asks_for_the_key(http: httpx.Client) -> None:
    """A browser navigating to ``/docs`` sends no header: it and the schema answered 401.
    They hold no data; the schema says calls take a bearer key, so the page's Authorize
    button asks for it and sends it with each call tried."""
    assert http.get("/docs").status_code == 200
    schema = http.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    assert schema["security"] == [{"apiKey": []}]
    assert http.get("/streams").status_code == 401  # what the page calls still needs it
    # ReDoc is the same kind of page reading the same open schema (it needed a key).
    redoc = http.get("/redoc")
    assert redoc.status_code == 200 and "/openapi.json" in redoc.text


def raw_request(
    server: ServerProcess, method: str, path: str, key: str | None = None
) -> tuple[int, str | None]:
    """``method path`` sent literally over a socket (clients normalise ``//x`` or drop it),
    with a one-byte body: the status and the ``Location`` answered."""
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: 127.0.0.1:{server.port}",
        "Connection: close",
        "Content-Type: image/jpeg",
        "Content-Length: 1",
    ]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + b"x")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head = answer.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    location = [v for k, _, v in (h.partition(": ") for h in head[1:]) if k.lower() == "location"]
    return int(head[0].split()[1]), location[0] if location else None


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/detect/"),  # the router's redirect to /detect: 403 with a read-only key
        ("POST", "/v2/models/yolov8n/infer/"),
        ("POST", "/streams/"),
        ("GET", "/streams/"),
        ("PUT", "/detect"),  # 405 for every key (a read-only key got 403)
        ("POST", "/streams/abc"),
        ("POST", "//v2/models/yolov8n/infer"),  # no such route: 404 for every key
        ("POST", "//detect"),
        ("GET", "//v2/models/yolov8n"),
        ("POST", "/static/viewer.js"),  # the viewer's files: 405 (a mount matches any method)
        ("DELETE", "/static/nothing"),
    ],
)
def test_a_read_only_key_gets_what_a_full_key_gets_where_no_handler_writes(
    server: ServerProcess, method: str, path: str
) -> None:
    """Keys are checked on the path as the router matches it, and a read-only key is
    refused only where a handler that writes would run: elsewhere it gets the router's own
    answer, as a full key does. Without a key it is 401 all the same."""
    full = raw_request(server, method, path, FULL)
    assert full[0] in (307, 404, 405), full
    assert raw_request(server, method, path, READONLY) == full
    assert raw_request(server, method, path)[0] == 401


def test_the_write_rule_holds_where_the_redirect_leads(server: ServerProcess) -> None:
    """Past the redirect a read-only key still cannot add a stream, and still detects."""
    status, location = raw_request(server, "POST", "/streams/", READONLY)
    assert status == 307 and location is not None and location.endswith("/streams")
    assert raw_request(server, "POST", "/streams", READONLY)[0] == 403
    assert raw_request(server, "POST", "/detect/", READONLY)[1] == f"{server.base_url}/detect"
    assert raw_request(server, "POST", "/detect", READONLY)[0] == 400  # not a picture: the route


def test_open_routes_are_open_by_the_routed_path_and_logged_as_sent(
    server: ServerProcess,
) -> None:
    """What is open is decided on the path the router matches: ``//healthz`` is no route
    and needs a key as every unknown path does; ``/healthz/`` and ``/docs/`` are the
    router's redirects to open pages, for anyone (they were 401 without a key). A refusal
    is logged with the path as it was sent."""
    assert raw_request(server, "GET", "/healthz") == (200, None)
    assert raw_request(server, "GET", "//healthz")[0] == 401
    for path in ("/healthz/", "/docs/", "/v2/health/ready/"):
        assert raw_request(server, "GET", path) == (307, f"{server.base_url}{path.rstrip('/')}")
    assert raw_request(server, "GET", "/streams/")[0] == 401  # not open: its twin is not
    assert raw_request(server, "POST", "//v2/models/yolov8n/infer")[0] == 401
    log = server.log_path.read_text()
    assert "POST //v2/models/yolov8n/infer refused with 401" in log


@pytest.mark.parametrize(
    "headers",
    [{}, bearer("wrong-key"), {"Authorization": f"Basic {FULL}"}, {"Authorization": "Bearer"}],
    ids=["none", "unknown", "basic-scheme", "empty"],
)
def test_missing_or_unknown_key_is_401(http: httpx.Client, headers: dict[str, str]) -> None:
    for method, path in [("GET", "/model"), ("GET", "/metrics"), ("GET", "/streams")]:
        resp = http.request(method, path, headers=headers)
        assert resp.status_code == 401, (path, resp.text)
        assert resp.headers["www-authenticate"].startswith("Bearer")
        # RFC 6750: an error code only where a key came and was wrong.
        unknown = "wrong-key" in headers.get("Authorization", "")
        assert ('error="invalid_token"' in resp.headers["www-authenticate"]) == unknown
        assert "STREAMDET_API_KEYS" in resp.json()["detail"]
    resp = http.post("/detect", content=bus(), headers={**headers, "content-type": "image/jpeg"})
    assert resp.status_code == 401


def test_full_keys_work(http: httpx.Client) -> None:
    for key in (FULL, "second-key-0b9e"):
        resp = http.post(
            "/detect", content=bus(), headers={**bearer(key), "content-type": "image/jpeg"}
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["detections"]
    assert http.get("/metrics", headers=bearer(FULL)).status_code == 200
    # Past authentication: the route itself answers (a malformed body is its 422).
    assert http.post("/streams", json={}, headers=bearer(FULL)).status_code == 422


def test_readonly_key_reads_and_detects_but_cannot_change_streams(http: httpx.Client) -> None:
    ro = bearer(READONLY)
    assert http.get("/model", headers=ro).status_code == 200
    assert http.get("/streams", headers=ro).status_code == 200
    assert http.get("/events", headers=ro).status_code == 200
    assert http.get("/events", params={"access_token": READONLY}).status_code == 200
    assert http.get("/events").status_code == 401
    resp = http.post("/detect", content=bus(), headers={**ro, "content-type": "image/jpeg"})
    assert resp.status_code == 200
    # tritonclient's get_model_repository_index() reads with a POST (it was 403).
    index = http.post("/v2/repository/index", headers=ro, json={})
    assert index.status_code == 200 and index.json()[0]["state"] == "READY", index.text
    for method, path in [
        ("POST", "/v2/repository/models/yolov8n/load"),
        ("POST", "/streams"),
        ("PATCH", "/streams/abc"),
        ("DELETE", "/streams/abc"),
    ]:
        resp = http.request(method, path, headers=ro, json={"url": "rtsp://127.0.0.1:1/x"})
        assert resp.status_code == 403, resp.text
        assert "read-only" in resp.json()["error" if path.startswith("/v2") else "detail"]
        assert "www-authenticate" not in resp.headers


def test_websocket_handshake_needs_a_key(server: ServerProcess) -> None:
    url = server.base_url.replace("http://", "ws://") + "/ws/streams/nope"
    with pytest.raises(InvalidStatus) as refused:
        connect(url, open_timeout=30).close()
    assert refused.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as bad:
        connect(url, additional_headers=bearer("wrong"), open_timeout=30).close()
    assert bad.value.response.status_code == 401
    # With a key (header, or the access_token query parameter browsers use), the
    # handshake succeeds and the route answers: unknown stream, closed with 4404.
    for ws_url, headers in [(url, bearer(READONLY)), (f"{url}?access_token={FULL}", {})]:
        with (
            connect(ws_url, additional_headers=headers, open_timeout=30) as ws,
            pytest.raises(ConnectionClosed) as closed,
        ):
            ws.recv(timeout=30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4404


def test_cors_preflight_and_headers_on_refusals(http: httpx.Client) -> None:
    preflight = http.options(
        "/detect",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type,x-request-deadline-ms",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    # A browser must be able to read a 401 to tell the user why.
    refused = http.get("/model", headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGIN
    other = http.options(
        "/detect",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert other.status_code == 400
    assert "access-control-allow-origin" not in other.headers
    # A Triton client in a browser sends binary tensors: its header is allowed.
    binary = http.options(
        "/v2/models/yolov8n/infer",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "inference-header-content-length,range",
        },
    )
    assert binary.status_code == 200, binary.text
    # A page reads a new job's Location, a download's file name, a clip's range: exposed.
    listed = http.get("/streams?format=yaml", headers={"Origin": ORIGIN, **bearer(FULL)})
    assert listed.status_code == 200 and "content-disposition" in listed.headers
    exposed = {
        h.strip().lower() for h in listed.headers["access-control-expose-headers"].split(",")
    }
    assert {"location", "content-disposition", "content-range", "accept-ranges"} <= set(exposed)


def test_key_check_is_exact_and_scoped() -> None:
    keys = ApiKeys(["alpha"], ["beta"])
    assert keys.check("alpha") is Access.FULL
    assert keys.check("beta") is Access.READONLY
    for guess in ("alph", "alphaa", "ALPHA", "", "beta "):
        assert keys.check(guess) is Access.NONE
    assert not ApiKeys().enabled
    assert authorize(ApiKeys(), "POST", "/streams", Headers()) is None
    ws = authorize(keys, "WEBSOCKET", "/ws/streams/x", Headers(), QueryParams("access_token=beta"))
    assert ws is None
    # The query parameter is for what browsers open without headers: WebSockets and the
    # event stream (EventSource), never for other HTTP routes.
    http_query = authorize(keys, "GET", "/model", Headers(), QueryParams("access_token=alpha"))
    assert http_query is not None and http_query.status == 401
    sse = authorize(keys, "GET", "/events", Headers(), QueryParams("access_token=beta"))
    assert sse is None
    assert authorize(keys, "GET", "/events", Headers()) is not None


def test_settings_take_comma_lists_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMDET_API_KEYS", " k1, k2 ,")
    monkeypatch.setenv("STREAMDET_CORS_ORIGINS", "https://a.example,https://b.example")
    settings = Settings()
    assert settings.api_keys == ["k1", "k2"]
    assert settings.cors_origins == ["https://a.example", "https://b.example"]
    assert "k1" not in repr(settings)


def test_grpc_needs_a_key_as_http_does(server: ServerProcess) -> None:
    """With keys set, the KServe v2 gRPC port refuses a call without a key or with an unknown
    one (UNAUTHENTICATED, saying what to send) and serves one with any configured key (it
    answered everyone)."""
    import numpy as np
    import tritonclient.grpc as triton_grpc
    from tritonclient.utils import InferenceServerException

    client = triton_grpc.InferenceServerClient(url=f"127.0.0.1:{GRPC_PORT}")
    try:
        for headers in ({}, {"authorization": "Bearer wrong-key"}):
            with pytest.raises(InferenceServerException) as refused:
                client.is_server_live(headers=headers)
            assert "UNAUTHENTICATED" in str(refused.value), refused.value
        with pytest.raises(InferenceServerException) as refused:
            client.get_model_metadata("yolov8n")
        assert "send the metadata 'authorization: Bearer <key>'" in str(refused.value)
        encoded = triton_grpc.InferInput("image_bytes", [1], "BYTES")
        encoded.set_data_from_numpy(np.array([bus()], dtype=np.object_))
        for key in (FULL, READONLY):
            result = client.infer("yolov8n", [encoded], headers={"authorization": f"Bearer {key}"})
            assert int(result.as_numpy("num_detections")[0, 0]) > 0
    finally:
        client.close()


def test_pictures_take_the_key_in_the_query_and_the_log_masks_it(
    server: ServerProcess, http: httpx.Client
) -> None:
    """A stream's ``mjpeg`` and ``latest.jpg`` are opened by ``<img src>`` and cameras'
    integrations, which send no header: they take ``?access_token=`` (they refused it), and
    the access log shows such a token masked (it wrote the key out)."""
    for route in ("/streams/nope/latest.jpg", "/streams/nope/mjpeg"):
        assert http.get(route).status_code == 401
        assert http.get(route, params={"access_token": READONLY}).status_code == 404
        assert http.head(route, params={"access_token": READONLY}).status_code == 404  # 401
        # The name percent-encoded is the same parameter to the server: masked as well.
        assert http.get(f"{route}?max_width=640&access%5Ftoken={READONLY}").status_code == 404
    assert http.get("/model", params={"access_token": FULL}).status_code == 401  # header only
    # Spellings the server does not take: refused, and the key in them masked all the same.
    for odd in ("ACCESS_TOKEN", "access-token", "accessToken"):
        assert http.get(f"/streams/nope/latest.jpg?{odd}={FULL}").status_code == 401
    assert http.get(f"/streams/nope/latest.jpg;access_token={FULL}").status_code == 401
    log = server.log_path.read_text()
    assert "access_token=***" in log and READONLY not in log and FULL not in log
    assert "access%5Ftoken=***" in log


def test_cors_lets_a_browser_put_a_stream(http: httpx.Client) -> None:
    preflight = http.options(
        "/streams/cam",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "PUT"},
    )
    assert preflight.status_code == 200, preflight.text
    assert "PUT" in preflight.headers["access-control-allow-methods"]


def test_without_keys_a_page_of_another_site_cannot_watch_or_change_anything(
    tmp_path: Path,
) -> None:
    """Keys off (the default): any web page the operator opened could watch a camera over a
    WebSocket and post a job (a multipart POST needs no preflight) through their browser.
    A call that changes something, or a WebSocket, whose Origin is another site's is 403;
    this server's own pages, the --cors-origins ones and clients sending no Origin go on."""
    from starlette.testclient import TestClient, WebSocketDenialResponse

    from tests.helpers import CAR_CLIP, file_stream_app

    evil = {"origin": "https://evil.example"}
    video = {"video": ("car.mp4", CAR_CLIP.read_bytes()[:1000], "video/mp4")}
    with TestClient(file_stream_app(tmp_path)) as c:
        sid = c.post("/streams", json={"url": f"file://{CAR_CLIP}", "enabled": False}).json()["id"]
        refused = c.post("/jobs", files=video, headers=evil)
        assert refused.status_code == 403, refused.text
        assert "STREAMDET_CORS_ORIGINS" in refused.json()["detail"]
        assert c.get("/jobs").json() == {"jobs": []}
        with (
            pytest.raises(WebSocketDenialResponse) as denied,
            c.websocket_connect(f"/ws/streams/{sid}", headers=evil),
        ):
            pass
        assert denied.value.status_code == 403
        assert c.get("/streams", headers=evil).status_code == 200  # a read: CORS's to guard
        own = {"origin": "http://testserver"}  # this server's page (TestClient's Host)
        with c.websocket_connect(f"/ws/streams/{sid}", headers=own):
            pass
        assert c.delete(f"/streams/{sid}", headers=own).status_code == 204
    allowed = file_stream_app(tmp_path, cors_origins=["https://evil.example"])
    with TestClient(allowed) as c:
        assert c.post("/jobs", files=video, headers=evil).status_code != 403


@pytest.mark.parametrize(
    ("headers", "public_url", "own"),
    [
        ({"host": "127.0.0.1:8000"}, "https://cams.example.com:443/streamdet", True),
        ({"host": "127.0.0.1:8000", "x-forwarded-host": "cams.example.com, inner"}, None, True),
        ({"host": "CAMS.example.com"}, None, True),  # TLS ended at a proxy passing Host
        ({"host": "cams.example.com:8443"}, None, False),  # another port: another origin
        ({"host": "evil.example.org"}, None, False),
    ],
)
def test_the_servers_own_pages_are_told_by_host_and_port_not_by_text(
    headers: dict[str, str], public_url: str | None, own: bool
) -> None:
    """An Origin naming the server without its default port (the browser's form), or a
    proxy chain's X-Forwarded-Host list, was refused as another site's."""
    from starlette.requests import HTTPConnection

    from server.auth import cross_site

    sent = {"origin": "https://cams.example.com", **headers}
    scope = {
        "type": "websocket",
        "scheme": "ws",
        "path": "/ws/streams/a",
        "query_string": b"",
        "headers": [(k.encode(), v.encode()) for k, v in sent.items()],
    }
    assert (cross_site(HTTPConnection(scope), (), public_url) is None) is own
