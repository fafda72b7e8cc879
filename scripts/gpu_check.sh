#!/usr/bin/env bash
# The GPU check: one prepared run on a CUDA machine, under 5 minutes on an H200.
#
#   bash scripts/gpu_check.sh prepare   # here, on a CPU machine that reaches PyPI: puts the
#                                       # wheels the GPU image lacks in .whl/ and the model,
#                                       # clips and CPU-engine reference boxes in .gpu/
#   bash scripts/gpu_check.sh           # on the GPU machine (carry .whl and .gpu): installs
#                                       # the wheels offline, runs the GPU tests and the bench
#                                       # (GPU_CHECK_TESTS=0: the bench alone, for a rerun)
#
# The bench writes <date>-<gpu>-gpu.json (parity with the CPU engine, engine-only and
# end-to-end img/s, GPU busy %, frame latency p50/p99; last, 1080p cameras decoded at the
# engine's size and whole) and host-bench.json (the server's own
# CPU per frame, benchmarks/host_bench.py) into $OUT if set, else benchmarks/results/. The
# GPU image is assumed to hold Python 3.12, torch (CUDA), numpy, opencv, pillow, pyyaml,
# nvidia-ml-py and pytest; PyAV and Ultralytics travel as wheels.
#
#   bash scripts/gpu_check.sh rehearse  # here, before spending device time: the same run on the
#                                       # CPU, in a venv holding only the GPU image's packages
#                                       # (its list: the device tool's KINDS.md) with this
#                                       # checkout's torch linked in: a module the image lacks
#                                       # (fastapi, pydantic, polars, ...) fails here, not there
#
# CI runs the bench harness on the CPU too (tests/test_gpu_bench.py). What travels (.whl, .gpu
# and the checkout) is about 63 MB of the device tool's 64 MiB (67 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${STREAMDET_SHARED_DIR:-../shared}

