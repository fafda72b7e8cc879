"""The KServe v2 routes driven by Triton's own HTTP client (``tritonclient.http``) against a
real ``streamdet serve`` process: what a Triton user's code gets is what ``POST /detect``
answers."""

from __future__ import annotations

import asyncio
import functools
import queue
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from loadtest.server import ServerProcess, free_port
from server.images import decode_image
from tests.helpers import clip_server, ultralytics_assets

MODEL = "yolov8n"


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, grpc_port: int) -> Iterator[ServerProcess]:
    srv = clip_server(tmp_path_factory.mktemp("kserve"), grpc_port=grpc_port)
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def grpc_client(
    server: ServerProcess, grpc_port: int
) -> Iterator[triton_grpc.InferenceServerClient]:
    c = triton_grpc.InferenceServerClient(url=f"127.0.0.1:{grpc_port}")
    yield c
    c.close()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(url=server.base_url.removeprefix("http://"))
    yield c
    c.close()


def _detect(server: ServerProcess, jpeg: bytes, **query: Any) -> list[dict[str, Any]]:
    answer = httpx.post(
        f"{server.base_url}/detect",
        content=jpeg,
        headers={"content-type": "image/jpeg"},
        params=query,
        timeout=60,
    )
    answer.raise_for_status()
    found: list[dict[str, Any]] = answer.json()["detections"]
    return found


def _same(result: triton.InferResult, i: int, expected: list[dict[str, Any]]) -> None:
    n = int(result.as_numpy("num_detections")[i, 0])
    assert n == len(expected) > 0
    boxes = result.as_numpy("detection_boxes")[i, :n]
    np.testing.assert_allclose(boxes, [d["box"] for d in expected], atol=0.01)
    np.testing.assert_allclose(
        result.as_numpy("detection_scores")[i, :n], [d["confidence"] for d in expected], atol=1e-4
    )
    assert result.as_numpy("detection_classes")[i, :n].tolist() == [d["class_id"] for d in expected]
    # Padded after its own detections: zeros.
    assert not result.as_numpy("detection_scores")[i, n:].any()


def _two_encoded(
    module: Any, client: Any, server: ServerProcess, bus: bytes, zidane: bytes, request_id: str
) -> Any:
    """Two encoded images in one request through ``module``'s client (tritonclient.http or
    .grpc), answered as ``/detect`` answers each, then with ``/detect``'s parameters."""
    encoded = module.InferInput("image_bytes", [2], "BYTES")
    encoded.set_data_from_numpy(np.array([bus, zidane], dtype=np.object_))
    result = client.infer(MODEL, [encoded], request_id=request_id)
    _same(result, 0, _detect(server, bus))
    _same(result, 1, _detect(server, zidane))
    people = client.infer(MODEL, [encoded], parameters={"classes": "person", "conf": 0.5})
    _same(people, 0, _detect(server, bus, classes="person", conf=0.5))
    return result


def test_tritons_client_detects_as_detect_does(
    server: ServerProcess, client: triton.InferenceServerClient
) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata()["name"] == "streamdet"
    assert client.is_model_ready(MODEL)
    metadata = client.get_model_metadata(MODEL)
    assert [i["name"] for i in metadata["inputs"]] == ["image_bytes", "images"]
    assert [o["name"] for o in metadata["outputs"]] == [
        "num_detections",
        "detection_boxes",
        "detection_scores",
        "detection_classes",
    ]
    config = client.get_model_config(MODEL)
    assert config["max_batch_size"] >= 1 and config["dynamic_batching"]
    assert config["input"][0]["data_type"] == "TYPE_STRING"  # Triton's name for BYTES

    assets = ultralytics_assets()
    bus, zidane = ((assets / name).read_bytes() for name in ("bus.jpg", "zidane.jpg"))
    # Encoded images, two in one request, sent and answered as binary data (the default).
    result = _two_encoded(triton, client, server, bus, zidane, "r1")
    assert result.get_response()["id"] == "r1"

    # RGB pixels, with only the outputs asked for, as JSON.
    pixels = decode_image(bus, 50_000_000)
    raw = triton.InferInput("images", [1, *pixels.shape], "UINT8")
    raw.set_data_from_numpy(pixels[np.newaxis])
    asked = [
        triton.InferRequestedOutput(name, binary_data=False)
        for name in ("num_detections", "detection_boxes", "detection_scores", "detection_classes")
    ]
    as_json = client.infer(MODEL, [raw], outputs=asked)
    assert "data" in as_json.get_response()["outputs"][0]
    _same(as_json, 0, _detect(server, bus))
    # A tiny picture as JSON values: nothing in it, and the batch dimension is kept.
    blank = triton.InferInput("images", [1, 8, 8, 3], "UINT8")
    blank.set_data_from_numpy(np.zeros((1, 8, 8, 3), np.uint8), binary_data=False)
    empty = client.infer(MODEL, [blank])
    assert empty.as_numpy("num_detections").tolist() == [[0]]
    assert empty.as_numpy("detection_boxes").shape == (1, 0, 4)


