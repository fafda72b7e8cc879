"""The KServe v2 routes driven by Triton's own HTTP client (``tritonclient.http``) against a
real ``streamdet serve`` process: what a Triton user's code gets is what ``POST /detect``
answers."""

from __future__ import annotations

import sys
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
    cases: list[tuple[str, Any, dict[str, Any], str]] = [
        ("other", [good], {}, "unknown model 'other'; this server serves 'yolov8n'"),
        (MODEL, [encoded], {}, "input 'image_bytes': "),
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


def test_malformed_v2_requests_are_400s_naming_what_is_wrong(server: ServerProcess) -> None:
    """Each was a plain-text 500 (the header's ``isdigit`` takes "²"; ``parameters`` not an
    object); a bad output is refused before the images are run."""
    pixel = {"name": "images", "datatype": "UINT8", "shape": [1, 1, 1, 3], "data": [0, 0, 0]}
    encoded = {"name": "image_bytes", "datatype": "BYTES", "shape": [1]}
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        url = f"/v2/models/{MODEL}/infer"
        odd = c.post(url, content=b"{}", headers={b"inference-header-content-length": b"\xb2"})
        assert odd.status_code == 400 and "not a length" in odd.json()["error"]
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
