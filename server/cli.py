"""``streamdet`` command line: ``serve``, ``analyze``, ``bench``, ``export`` and
``evaluate``."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import logging
import math
import os
import signal
import socket
import sqlite3
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import ValidationError

from engines.types import EngineError
from server.data_dir import DataDirLock, data_dir_problems, table_columns
from server.settings import Settings, public_url_mismatch, unknown_env_settings

log = logging.getLogger("streamdet")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
SECRET_FLAGS = ("api_keys", "api_keys_readonly", "webhook_secret", "mqtt_url")
"""Settings that hold a secret (``mqtt_url``: where it has a password)."""


def configure_logging(level: str) -> None:
    """One format for every line, ours and uvicorn's (its access lines had no time)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)
    # httpx logs each request's URL at INFO: a webhook's or a job callback's holds its
    # token (path, query, user:password@), written out with every event sent. Our own
    # lines say how each delivery went, without it.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def warn_secret_flags(args: argparse.Namespace) -> None:
    """A secret given as a flag is in the process's command line, which every user of the
    machine reads (``ps``, ``/proc/<pid>/cmdline``): say so, and which variable to use."""
    for name in SECRET_FLAGS:
        value = getattr(args, name, None)
        if not value or (name == "mqtt_url" and "@" not in value):
            continue
        log.warning(
            "--%s is given on the command line, which every user of this machine can read"
            " (ps): set STREAMDET_%s in the environment instead",
            name.replace("_", "-"),
            name.upper(),
        )


def _add_settings_flags(
    parser: argparse.ArgumentParser, skip: frozenset[str] = frozenset()
) -> None:
    """One flag per setting, named like the setting (``max_batch`` -> ``--max-batch``), but
    those in ``skip`` (settings the command never uses: no flag is better than one ignored)."""
    for name, field in Settings.model_fields.items():
        if name in skip:
            continue
        default = "" if field.default_factory else f"; default {field.default}"
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=None,
            help=f"{field.description or name} (env STREAMDET_{name.upper()}{default})",
        )


def settings_from_args(args: argparse.Namespace, unused: frozenset[str] = frozenset()) -> Settings:
    """The settings of a command: its flags over ``STREAMDET_*`` variables, those of the
    ``unused`` settings left out (``analyze`` has no port: STREAMDET_PORT=99999 refused it
    with "--port: ...", a flag it has not, and STREAMDET_DECODE=cuda a job on the CPU)."""
    given: dict[str, Any] = {
        name: getattr(args, name)
        for name in Settings.model_fields
        if getattr(args, name, None) is not None
    }
    hidden = {
        key: os.environ.pop(key)
        for key in list(os.environ)
        if key.upper().startswith("STREAMDET_") and key[10:].lower() in unused
    }
    try:
        return Settings(**given)
    finally:
        os.environ.update(hidden)


def _hup_before_ready(sig: int, frame: FrameType | None) -> None:
    log.warning(
        "SIGHUP: the server is still starting, nothing to reload yet (the streams file is"
        " read as it starts)"
    )


def _ignore_early_hup() -> Any:
    """Log and ignore SIGHUP until the app installs its reload handler (server/app.py, once
    the model has loaded): its default action killed a server still loading its model
    (exit 129), e.g. when a config-management tool reloaded right after starting it.
    Returns the handler it replaced (None where signals cannot be set: not the main
    thread)."""
    try:
        return signal.signal(signal.SIGHUP, _hup_before_ready)
    except (ValueError, AttributeError):  # not the main thread; no SIGHUP (Windows)
        return None


def _warn_unknown_env() -> None:
    for variable, close in unknown_env_settings(os.environ):
        hint = f"; did you mean {close}?" if close else ""
        log.warning("environment variable %s is not a setting and is ignored%s", variable, hint)


ANALYZED = frozenset(
    {
        "model",
        "backend",
        "device",
        "imgsz",
        "max_batch",
        "max_wait_ms",
        "workers",
        "threads_per_worker",
        "cache_dir",
        "max_queue",
        "max_image_pixels",
        "stream_decode_size",
        "job_inflight",
        "shutdown_timeout_s",
        "log_level",
    }
)
"""The settings ``streamdet analyze`` uses (the engine's, and a job's decode)."""

WRITE_CHECK_BYTES = 256 * 1024
"""What the data directory's check writes: about what the stores write as they open."""