def test_v2_errors_say_what_is_wrong_in_the_protocols_form(
    server: ServerProcess, client: triton.InferenceServerClient
) -> None:
    encoded = triton.InferInput("image_bytes", [1], "BYTES")
    encoded.set_data_from_numpy(np.array([b"not an image"], dtype=np.object_))
    good = triton.InferInput("image_bytes", [1], "BYTES")
    good.set_data_from_numpy(
        np.array([(ultralytics_assets() / "bus.jpg").read_bytes()], np.object_)
    )
    floats = triton.InferInput("images", [1, 4, 4, 3], "FP32")
    floats.set_data_from_numpy(np.zeros((1, 4, 4, 3), np.float32))
    second_bad = triton.InferInput("image_bytes", [2], "BYTES")
    second_bad.set_data_from_numpy(
        np.array([(ultralytics_assets() / "bus.jpg").read_bytes(), b"\xff\xd8\xff"], np.object_)
    )
    cases: list[tuple[str, Any, dict[str, Any], str]] = [
        ("other", [good], {}, "unknown model 'other'; this server serves 'yolov8n'"),
        (MODEL, [encoded], {}, "input 'image_bytes': "),
        (MODEL, [second_bad], {}, "input 'image_bytes': element 1 of 2: "),  # which one
        (MODEL, [good], {"parameters": {"classes": "unicorn"}}, "unicorn"),
        (MODEL, [good], {"parameters": {"conf": 2}}, "parameter 'conf'"),
        (MODEL, [floats], {}, "input 'images': UINT8 [N, H, W, 3], not FP32"),
        (MODEL, [good], {"outputs": [triton.InferRequestedOutput("masks")]}, "unknown output"),
    ]
    for model, inputs, extra, words in cases:
        with pytest.raises(InferenceServerException) as failed:
            client.infer(model, inputs, **extra)
        assert words in str(failed.value), str(failed.value)
    # Plain HTTP clients get the same form, with the right status.
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        assert c.get("/v2/models/other").json() == {
            "error": "unknown model 'other'; this server serves 'yolov8n'"
        }
        not_json = c.post(f"/v2/models/{MODEL}/infer", content=b"{")
        assert not_json.status_code == 400 and "not JSON" in not_json.json()["error"]
        two = c.post(f"/v2/models/{MODEL}/infer", json={"inputs": []})
        assert two.status_code == 400 and "exactly one input" in two.json()["error"]
        assert c.get("/jobs/nope").json() == {"detail": "no job 'nope'"}  # elsewhere: FastAPI's


