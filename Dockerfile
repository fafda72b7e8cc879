# streamdet GPU image: CUDA runtime + TensorRT (from the `gpu` extra) + PyTorch, running
# `streamdet serve` as a non-root user. Build: docker build -t streamdet:gpu .
# Run:   docker run --gpus all --shm-size 2g -p 8000:8000 -v streamdet-cache:/cache \
#          -v /path/to/models:/models:ro streamdet:gpu --model /models/yolov8n.pt
# (--shm-size: decode processes hand frames over in /dev/shm, 5.3 MB per camera at the default
# decode size of 640 pixels, 47.5 MB per 1080p one with STREAMDET_STREAM_DECODE_SIZE=0; where
# it is too small for 5 such cameras the server decodes in its own process, slower beside the
# GPU engine, and says so in its log.)
# Exported ONNX files and built TensorRT engines (keyed by GPU and TensorRT version) are
# cached on the /cache volume, so a restart on the same GPU skips the minutes-long build.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/streamdet
ENV PATH=/opt/streamdet/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY engines engines
COPY streams streams
COPY server server
COPY loadtest loadtest
# PyPI's torch wheels for Linux carry their own CUDA libraries; TensorRT comes with the gpu
# extra, Triton's gRPC service with the grpc one. pycuda is not used: device buffers and
# streams come from torch. The project itself is the local source (versions are bounded in
# pyproject.toml), hence no == pin here.
# hadolint ignore=DL3013
RUN pip install ".[gpu,grpc]"

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# libgl1/libglib2.0-0: OpenCV (pulled by Ultralytics) loads them at import.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libgl1 libglib2.0-0 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 streamdet \
 && useradd --system --uid 10001 --gid 10001 --home-dir /cache --shell /usr/sbin/nologin streamdet \
 && mkdir -p /cache /models \
 && chown 10001:10001 /cache
COPY --from=build /opt/streamdet /opt/streamdet
ENV PATH=/opt/streamdet/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    YOLO_OFFLINE=true \
    YOLO_AUTOINSTALL=false \
    YOLO_CONFIG_DIR=/cache/ultralytics \
    STREAMDET_CACHE_DIR=/cache \
    STREAMDET_DATA_DIR=/cache/data \
    STREAMDET_HOST=0.0.0.0 \
    STREAMDET_PORT=8000 \
    STREAMDET_BACKEND=tensorrt \
    STREAMDET_DEVICE=cuda \
    STREAMDET_MAX_BATCH=32 \
    STREAMDET_WORKERS=2
VOLUME ["/cache"]
USER 10001:10001
WORKDIR /cache
# 8001: KServe v2 gRPC, served when STREAMDET_GRPC_PORT=8001 is set.
EXPOSE 8000 8001
# Ready = model loaded and warmed (engine builds on first start can take minutes).
HEALTHCHECK --interval=15s --timeout=3s --start-period=600s --retries=3 \
  CMD ["python3", "-m", "server.healthcheck"]
ENTRYPOINT ["streamdet", "serve"]