def file_in_the_way(path: Path) -> str | None:
    """Why ``path`` can never be a directory (it, or the first of its parents that exists, is
    a file), or None."""
    for where in (path, *path.parents):
        if where.exists():
            return None if where.is_dir() else f"{where} is a file, not a directory"
    return None


def unusable_dir(path: Path) -> str | None:
    """Why ``path`` cannot be a directory this process writes into (it is made if missing),
    or None if it can. Checked before the model loads: the stores opened later failed with
    a raw traceback naming no setting. Some data is written and synced: a full disk creates
    an empty file all the same (the event store's first write then failed the start)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".streamdet-write-check-") as probe:
            probe.write(bytes(WRITE_CHECK_BYTES))
            probe.flush()
            os.fsync(probe.fileno())
    except FileExistsError:  # mkdir's word for "a file is there"
        return "a file, not a directory"
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _api_streams(data_dir: Path, declared: set[str]) -> int:
    """Streams the data dir keeps that were added through the API and are not among the
    ``declared`` ids; read only (a database that is not streamdet's is named later)."""
    path = data_dir / "streams.sqlite3"
    if not path.is_file():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            columns = table_columns(db, "streams")
            query = (
                "SELECT id, from_file FROM streams"
                if "from_file" in columns
                else ("SELECT id, 0 FROM streams")
            )
            rows = db.execute(query).fetchall()
    except sqlite3.Error:
        return 0
    return sum(1 for sid, from_file in rows if not from_file and sid not in declared)


def check_streams_file(
    path: Path,
    environ: Mapping[str, str],
    names: Mapping[int, str] | None = None,
    settings: Settings | None = None,
) -> list[str]:
    """What is wrong with the streams file at ``path``, one line each (empty if nothing):
    its syntax, ids and ``${VAR}``s, and each entry against ``POST /streams``' body model, so a
    misspelt key fails before the model loads; with ``settings``, its sources (a file outside
    ``--allowed-file-dir``, a bad port or scheme) and its count against ``--max-streams``; with
    the model's class ``names``, its classes and regions too (each failed the app's start
    with a traceback)."""
    from fastapi import HTTPException

    from server.routes.streams import StreamIn
    from server.streams_file import StreamsFileError, read_entries
    from streams.detect import StreamDetect
    from streams.sources import SourceError, parse_source

    try:
        entries = read_entries(path, environ)
    except StreamsFileError as exc:
        return [f"cannot start: {exc}"]
    problems = []
    if settings is not None and len(entries) > settings.max_streams:
        problems.append(
            f"--streams-file: {path}: {len(entries)} streams, over the limit"
            f" {settings.max_streams} (setting STREAMDET_MAX_STREAMS)"
        )
    elif settings is not None:
        # With those added through the API (kept in the data dir): the start failed once the
        # model had loaded, with a traceback (exit 3).
        api = _api_streams(settings.data_dir, {str(e.get("id")) for e in entries})
        if len(entries) + api > settings.max_streams:
            problems.append(
                f"--streams-file: {path}: {len(entries)} streams and {api} added through the"
                f" API are more than {settings.max_streams} (setting STREAMDET_MAX_STREAMS):"
                " raise it, or delete streams"
            )
    for entry in entries:
        try:
            body = StreamIn.model_validate(entry)
            if settings is not None:
                parse_source(body.url, settings.allowed_file_dir, body.transport, body.loop)
            if names is not None:
                body.detect(names, StreamDetect())
        except SourceError as exc:  # its message masks the URL's secrets
            problems.append(
                f"--streams-file: {path}: stream {entry['id']!r}: url: {exc}"
                " (setting STREAMDET_STREAMS_FILE)"
            )
        except HTTPException as exc:  # a class the model lacks, a bad region
            problems.append(
                f"--streams-file: {path}: stream {entry['id']!r}: {exc.detail}"
                " (setting STREAMDET_STREAMS_FILE)"
            )
        except ValidationError as exc:
            for error in exc.errors():
                field = ".".join(str(p) for p in error["loc"]) or "entry"
                message = error["msg"].removeprefix("Value error, ")
                if error["type"] == "extra_forbidden":
                    keys = StreamIn.model_fields if len(error["loc"]) == 1 else {}
                    close = difflib.get_close_matches(str(error["loc"][-1]), keys, n=1)
                    hint = f"; did you mean {close[0]}?" if close else ""
                    what = "not a stream setting" if len(error["loc"]) == 1 else "unknown key"
                    message = f"{what}{hint}"
                problems.append(
                    f"--streams-file: {path}: stream {entry['id']!r}: {field}: {message}"
                    " (setting STREAMDET_STREAMS_FILE)"
                )
    return problems


def serve(settings: Settings) -> int:
    """Run the server until it is stopped; the exit status (2: a setting is wrong)."""
    previous_hup = _ignore_early_hup()  # first: loading the model takes seconds
    lock = DataDirLock(settings.data_dir)
    try:
        if (holder := lock.acquire()) is not None:
            print(
                f"streamdet: --data-dir: {settings.data_dir}: in use by another streamdet server"
                f" ({holder}); give each server a data dir of its own (setting"
                " STREAMDET_DATA_DIR)",
                file=sys.stderr,
            )
            return 2
        return _serve(settings)
    finally:
        lock.release()
        if previous_hup is not None:
            signal.signal(signal.SIGHUP, previous_hup)


HOST_ERRNOS = frozenset({errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT})
"""Bind errors that are the host's (an address this machine lacks), not the port's."""


def port_taken(host: str, port: int) -> tuple[bool, str] | None:
    """Why ``host:port`` cannot be listened on (another server holds it, an address this
    machine lacks), and whether the host is at fault (not the port); None if it can. Bound as
    uvicorn binds (``SO_REUSEADDR``: a port left in TIME_WAIT is free); a listener, with or
    without ``SO_REUSEPORT``, refuses it."""
    if not host:
        return True, "no host given"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        return True, f"cannot resolve the host: {exc}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            return exc.errno in HOST_ERRNOS, f"cannot listen there: {exc.strerror or exc}"
    return None


def _cannot_listen(settings: Settings, flag: str, host_fault: bool, why: str) -> int:
    """Say why the server cannot listen on ``--flag``'s port, naming the setting; exit 2."""
    port = settings.grpc_port if flag == "grpc-port" else settings.port
    named = "host" if host_fault else flag  # it named the port for a host it lacks
    setting = named.replace("-", "_").upper()
    print(
        f"streamdet: --{named}: {settings.host}:{port}: {why} (setting STREAMDET_{setting})",
        file=sys.stderr,
    )
    return 2


def _serve(settings: Settings) -> int:
    import uvicorn

    from server.app import create_app
    from server.auth import ApiKeys
    from server.http_limits import head_limited
    from server.loading import LoadingResponder, bind_listener
    from server.routes.ws import going_away, viewers_gone
    from server.runtime import build_pool

    sys.setswitchinterval(settings.gil_switch_ms / 1000)
    _warn_unknown_env()
    mismatch = public_url_mismatch(settings.public_url, settings.root_path)
    if mismatch is not None:  # a warning: an outer proxy may add a prefix of its own
        log.warning("%s", mismatch)
    allowed = settings.allowed_file_dir
    if allowed is not None and not allowed.is_dir():  # a warning: it may be mounted later
        log.warning(
            "--allowed-file-dir: %s is not a folder (yet): every file:// source is refused until"
            " it is (setting STREAMDET_ALLOWED_FILE_DIR)",
            allowed,
        )
    if settings.streams_file is not None:  # before the model loads: a typo fails at once
        problems = check_streams_file(settings.streams_file, os.environ, settings=settings)
        for problem in problems:
            print(f"streamdet: {problem}", file=sys.stderr)
        if problems:
            return 2
    # The cache is only checked for a file in its way (a traceback once the model loaded): a
    # read-only one filled ahead (an image's) serves an .onnx or a cached export as it is.
    for flag, directory, unusable in (
        ("data-dir", settings.data_dir, unusable_dir(settings.data_dir)),
        ("cache-dir", settings.cache_dir, file_in_the_way(settings.cache_dir)),
    ):
        if unusable is not None:
            setting = flag.replace("-", "_").upper()
            print(
                f"streamdet: --{flag}: {directory}: {unusable} (setting STREAMDET_{setting})",
                file=sys.stderr,
            )
            return 2
    damaged = data_dir_problems(settings.data_dir)  # before the model loads, not a traceback
    for problem in damaged:
        print(f"streamdet: --data-dir: {problem}", file=sys.stderr)
    if damaged:
        return 2
    if settings.grpc_port:  # before the model loads: a missing extra fails at once
        from server.grpc_v2 import GrpcUnavailable, grpc_modules

        try:
            grpc_modules()
        except GrpcUnavailable as exc:
            log.error("cannot start: %s", exc)
            return 2
    if settings.grpc_port and settings.grpc_port == settings.port:  # the model loaded, then
        print(
            f"streamdet: --grpc-port: {settings.port} is --port's too; give gRPC a port of its"
            " own (setting STREAMDET_GRPC_PORT)",
            file=sys.stderr,
        )
        return 2
    # The port bound before the model loads (and the cameras open): taken, it fails at once;
    # free, it answers the probes while the model loads (server/loading.py).
    if not settings.host:  # an empty one binds every address
        return _cannot_listen(settings, "port", True, "no host given")
    try:
        listener = bind_listener(settings.host, settings.port)
    except socket.gaierror as exc:
        return _cannot_listen(settings, "port", True, f"cannot resolve the host: {exc}")
    except OSError as exc:
        why = f"cannot listen there: {exc.strerror or exc}"
        return _cannot_listen(settings, "port", exc.errno in HOST_ERRNOS, why)
    if settings.grpc_port and (taken := port_taken(settings.host, settings.grpc_port)):
        listener.close()
        return _cannot_listen(settings, "grpc-port", *taken)
    keys = ApiKeys(settings.api_keys, settings.api_keys_readonly)
    loading = LoadingResponder(listener, keys)
    loading.start()
    grpc_loading: Any = None  # gRPC's port alike, until the app's server takes it
    try:
        if settings.grpc_port:
            from server.grpc_v2 import start_loading

            try:
                grpc_loading = start_loading(settings, keys)
            except RuntimeError as exc:  # taken since it was looked at
                print(f"streamdet: --grpc-port: {exc}", file=sys.stderr)
                listener.close()
                return 2
        pool = build_pool(settings)
    except EngineError as exc:
        log.error("cannot start: %s", exc)
        listener.close()
        if grpc_loading is not None:
            grpc_loading.stop(None)
        return 2
    finally:
        loading.stop()
    if settings.streams_file is not None:  # its classes, now that the model says its own
        problems = check_streams_file(settings.streams_file, os.environ, pool.engine.names)
        for problem in problems:
            print(f"streamdet: {problem}", file=sys.stderr)
        if problems:
            listener.close()
            if grpc_loading is not None:
                grpc_loading.stop(None)
            pool.stop(settings.shutdown_timeout_s)
            return 2
    app = create_app(settings, pool=pool)
    app.state.grpc_loading = grpc_loading

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # Viewers get 1001 (going away) now, before uvicorn drops sockets with 1012.
            going_away(app)
            app.state.exiting = True  # a call cancelled from now on is the shutdown's
            if getattr(app.state, "stop_by", None) is None:  # the first signal's
                # One drain time for it all: uvicorn's wait for open calls, then each part
                # the app stops, from what is left (each took it whole: 2x or more).
                app.state.stop_by = time.monotonic() + settings.shutdown_timeout_s
            super().handle_exit(sig, frame)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if sockets is not None and self.started:
                # It says "Uvicorn running on ..." only for a socket it bound itself: this one
                # was bound before the model loaded. Scripts and tests wait for the line.
                self._log_started_message(sockets)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # The 1001s queued above are sent by the viewers' own tasks: let them go out
            # before uvicorn closes whatever is still open with 1012.
            await viewers_gone(app, timeout_s=2.0)
            await super().shutdown(sockets)

    server = Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=settings.access_log,
            log_config=None,  # its lines in ours (configure_logging), not its own format
            # A head of any size, or at any pace, otherwise (server/http_limits.py).
            http=head_limited(settings.head_timeout_s),
            # Behind a proxy that strips --root-path: the app's URLs carry it again.
            root_path=settings.root_path,
            proxy_headers=True,
            forwarded_allow_ips=settings.forwarded_allow_ips,
            timeout_keep_alive=settings.keep_alive_s,
            # Whole seconds for uvicorn, at least one: int() made anything under 1 s
            # "None", which waits for open requests for ever.
            timeout_graceful_shutdown=max(1, math.ceil(settings.shutdown_timeout_s)),
        )
    )
    try:
        server.run(sockets=[listener])  # the one bound before the model loaded
    finally:
        listener.close()
        if (still := getattr(app.state, "grpc_loading", None)) is not None:
            still.stop(None)  # the app failed to start before its gRPC server took over
    return 0