def test_tritons_grpc_client_detects_as_detect_does(
    server: ServerProcess, grpc_client: triton_grpc.InferenceServerClient
) -> None:
    """The same service over gRPC (``--grpc-port``): metadata, config, both inputs, the
    parameters, and errors with the HTTP side's message and the matching status."""
    c = grpc_client
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready(MODEL)
    assert c.get_server_metadata(as_json=True)["name"] == "streamdet"
    metadata = c.get_model_metadata(MODEL, as_json=True)
    assert [i["name"] for i in metadata["inputs"]] == ["image_bytes", "images"]
    assert metadata["outputs"][1] == {
        "name": "detection_boxes",
        "datatype": "FP32",
        "shape": ["-1", "-1", "4"],
    }
    config = c.get_model_config(MODEL, as_json=True)["config"]
    assert int(config["max_batch_size"]) >= 1 and "yolov8n" in config["name"]
    assert config["input"][0]["data_type"] == "TYPE_STRING"
    assert "person" in config["parameters"]["names"]["string_value"]

    bus, zidane = ((ultralytics_assets() / n).read_bytes() for n in ("bus.jpg", "zidane.jpg"))
    result = _two_encoded(triton_grpc, c, server, bus, zidane, "g1")
    assert result.get_response().id == "g1"
    encoded = triton_grpc.InferInput("image_bytes", [2], "BYTES")
    encoded.set_data_from_numpy(np.array([bus, zidane], dtype=np.object_))
    pixels = decode_image(bus, 50_000_000)
    raw = triton_grpc.InferInput("images", [1, *pixels.shape], "UINT8")
    raw.set_data_from_numpy(pixels[np.newaxis])
    two = [triton_grpc.InferRequestedOutput(n) for n in ("num_detections", "detection_boxes")]
    asked = c.infer(MODEL, [raw], outputs=two)
    assert [o.name for o in asked.get_response().outputs] == ["num_detections", "detection_boxes"]
    expected = _detect(server, bus)
    assert int(asked.as_numpy("num_detections")[0, 0]) == len(expected)
    np.testing.assert_allclose(
        asked.as_numpy("detection_boxes")[0], [d["box"] for d in expected], atol=0.01
    )

    not_image = triton_grpc.InferInput("image_bytes", [1], "BYTES")
    not_image.set_data_from_numpy(np.array([b"not an image"], dtype=np.object_))
    cases: list[tuple[str, Any, dict[str, Any], str, str]] = [
        ("other", [encoded], {}, "StatusCode.NOT_FOUND", "unknown model 'other'"),
        (MODEL, [not_image], {}, "StatusCode.INVALID_ARGUMENT", "input 'image_bytes': "),
        (MODEL, [encoded], {"parameters": {"conf": 2}}, "INVALID_ARGUMENT", "parameter 'conf'"),
        (
            MODEL,
            [encoded],
            {"outputs": [triton_grpc.InferRequestedOutput("masks")]},
            "INVALID_ARGUMENT",
            "unknown output 'masks'",
        ),
    ]
    for model, inputs, extra, status, words in cases:
        with pytest.raises(InferenceServerException) as failed:
            c.infer(model, inputs, **extra)
        assert status in str(failed.value.status()) and words in failed.value.message(), str(
            failed.value
        )


def test_a_grpc_port_without_the_grpc_extra_stops_the_start_saying_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from server.cli import serve
    from server.settings import Settings

    monkeypatch.setitem(sys.modules, "grpc", None)  # as if grpcio were not installed
    before = sys.getswitchinterval()
    try:
        assert serve(Settings(grpc_port=8001, data_dir=tmp_path / "data")) == 2
    finally:
        sys.setswitchinterval(before)
    assert "STREAMDET_GRPC_PORT needs gRPC" in caplog.text and ".[grpc]" in caplog.text


def _png(width: int, height: int, mode: str = "RGB") -> bytes:
    import io

    from PIL import Image as PILImage

    out = io.BytesIO()
    PILImage.new(mode, (width, height)).save(out, format="PNG")
    return out.getvalue()


def test_a_call_of_several_images_is_run_on_an_idle_server_and_bounded_before_decoding(
    server: ServerProcess, client: triton.InferenceServerClient
) -> None:
    """A call of several images on an idle server is run (its own images counted as a queue
    ahead of it, it was refused 429 + Retry-After on every retry); one of more images than
    may wait, or whose images decode to more than twice STREAMDET_MAX_IMAGE_PIXELS
    together, is refused 413 from the headers, before any image is decoded."""
    small = _png(64, 64)
    _detect(server, small)  # the engine's figures known: admission predicts
    six = triton.InferInput("image_bytes", [6], "BYTES")
    six.set_data_from_numpy(np.array([small] * 6, dtype=np.object_))
    result = client.infer(MODEL, [six])
    assert result.as_numpy("num_detections").shape == (6, 1)
    many = triton.InferInput("image_bytes", [65], "BYTES")
    many.set_data_from_numpy(np.array([small] * 65, dtype=np.object_))
    with pytest.raises(InferenceServerException) as failed:
        client.infer(MODEL, [many])
    assert "at most 64 may wait at once (setting STREAMDET_MAX_QUEUE)" in str(failed.value)
    large = _png(6000, 6000, "L")  # 36 MP of grey: 36 kB
    three = triton.InferInput("image_bytes", [3], "BYTES")
    three.set_data_from_numpy(np.array([large] * 3, dtype=np.object_))
    with pytest.raises(InferenceServerException) as failed:
        client.infer(MODEL, [three])
    assert "108.0 MP together" in str(failed.value) and "STREAMDET_MAX_IMAGE_PIXELS" in str(
        failed.value
    )


