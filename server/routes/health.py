"""Liveness, readiness and model description."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from server.state import get_state

router = APIRouter()


# HEAD too: some load balancers' and uptime checkers' probes send it (it was 405).
@router.get("/healthz")
@router.head("/healthz", include_in_schema=False)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
@router.head("/readyz", include_in_schema=False)
async def readyz(request: Request) -> JSONResponse:
    state = get_state(request)
    if state.ready:
        return JSONResponse({"status": "ready", "model": state.pool.engine.model_name})
    return JSONResponse({"status": "not ready"}, status_code=503, headers={"Retry-After": "1"})


@router.get("/model")
async def model(request: Request) -> dict[str, Any]:
    state = get_state(request)
    engine = state.pool.engine
    return {
        "model": engine.model_name,
        "backend": state.settings.backend,
        "input_size": engine.input_size,
        "max_batch": engine.max_batch,
        "names": {str(k): v for k, v in engine.names.items()},
    }