def _add_engine_format(sub: Any) -> None:
    """``streamdet export --format engine``: build and cache a TensorRT engine ahead of time."""
    export_p = sub.choices.get("export")
    if export_p is None:
        return
    export_p.add_argument(
        "--format",
        choices=["onnx", "engine"],
        default="onnx",
        help="onnx (default) or engine: build the TensorRT engine from --model (its precision"
        " is the ONNX's) into the cache, and copy it to --out",
    )
    export_p.add_argument("--max-batch", type=int, default=32, help="engine: largest batch")
    export_p.add_argument("--device", default="cuda", help="engine: the GPU it is built for")


def _export_engine(args: argparse.Namespace) -> int:
    from engines.tensorrt import export_engine

    logging.basicConfig(level="INFO", format=LOG_FORMAT)
    cache_dir = args.cache_dir or Settings.model_fields["cache_dir"].get_default(
        call_default_factory=True
    )
    try:
        path = export_engine(
            args.model,
            imgsz=args.imgsz or 640,
            max_batch=args.max_batch,
            device=args.device,
            cache_dir=Path(cache_dir),
            out=args.out,
        )
    except EngineError as exc:
        print(f"streamdet export: {exc}", file=sys.stderr)
        return 2
    print(f"TensorRT engine: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamdet", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="run the HTTP server")
    _add_settings_flags(serve_p)
    bench_p = sub.add_parser("bench", help="measure /detect goodput against the engine ceiling")
    from server.bench import NOT_BENCHED, add_bench_args

    # Its server runs on a port and data of its own (--log-level is the bench's own too).
    _add_settings_flags(bench_p, NOT_BENCHED - {"log_level"})

    add_bench_args(bench_p)
    from server.export_cli import add_export_parsers

    add_export_parsers(sub)
    analyze_p = sub.add_parser(
        "analyze", help="read a recorded video through the model (a video job, no server)"
    )
    # Only the settings a job without a server uses: the others were listed and ignored
    # (--streams-file, --webhooks: exit 0), and --port 99999 refused all the same.
    _add_settings_flags(analyze_p, frozenset(Settings.model_fields) - ANALYZED)
    from server.analyze_cli import add_analyze_args

    add_analyze_args(analyze_p)
    load_p = sub.add_parser("loadtest", help="run a Locust profile and check its P99 targets")
    from loadtest.runner import add_loadtest_args

    add_loadtest_args(load_p)
    _add_engine_format(sub)
    args = parser.parse_args(argv)
    if args.command == "export" and getattr(args, "format", "onnx") == "engine":
        return _export_engine(args)
    if args.command == "loadtest":
        from loadtest.runner import run_loadtest

        logging.basicConfig(level="INFO", format=LOG_FORMAT)
        return run_loadtest(args)
    if args.command in ("export", "evaluate"):
        from server.export_cli import run_export_command

        return run_export_command(args)
    unused = {
        "analyze": frozenset(Settings.model_fields) - ANALYZED,
        "bench": NOT_BENCHED - {"log_level"},
    }.get(args.command, frozenset())
    try:
        settings = settings_from_args(args, unused)
    except ValidationError as exc:
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"])
            flag = f"--{loc.replace('_', '-')}"
            where = f"{flag}: " if loc else ""  # no loc: a rule across settings
            variable = f"STREAMDET_{loc.upper()}"
            if loc and getattr(args, loc, None) is None and variable in os.environ:
                # From the environment: a user who never typed --port was told of it only.
                where = f"{variable}={os.environ[variable]!r} ({flag}): "
            message = err["msg"].removeprefix("Value error, ")  # pydantic's, for ValueErrors
            print(f"streamdet: {where}{message}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    warn_secret_flags(args)
    if args.command == "serve":
        try:
            return serve(settings)
        except KeyboardInterrupt:
            # uvicorn shuts down cleanly on Ctrl-C, then raises SIGINT again for its caller's
            # sake: the server is already stopped, a traceback would only alarm. 130 is the
            # shell's status for a SIGINT.
            return 130
    if args.command == "analyze":
        from server.analyze_cli import run_analyze

        _warn_unknown_env()
        return run_analyze(settings, args)
    from server.bench import run_bench

    return run_bench(settings, args)


if __name__ == "__main__":
    sys.exit(main())