def test_a_calls_encoded_images_are_read_in_decode_threads_not_on_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading a call's BYTES elements and its images' headers ran on the event loop: a
    PNG's text chunks are inflated as its header is read (64 crafted ones held every stream,
    viewer and /healthz 31 s), and 5 million empty elements held it 4 s before a count of
    more than 256 was refused. Both run in a decode thread, and the count is refused from
    the shape before any element is read."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from fastapi import HTTPException

    from server.images import decoded_pixels
    from server.routes import v2_tensors

    where: dict[str, str] = {}

    def noting(name: str, read: Any) -> Any:
        def run(*args: Any) -> Any:
            where[name] = threading.current_thread().name
            return read(*args)

        return run

    monkeypatch.setattr(v2_tensors, "bytes_elements", noting("elements", v2_tensors.bytes_elements))
    monkeypatch.setattr(v2_tensors, "decoded_pixels", noting("headers", decoded_pixels))
    png = _png(32, 32)
    state: Any = SimpleNamespace(
        settings=SimpleNamespace(max_image_pixels=50_000_000),
        pool=SimpleNamespace(
            engine=SimpleNamespace(input_size=640), queue=SimpleNamespace(max_interactive=64)
        ),
        decode_executor=ThreadPoolExecutor(2, thread_name_prefix="decode"),
    )

    def call(count: int) -> dict[str, Any]:
        tensor = {"name": "image_bytes", "datatype": "BYTES", "shape": [count]}
        return {"inputs": [{**tensor, "parameters": {"binary_data_size": 4 + len(png)}}]}

    async def run(count: int) -> Any:
        packed = struct.pack("<I", len(png)) + png
        return await v2_tensors.request_images(
            state, call(count), packed, asyncio.get_running_loop()
        )

    try:
        images, _ = asyncio.run(run(1))
        assert images[0][1] == (32, 32)
        assert where["elements"].startswith("decode"), where
        assert where["headers"].startswith("decode"), where
        where.clear()
        with pytest.raises(HTTPException) as refused:
            asyncio.run(run(5_000_000))
        assert refused.value.detail == "1 to 256 images a request, not 5000000"
        assert where == {}  # refused before any element was read
    finally:
        state.decode_executor.shutdown()


def test_malformed_v2_requests_are_400s_naming_what_is_wrong(server: ServerProcess) -> None:
    """Each was a plain-text 500 (the header's ``isdigit`` takes "²"; ``parameters`` not an
    object); a bad output is refused before the images are run."""
    pixel = {"name": "images", "datatype": "UINT8", "shape": [1, 1, 1, 3], "data": [0, 0, 0]}
    encoded = {"name": "image_bytes", "datatype": "BYTES", "shape": [1]}
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        url = f"/v2/models/{MODEL}/infer"
        odd = c.post(url, content=b"{}", headers={b"inference-header-content-length": b"\xb2"})
        assert odd.status_code == 400 and "not a length" in odd.json()["error"]
        long = c.post(url, content=b"{}", headers={"inference-header-content-length": "9" * 5000})
        assert long.status_code == 400 and "not a length" in long.json()["error"]  # was a 500
        assert len(long.text) < 300
        for body, words in (
            (
                {"inputs": [{**encoded, "parameters": "binary_data_size"}]},
                "input 'image_bytes': parameters must be a JSON object",
            ),
            (
                {"inputs": [pixel], "outputs": [{"name": "num_detections", "parameters": [1]}]},
                "output 'num_detections': parameters must be a JSON object",
            ),
            (
                {"inputs": [pixel], "parameters": [1]},
                "the request: parameters must be a JSON object",
            ),
            # Triton's UINT8 takes whole numbers 0-255 (1.7 and true were taken as 1)
            ({"inputs": [{**pixel, "data": [1.7, 0, 0]}]}, "a fraction among the values"),
            ({"inputs": [{**pixel, "data": [True, False, True]}]}, "true/false among"),
            ({"inputs": [{**pixel, "data": [0, 256, 0]}]}, "values from 0 to 256"),
            ({"inputs": [{**pixel, "data": None}]}, "no 'data' given (nor binary_data_size)"),
            ({"inputs": [{**pixel, "data": []}]}, "data is not UINT8: no values given"),
            ({"inputs": [{**pixel, "shape": [1, 0, 2, 3]}]}, "2x0 images have no pixels"),
            # A misspelt parameter ran the call with the default (/detect refuses it).
            ({"inputs": [pixel], "parameters": {"cof": 0.9}}, "parameter 'cof': not one"),
        ):
            bad = c.post(url, json=body)
            assert bad.status_code == 400 and words in bad.json()["error"], bad.text


