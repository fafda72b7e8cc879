# Two commands for a fresh clone: `make serve` and `make test`. Each installs what is missing.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
SHARED ?= ../shared
MODEL ?= $(SHARED)/models/yolov8n.pt
STAMP := $(VENV)/.installed

.PHONY: install serve test lint typecheck unit bench clean system-deps loadtest gpu-check int8-report

$(PY):
	python3 -m venv $(VENV)

# Reinstall only when the project's dependencies change.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/streamdet serve --model $(MODEL) $(ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: install
	$(VENV)/bin/mypy

# Two pytest workers (pytest-xdist), a test file each at a time: most tests wait on servers,
# cameras and browsers, so two share 2 cores well (21.5 min serially, 14.3 with two, on CI's
# machine). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
unit: install
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# System packages for the RTSP camera tests and the browser tests (Debian).
system-deps:
	bash scripts/system-deps.sh

test: system-deps install lint typecheck unit loadtest

# Locust against a real server; exits 1 when a P99/error/goodput target of the profile is missed.
loadtest: install
	$(VENV)/bin/streamdet loadtest --profile $(or $(PROFILE),cpu-ci) --model $(MODEL) $(ARGS)

# GPU check: `make gpu-check ARGS=prepare` here, then `make gpu-check` on the GPU machine.
gpu-check:
	bash scripts/gpu_check.sh $(ARGS)

bench: install
	$(VENV)/bin/streamdet bench --model $(MODEL) $(ARGS)

# INT8 Q/DQ artifact calibrated on the shared clips, plus its accuracy/speed
# report vs FP32 on three disjoint sets of 150 held-out frames (exits 3 when any set is below
# recall/precision 0.95). ARGS="--target cpu" for ORT's INT8.
int8-report: install
	$(VENV)/bin/streamdet export --model $(MODEL) --precision int8 --calib $(SHARED)/videos/*.mp4 \
	  --out $(or $(OUT),.cache/yolov8n-int8.onnx) --eval-frames 150 --eval-sets 3 \
	  --report .cache/int8-report.json $(ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
