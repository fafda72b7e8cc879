"""The seed design the benchmark compares against: a FastAPI handler that calls
Ultralytics' predictor directly, the usual first attempt. Run by ``streamdet bench``."""

from __future__ import annotations

import os
import threading
from typing import Any

import cv2
import numpy as np
from fastapi import FastAPI, File, UploadFile

os.environ.setdefault("YOLO_OFFLINE", "true")
os.environ.setdefault("YOLO_AUTOINSTALL", "false")
os.environ.setdefault("YOLO_VERBOSE", "false")


def create_seed_app(model_path: str, imgsz: int) -> FastAPI:
    from ultralytics import YOLO

    model = YOLO(model_path)
    lock = threading.Lock()  # the predictor is not thread-safe
    app = FastAPI()

    @app.post("/detect")
    def detect(image: UploadFile = File(...)) -> dict[str, Any]:  # noqa: B008
        data = np.frombuffer(image.file.read(), np.uint8)
        frame = cv2.imdecode(data, cv2.IMREAD_COLOR)
        with lock:
            result = model.predict(frame, imgsz=imgsz, verbose=False)[0]
        boxes = result.boxes
        return {
            "detections": [
                {"box": b, "confidence": c, "class_id": int(k)}
                for b, c, k in zip(
                    boxes.xyxy.tolist(), boxes.conf.tolist(), boxes.cls.tolist(), strict=True
                )
            ]
        }

    @app.get("/readyz")
    def readyz() -> dict[str, str]:
        return {"status": "ready"}

    return app


def main() -> None:
    import uvicorn

    app = create_seed_app(os.environ["SEED_MODEL"], int(os.environ.get("SEED_IMGSZ", "640")))
    uvicorn.run(app, host="127.0.0.1", port=int(os.environ["SEED_PORT"]), log_level="warning")


if __name__ == "__main__":
    main()