def test_an_image_format_it_does_not_take_is_invalid_argument_over_grpc(
    grpc_client: triton_grpc.InferenceServerClient,
) -> None:
    """HTTP's 415, as INVALID_ARGUMENT (it was INTERNAL, a server fault)."""
    gif = triton_grpc.InferInput("image_bytes", [1], "BYTES")
    gif.set_data_from_numpy(np.array([b"GIF89a" + bytes(32)], dtype=np.object_))
    with pytest.raises(InferenceServerException) as failed:
        grpc_client.infer(MODEL, [gif])
    assert "INVALID_ARGUMENT" in str(failed.value.status())
    assert "unsupported image format GIF" in failed.value.message()


def _bus_input(module: Any) -> Any:
    encoded = module.InferInput("image_bytes", [1], "BYTES")
    encoded.set_data_from_numpy(
        np.array([(ultralytics_assets() / "bus.jpg").read_bytes()], dtype=np.object_)
    )
    return encoded


def test_a_compressed_request_is_inflated_as_triton_does(
    server: ServerProcess, client: triton.InferenceServerClient
) -> None:
    """tritonclient's request_compression_algorithm gzip and deflate (Content-Encoding): each
    was a 400 ("not UTF-8 text"); an encoding it does not take is a 415 naming those it does,
    and a body that inflates past the upload limit a 413 naming the setting."""
    plain = client.infer(MODEL, [_bus_input(triton)])
    for algorithm in ("gzip", "deflate"):
        packed = client.infer(MODEL, [_bus_input(triton)], request_compression_algorithm=algorithm)
        for name in ("num_detections", "detection_boxes", "detection_classes"):
            assert packed.as_numpy(name).tolist() == plain.as_numpy(name).tolist(), algorithm
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        url = f"/v2/models/{MODEL}/infer"
        odd = c.post(url, content=b"{}", headers={"content-encoding": "br"})
        assert odd.status_code == 415 and "gzip, deflate" in odd.json()["error"]
        broken = c.post(url, content=b"not gzip", headers={"content-encoding": "gzip"})
        assert broken.status_code == 400 and "gzip" in broken.json()["error"]
        import zlib

        bomb = zlib.compress(b" " * (60 * 1024 * 1024))  # 60 MB of spaces in 60 kB
        big = c.post(url, content=bomb, headers={"content-encoding": "deflate"})
        assert big.status_code == 413 and "STREAMDET_MAX_UPLOAD_MB" in big.json()["error"]


def test_model_ready_of_a_model_or_version_it_lacks_is_tritons_400(
    server: ServerProcess, client: triton.InferenceServerClient
) -> None:
    """GET /v2/models/{name}/ready of a model or version the server does not have is 400 with
    the protocol's error, as Triton's (it was 404, where Triton answers 400 "Model version not
    ready"); a version that is no number is Triton's 400 on every model route; what it has is
    200, and metadata of an unknown model stays Triton's 404 (NOT_FOUND)."""
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        for path in ("/v2/models/other/ready", f"/v2/models/{MODEL}/versions/2/ready"):
            answer = c.get(path)
            assert answer.status_code == 400, path
            assert "not ready" in answer.json()["error"], path
        assert "unknown model 'other'" in c.get("/v2/models/other/ready").json()["error"]
        assert c.get(f"/v2/models/{MODEL}/ready").status_code == 200
        assert c.get(f"/v2/models/{MODEL}/versions/1/ready").status_code == 200
        assert c.get("/v2/models/other").status_code == 404
        assert c.get(f"/v2/models/{MODEL}/versions/2").status_code == 404
        for path in (f"/v2/models/{MODEL}/versions/x", f"/v2/models/{MODEL}/versions/x/ready"):
            answer = c.get(path)
            assert answer.status_code == 400 and "not a number" in answer.json()["error"], path
    assert client.is_model_ready(MODEL) and not client.is_model_ready("other")