if [ "${1:-run}" = prepare ]; then
  PY=${PY:-.venv/bin/python}
  pins=()
  for dist in av ultralytics; do
    pins+=("$dist==$("$PY" -c "from importlib.metadata import version; print(version('$dist'))")")
  done
  rm -rf .whl && mkdir -p .whl .gpu/models .gpu/videos
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
  install -m 0644 "$SHARED/models/yolov8n.pt" "$SHARED/models/yolov8n.torchscript" .gpu/models/
  install -m 0644 "$SHARED"/videos/*.mp4 .gpu/videos/
  # A 1080p camera (8 s of the car clip, H.264, a keyframe a second, 1.4 MB) for the bench's
  # last phase: frames decoded at the engine's size against whole (gpu_bench camera_saturation).
  mkdir -p .gpu/camera
  "$PY" -m benchmarks.make_clip --clip "$SHARED/videos/car-detection.mp4" \
    --out .gpu/camera/car-1080p.mp4 --frames 100
  "$PY" -m benchmarks.gpu_bench prepare --data .gpu
  rm -rf .gpu/cache  # the ONNX export only served the reference; it need not travel
  du -sh .whl .gpu
  exit 0
fi

if [ "${1:-run}" = rehearse ]; then
  PY=${PY:-.venv/bin/python}
  [ -f .gpu/cpu_reference.json ] && [ -d .whl ] || bash "$0" prepare
  venv=${REHEARSE_VENV:-/tmp/streamdet-rehearse}
  if [ ! -x "$venv/bin/python" ]; then
    base=$("$PY" -c 'import sys; print(sys._base_executable)')
    "$base" -m venv "$venv"
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    own=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    mkdir -p "$venv/torch-farm"
    # The packages and their metadata (Ultralytics reads torchvision's version from it).
    for entry in "$site"/{torch,torchvision,torchgen,functorch,nvidia,cuda,triton,sympy,mpmath} \
      "$site"/{networkx,jinja2,markupsafe,filelock,fsspec,typing_extensions}* \
      "$site"/{torch,torchvision,triton,sympy,mpmath}-*.dist-info \
      "$site"/nvidia_[cn]*.dist-info "$site"/cuda_*.dist-info; do
      [ -e "$entry" ] && ln -sfn "$entry" "$venv/torch-farm/"
    done
    echo "$venv/torch-farm" >"$own/torch-farm.pth"
    "$venv/bin/python" -m pip install -q numpy opencv-python-headless pillow pyyaml matplotlib \
      scipy requests psutil pytest nvidia-ml-py
  fi
  PATH="$venv/bin:$PATH" GPU_CHECK_DEVICE=cpu GPU_CHECK_SITE=/tmp/streamdet-rehearse-site \
    OUT=${OUT:-/tmp/streamdet-rehearse-out} \
    GPU_CHECK_BENCH="--streams 4 --fps 5 --seconds 3 --engine-seconds 0.5 --max-batch 4 --nvdec-too --decode-seconds 1 --decode-processes 2" \
    GPU_CHECK_HOST="--streams 4 --fps 0 --decode-processes 1 --warmup 1 --seconds 2" \
    bash "$0" run
  exit $?
fi

device=${GPU_CHECK_DEVICE:-cuda}
site_dir=${GPU_CHECK_SITE:-/tmp/streamdet-site}
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site_dir" .whl/*.whl
export PYTHONPATH="$site_dir:$PWD" PYTHONUNBUFFERED=1 STREAMDET_GPU_TEST_DEVICE=$device
export STREAMDET_SHARED_DIR="$PWD/.gpu" YOLO_OFFLINE=true YOLO_AUTOINSTALL=false
out_dir=${OUT:-benchmarks/results}
mkdir -p "$out_dir"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
df -h /dev/shm || true  # decode processes hand frames over there
python3 -c "import torch, av; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'gpu', torch.cuda.is_available() and torch.cuda.get_device_name(0), 'pyav', av.__version__)"
# -c /dev/null: the project's pytest config names plugins (pytest-asyncio) the GPU image lacks.
# A test that hangs must not hide the others' results: a per-test limit where the image has
# pytest-timeout, and a summary line per failure (-ra), whole, in the log.
per_test=()
python3 -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout 75)
# GPU_CHECK_TESTS=0 skips them: a rerun of the bench alone fits what is left of a device budget.
tests_rc=0
if [ "${GPU_CHECK_TESTS:-1}" != 0 ]; then
  set +e
  # SIGINT, not TERM, at the limit: pytest stops as on Ctrl-C and still prints its summary.
  timeout -s INT -k 10 170 python3 -m pytest -q -ra --tb=short -c /dev/null -p no:cacheprovider --rootdir . \
    "${per_test[@]}" tests/test_gpu_cuda.py 2>&1 | tee "$out_dir/gpu-pytest.log"
  tests_rc=${PIPESTATUS[0]}
  set -e
fi
# Its log comes back whole in gpu-bench.log (the device call keeps only the output's last
# 12,000 characters: the last run's NVDEC failure reasons were lost so).
set +e
# shellcheck disable=SC2086  # GPU_CHECK_BENCH is a list of flags
timeout -s INT -k 10 240 python3 -m benchmarks.gpu_bench run --data .gpu --out-dir "$out_dir" \
  --device "$device" \
  ${GPU_CHECK_BENCH:---streams 32 --fps 30 --seconds 10 --engine-seconds 3 --nvdec-too} \
  2>&1 | tee "$out_dir/gpu-bench.log"
bench_rc=${PIPESTATUS[0]}
set -e
# The server's own Python per frame beside a null engine, on this host's cores: the frames/s
# the server path passes whatever the GPU (benchmarks/host_bench.py; about 15 s).
# Only where it still fits the device call's 480 s with the tests and the bench at their limits.
if [ $(( $(date +%s) - start )) -lt 410 ]; then
  # shellcheck disable=SC2086  # GPU_CHECK_HOST is a list of flags
  timeout 60 python3 -m benchmarks.host_bench --out "$out_dir/host-bench.json" \
    ${GPU_CHECK_HOST:---streams 32 --fps 0 --decode-processes 8 --infer-ms 4 --seconds 8} \
    || echo "host bench failed (exit $?)"
else
  echo "host bench skipped: $(( $(date +%s) - start )) s gone"
fi
echo "gpu tests exit $tests_rc; gpu bench exit $bench_rc; total $(( $(date +%s) - start )) s"
if [ "$tests_rc" != 0 ]; then exit "$tests_rc"; fi
exit "$bench_rc"
