"""What the app holds while it runs, reachable from every route."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starlette.requests import HTTPConnection

from engines.pool import EnginePool
from server.jobs import JobManager
from server.settings import Settings
from server.snapshots import SnapshotStore
from server.webhook_store import WebhookStore
from server.webhooks import Webhooks
from streams.manager import StreamManager


@dataclass
class AppState:
    settings: Settings
    pool: EnginePool
    decode_executor: ThreadPoolExecutor
    shutting_down: bool = False
    streams: StreamManager | None = None
    snapshots: SnapshotStore | None = None
    webhooks: Webhooks | None = None
    webhook_store: WebhookStore | None = None
    jobs: JobManager | None = None

    @property
    def ready(self) -> bool:
        return self.pool.ready and not self.shutting_down


def get_state(conn: HTTPConnection) -> AppState:
    state: AppState = conn.app.state.streamdet
    return state