def test_repository_index_and_statistics_answer_as_tritons(
    server: ServerProcess,
    client: triton.InferenceServerClient,
    grpc_client: triton_grpc.InferenceServerClient,
) -> None:
    """get_model_repository_index and get_inference_statistics over HTTP and gRPC (a 404
    "Not Found", /v2/models/stats taken as a model named 'stats', and gRPC's UNIMPLEMENTED
    "Method not implemented!")."""
    client.infer(MODEL, [_bus_input(triton)])
    grpc_client.infer(MODEL, [_bus_input(triton_grpc)])
    entry = {"name": MODEL, "version": "1", "state": "READY", "reason": ""}
    assert client.get_model_repository_index() == [entry]
    index = f"{server.base_url}/v2/repository/index"
    assert httpx.post(index, json={"ready": True}).json() == [entry]
    refused = httpx.post(index, json={"ready": "yes"})
    assert refused.status_code == 400 and '"ready"' in refused.json()["error"]
    over_grpc_index = grpc_client.get_model_repository_index(as_json=True)
    assert over_grpc_index == {"models": [{**entry, "reason": ""}]} or over_grpc_index == {
        "models": [{k: v for k, v in entry.items() if v}]  # protobuf's JSON leaves "" out
    }
    for stats in (
        client.get_inference_statistics(MODEL),
        client.get_inference_statistics(MODEL, "1"),
        client.get_inference_statistics(),
    ):
        (model,) = stats["model_stats"]
        assert model["name"] == MODEL and model["version"] == "1"
        assert model["inference_count"] >= 2 and model["execution_count"] >= 1
        success = model["inference_stats"]["success"]
        assert success["count"] >= 2 and success["ns"] > 0
        assert model["inference_stats"]["compute_infer"]["ns"] > 0
        assert model["batch_stats"][0]["batch_size"] >= 1
    (over_grpc,) = grpc_client.get_inference_statistics(MODEL, as_json=True)["model_stats"]
    assert over_grpc["name"] == MODEL and int(over_grpc["inference_count"]) >= 2
    assert int(over_grpc["inference_stats"]["success"]["count"]) >= 2
    with pytest.raises(InferenceServerException) as failed:
        client.get_inference_statistics("other")
    assert "unknown model 'other'" in str(failed.value)
    with pytest.raises(InferenceServerException) as failed:
        grpc_client.get_inference_statistics("other")
    assert "NOT_FOUND" in str(failed.value.status())


def test_what_it_does_not_support_is_refused_saying_so(
    client: triton.InferenceServerClient, grpc_client: triton_grpc.InferenceServerClient
) -> None:
    """Shared memory, loading models, trace and log settings, and class_count (Triton's
    classification extension) are refused naming what to do instead, over HTTP and gRPC: they
    were a bare 404 "Not Found", gRPC's "Method not implemented!", a shared-memory output or
    class_count silently ignored, and a shared-memory input "data is not UINT8 ... NoneType"."""
    c, g = client, grpc_client
    refused: list[tuple[str, Any, str]] = [
        ("shm status", c.get_system_shared_memory_status, "shared memory"),
        ("shm register", lambda: c.register_system_shared_memory("r", "/k", 8), "shared memory"),
        ("shm unregister", c.unregister_system_shared_memory, "shared memory"),
        ("cuda shm status", c.get_cuda_shared_memory_status, "shared memory"),
        ("cuda register", lambda: c.register_cuda_shared_memory("r", b"h", 0, 8), "shared"),
        ("load", lambda: c.load_model(MODEL), "STREAMDET_MODEL"),
        ("unload", lambda: c.unload_model(MODEL), "STREAMDET_MODEL"),
        ("trace", c.get_trace_settings, "trace"),
        ("log", c.get_log_settings, "log"),
        ("grpc shm status", g.get_system_shared_memory_status, "shared memory"),
        ("grpc shm register", lambda: g.register_system_shared_memory("r", "/k", 8), "shared"),
        ("grpc cuda shm", g.get_cuda_shared_memory_status, "shared memory"),
        ("grpc load", lambda: g.load_model(MODEL), "STREAMDET_MODEL"),
        ("grpc unload", lambda: g.unload_model(MODEL), "STREAMDET_MODEL"),
        ("grpc trace", g.get_trace_settings, "trace"),
        ("grpc log", g.get_log_settings, "log"),
    ]
    for module, infer in ((triton, c.infer), (triton_grpc, g.infer)):
        shm_out = module.InferRequestedOutput("num_detections")
        shm_out.set_shared_memory("r", 64)
        shm_in = module.InferInput("images", [1, 8, 8, 3], "UINT8")
        shm_in.set_shared_memory("r", 192)
        classify = module.InferRequestedOutput("detection_scores", class_count=3)
        bus = _bus_input(module)
        refused += [
            ("shm output", functools.partial(infer, MODEL, [bus], outputs=[shm_out]), "shared"),
            ("shm input", functools.partial(infer, MODEL, [shm_in]), "shared memory"),
            ("class_count", functools.partial(infer, MODEL, [bus], outputs=[classify]), "class"),
        ]
    for what, call, words in refused:
        with pytest.raises(InferenceServerException) as failed:
            call()
        message = str(failed.value)
        assert words in message and "not supported" in message, (what, message)
        assert "Not Found" not in message and "Method not implemented" not in message, what


def test_grpc_streams_and_the_aio_clients_detect(
    server: ServerProcess,
    client: triton.InferenceServerClient,
    grpc_client: triton_grpc.InferenceServerClient,
    grpc_port: int,
) -> None:
    """gRPC's ModelStreamInfer (start_stream / async_stream_infer, the aio stream_infer) was
    UNIMPLEMENTED: each request is answered on the stream, its id echoed, an error in its
    error_message with the stream kept open; is_model_ready of an unknown model or version is
    False over gRPC, as over HTTP and as Triton answers (it raised NOT_FOUND); and the aio
    clients of both protocols detect as the others do."""
    expected = client.infer(MODEL, [_bus_input(triton)]).as_numpy("num_detections").tolist()
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    grpc_client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        grpc_client.async_stream_infer(MODEL, [_bus_input(triton_grpc)], request_id="s1")
        grpc_client.async_stream_infer("other", [_bus_input(triton_grpc)], request_id="s2")
        grpc_client.async_stream_infer(MODEL, [_bus_input(triton_grpc)], request_id="s3")
        got = [answers.get(timeout=60) for _ in range(3)]
    finally:
        grpc_client.stop_stream()
    results = {r.get_response().id: r for r, e in got if e is None}
    errors = [e for r, e in got if e is not None]
    assert sorted(results) == ["s1", "s3"]
    assert results["s1"].as_numpy("num_detections").tolist() == expected
    assert len(errors) == 1 and "unknown model 'other'" in errors[0].message()
    # An error carries its request's id, as Triton's do (tritonclient drops it; a client of
    # the stubs matches its answers by it).
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        junk = service_pb2.ModelInferRequest(model_name=MODEL, id="junk-1")
        junk.inputs.add(name="image_bytes", datatype="BYTES", shape=[1])
        junk.raw_input_contents.append(struct.pack("<I", 4) + b"junk")
        [reply] = list(stub.ModelStreamInfer(iter([junk]), timeout=60))
    assert "not a decodable image" in reply.error_message, reply.error_message
    assert reply.infer_response.id == "junk-1"
    # A message that is no ModelInferRequest: what came before it is answered, then the
    # stream ends saying so (it stayed open and silent for good, past the client's deadline).
    bus = (ultralytics_assets() / "bus.jpg").read_bytes()
    good = service_pb2.ModelInferRequest(model_name=MODEL, id="good-1")
    good.inputs.add(name="image_bytes", datatype="BYTES", shape=[1])
    good.raw_input_contents.append(struct.pack("<I", len(bus)) + bus)

    def messages() -> Iterator[bytes]:
        yield good.SerializeToString()
        time.sleep(0.5)  # read after the first: its answer comes first
        yield b"\xff\xff\xff\xff\x0f not a protobuf message"
        yield good.SerializeToString()

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        raw = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=lambda b: b,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString,
        )
        answered: list[str] = []

        def read_all() -> None:
            answered.extend(answer.infer_response.id for answer in raw(messages(), timeout=60))

        with pytest.raises(grpc.RpcError) as ended:
            read_all()
    assert answered == ["good-1"]
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ended.value
    assert "a message of the stream is not a ModelInferRequest" in str(ended.value.details())
    assert not grpc_client.is_model_ready("other") and not grpc_client.is_model_ready(MODEL, "2")

    import tritonclient.grpc.aio as grpc_aio
    import tritonclient.http.aio as http_aio

    async def both() -> None:
        h = http_aio.InferenceServerClient(server.base_url.removeprefix("http://"))
        g = grpc_aio.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            assert await h.is_model_ready(MODEL) and await g.is_model_ready(MODEL)
            assert (await h.get_model_repository_index())[0]["name"] == MODEL
            assert (await g.get_inference_statistics(MODEL, as_json=True))["model_stats"]
            found = await h.infer(MODEL, [_bus_input(http_aio)], request_id="h1")
            assert found.get_response()["id"] == "h1"
            assert found.as_numpy("num_detections").tolist() == expected
            packed = await h.infer(
                MODEL, [_bus_input(http_aio)], request_compression_algorithm="gzip"
            )
            assert packed.as_numpy("num_detections").tolist() == expected
            found = await g.infer(MODEL, [_bus_input(grpc_aio)], request_id="g1")
            assert found.as_numpy("num_detections").tolist() == expected

            async def requests() -> Any:
                for i in range(2):
                    yield {
                        "model_name": MODEL,
                        "inputs": [_bus_input(grpc_aio)],
                        "request_id": f"a{i}",
                    }

            ids = []
            async for result, error in g.stream_infer(requests()):
                assert error is None, error
                assert result.as_numpy("num_detections").tolist() == expected
                ids.append(result.get_response().id)
                if len(ids) == 2:
                    break
            assert sorted(ids) == ["a0", "a1"]
        finally:
            await h.close()
            await g.close()

    asyncio.run(both())


def _alone_ms(server: ServerProcess) -> float:
    """Milliseconds one image took in its batch so far (``/metrics``), after one call."""
    assert _detect(server, (ultralytics_assets() / "bus.jpg").read_bytes())
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    sums = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith(("streamdet_batch_duration_seconds_sum", "streamdet_batch_size_sum"))
    }
    return 1000 * sums["streamdet_batch_duration_seconds_sum"] / sums["streamdet_batch_size_sum"]


def test_a_deadline_no_retry_can_meet_is_deadline_exceeded_not_busy(
    server: ServerProcess,
    grpc_client: triton_grpc.InferenceServerClient,
    client: triton.InferenceServerClient,
) -> None:
    """A gRPC deadline shorter than one image takes alone, on an idle server, is
    ``DEADLINE_EXCEEDED`` naming the deadline to raise (it was ``RESOURCE_EXHAUSTED``
    "server busy ... retry after 1 s", which no retry could meet); Triton's ``timeout``
    request parameter (microseconds) is that call's deadline too, over gRPC and HTTP (it was
    ignored: 1 µs ran), and a longer one runs."""
    alone_ms = _alone_ms(server)
    with pytest.raises(InferenceServerException) as refused:
        # Half the image's own time: the server's answer, not the client's own expiry.
        grpc_client.infer(MODEL, [_bus_input(triton_grpc)], client_timeout=alone_ms / 2000)
    assert refused.value.status() == "StatusCode.DEADLINE_EXCEEDED", refused.value
    assert "no retry can meet it: raise the call's gRPC deadline" in refused.value.message()
    with pytest.raises(InferenceServerException) as timed:
        grpc_client.infer(MODEL, [_bus_input(triton_grpc)], timeout=1)
    assert timed.value.status() == "StatusCode.DEADLINE_EXCEEDED", timed.value
    assert "raise the request's timeout parameter" in timed.value.message()
    with pytest.raises(InferenceServerException) as over_http:
        client.infer(MODEL, [_bus_input(triton)], timeout=1000)
    assert over_http.value.status() == "504", over_http.value
    assert "raise the request's timeout parameter" in over_http.value.message()
    for module, c in ((triton_grpc, grpc_client), (triton, client)):
        ran = c.infer(MODEL, [_bus_input(module)], timeout=60_000_000)
        assert int(ran.as_numpy("num_detections")[0, 0]) > 0
        none = c.infer(MODEL, [_bus_input(module)], timeout=0)  # 0: none, as in Triton
        assert int(none.as_numpy("num_detections")[0, 0]) > 0


@pytest.mark.parametrize(
    "timeout", [-1, 1.5, "1000", True, 2**64, 10**309], ids=lambda v: repr(v)[:12]
)
def test_a_malformed_timeout_parameter_is_a_400_naming_it(
    server: ServerProcess, timeout: object
) -> None:
    pixels = {"name": "images", "datatype": "UINT8", "shape": [1, 2, 2, 3], "data": [0] * 12}
    request = {"inputs": [pixels], "parameters": {"timeout": timeout}}
    answer = httpx.post(f"{server.base_url}/v2/models/{MODEL}/infer", json=request, timeout=60)
    assert answer.status_code == 400, answer.text
    assert "parameter 'timeout': whole microseconds" in answer.json()["error"]
