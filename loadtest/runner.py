"""``streamdet loadtest``: run a profile's Locust scenario headless and check its targets.

It starts a real ``streamdet serve`` process on a free port (or targets ``--host``), adds
the streams live viewers need, runs Locust for the profile's duration, saves Locust's CSV and
HTML report under ``--out``, prints a short table, and exits 1 when a target is missed
(2 when the run itself could not happen: the server unreachable or refusing its streams,
Locust failing, or nothing measured at all).

Every call has a timeout well under the run (:func:`call_timeout_s`), and a ``/detect`` call
still unanswered when the run stops is a failure (``loadtest/locustfile.py``), so a server
that stops answering misses the error-rate target instead of passing with the calls it did
answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import httpx

from loadtest.frames import default_videos, shared_dir
from loadtest.profiles import SCENARIOS, Profile, ProfileError, load_profile
from loadtest.report import evaluate, format_table, passed, read_stats
from loadtest.server import ServerError, ServerProcess
from server.argtypes import number

log = logging.getLogger(__name__)

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
WS_TARGET = "WS frame"
EVENT_TARGET = "SSE event"
DETECT_TARGET = "POST /detect"
# What a run leaves in --out; removed first, so a run that fails leaves no earlier verdict.
OUTPUTS = (
    "verdict.json",
    "report.html",
    "locust.log",
    "locust_stats.csv",
    "locust_stats_history.csv",
    "locust_failures.csv",
    "locust_exceptions.csv",
    "final_stats.csv",
    "final_stats_failures.csv",
)
FINAL_STATS = "final_stats.csv"  # the figures once every user stopped (see the locustfile)


class RunError(RuntimeError):
    """The run could not happen (exit 2); the message says why and what to check."""


def add_loadtest_args(parser: argparse.ArgumentParser) -> None:
    """The ``streamdet loadtest`` flags."""
    parser.add_argument("--profile", default="cpu-ci", help="profile name or TOML path")
    parser.add_argument(
        "--host", default=None, help="target this server URL instead of starting one"
    )
    parser.add_argument("--out", type=Path, default=None, help="report folder")
    parser.add_argument("--model", default=None, help="model for the started server")
    parser.add_argument("--scenario", choices=SCENARIOS, default=None, help="override")
    parser.add_argument("--users", type=number(int, 0), default=None, help="override detect users")
    parser.add_argument(
        "--live-users", type=number(int, 0), default=None, help="override live users"
    )
    parser.add_argument(
        "--run-time", type=int, default=None, help="override seconds (whole seconds)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("STREAMDET_LOADTEST_API_KEY"),
        help="bearer token to send (env STREAMDET_LOADTEST_API_KEY)",
    )


def _overrides(profile: Profile, args: argparse.Namespace) -> Profile:
    if args.scenario is not None:
        profile = replace(profile, scenario=args.scenario)
    if args.users is not None:
        profile = replace(profile, users=args.users)
    if args.live_users is not None:
        profile = replace(profile, live_users=args.live_users)
    if args.run_time is not None:
        if args.run_time <= 0:
            raise ProfileError(f"--run-time must be > 0 seconds, got {args.run_time}")
        profile = replace(profile, run_time_s=args.run_time)
    return profile


def call_timeout_s(profile: Profile) -> float:
    """Seconds a /detect call, a WebSocket frame or an event may take before it counts as a
    failure: a quarter of the run time, 1-30 s (Locust's own 60 s outlasted a whole CI run, so
    a server that stopped answering passed)."""
    return min(30.0, max(1.0, profile.run_time_s / 4))


def streams_api_present(client: httpx.Client) -> bool:
    """Whether the server has the streams API (``GET /streams`` is not a 404)."""
    return client.get("/streams").status_code != 404


def add_streams(client: httpx.Client, profile: Profile) -> list[str]:
    """Add ``live_streams`` looping file streams of the shared clips, tracked, with a counting
    line and a zone; their ids.

    Raises:
        RuntimeError: the server refused a stream; the message has its answer.
    """
    clips = default_videos()
    if not clips:
        raise RuntimeError(f"no clips under {shared_dir() / 'videos'} for live streams")
    ids: list[str] = []
    for i in range(profile.live_streams):
        clip = clips[i % len(clips)]
        body = {
            "url": clip.resolve().as_uri(),
            "name": f"loadtest-{i}",
            "max_fps": profile.live_max_fps,
            "loop": True,
            # Tracked, with a counting line and a zone: the frame latency targets hold with
            # them on, and their events are what event readers time.
            "track": True,
            "lines": [{"name": "middle", "points": [[0.0, 0.5], [1.0, 0.5]]}],
            "zones": [{"name": "left", "points": [[0, 0], [0.5, 0], [0.5, 1], [0, 1]]}],
        }
        resp = client.post("/streams", json=body)
        if resp.status_code != 201:
            raise RuntimeError(
                f"POST /streams {body['url']} answered {resp.status_code}: {resp.text[:300]}"
                " (a started server allows the clips folder via STREAMDET_ALLOWED_FILE_DIR)"
            )
        ids.append(str(resp.json()["id"]))
    return ids


def run_locust(
    profile: Profile, base_url: str, out: Path, live_ids: list[str], api_key: str | None
) -> int:
    """Run Locust headless for the profile; its exit code (0 unless Locust itself failed:
    failed requests do not change it).

    Raises:
        RunError: no users to run, or Locust did not end in time.
    """
    classes: list[str] = []
    users = profile.users if profile.scenario in ("detect", "mixed") else 0
    live = profile.live_users if live_ids else 0
    readers = profile.event_users if live_ids else 0
    if users:
        classes.append("DetectUser")
    if live:
        classes.append("LiveUser")
    if readers:
        classes.append("EventUser")
    if not classes:
        raise RunError("nothing to run: no detect users and no live viewers")
    env = dict(os.environ)
    env.update(
        {
            "STREAMDET_LOADTEST_WAIT_S": ",".join(str(v) for v in profile.wait_s),
            "STREAMDET_LOADTEST_TIMEOUT_S": str(call_timeout_s(profile)),
            "STREAMDET_LOADTEST_STREAMS": ",".join(live_ids),
            "STREAMDET_LOADTEST_DETECT_USERS": str(users),
            "STREAMDET_LOADTEST_LIVE_USERS": str(live),
            "STREAMDET_LOADTEST_EVENT_USERS": str(readers),
            "STREAMDET_SHARED_DIR": str(shared_dir()),
            "STREAMDET_LOADTEST_FINAL_CSV": str((out / FINAL_STATS).resolve()),
        }
    )
    if api_key:
        env["STREAMDET_LOADTEST_API_KEY"] = api_key
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--host",
        base_url,
        "-u",
        str(users + live + readers),
        "-r",
        str(profile.spawn_rate),
        "-t",
        f"{int(profile.run_time_s)}s",  # whole seconds: Locust refuses "2.5s"
        "--stop-timeout",
        "5",
        "--csv",
        str(out / "locust"),
        "--html",
        str(out / "report.html"),
        "--only-summary",
        "--loglevel",
        "WARNING",
        "--exit-code-on-error",
        "0",
        *classes,
    ]
    log.info(
        "locust: %d detect user(s), %d live viewer(s), %d event reader(s), %g s",
        users,
        live,
        readers,
        profile.run_time_s,
    )
    limit = profile.run_time_s + 120
    with (out / "locust.log").open("w") as log_file:
        try:
            proc = subprocess.run(
                cmd,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                timeout=limit,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise RunError(
                f"Locust did not end within {limit:g} s; see {out / 'locust.log'}"
            ) from None
    return proc.returncode


def clear_outputs(out: Path) -> None:
    """Remove what an earlier run left in ``out``: a run that cannot happen must not leave
    an earlier ``verdict.json`` (``"passed": true``) or Locust figures behind."""
    for name in OUTPUTS:
        (out / name).unlink(missing_ok=True)


@contextmanager
def _server_errors(base_url: str) -> Iterator[None]:
    """HTTP errors talking to the server (adding streams, checking the API) as a
    :class:`RunError` naming the server."""
    try:
        yield
    except httpx.HTTPError as exc:
        raise RunError(
            f"cannot talk to the server at {base_url}: {type(exc).__name__}: {exc}"
            " (is it running, and is --host right?)"
        ) from None


def run_profile(profile: Profile, base_url: str, out: Path, api_key: str | None) -> int:
    """Against a ready server: add streams, run Locust, check targets, print the table.
    0 when every target holds, 1 when one is missed, 2 when the run could not happen (the
    reason printed on stderr)."""
    clear_outputs(out)
    try:
        return _run_profile(profile, base_url, out, api_key)
    except RunError as exc:
        print(f"streamdet loadtest: {exc}", file=sys.stderr)
        return 2


def _run_profile(profile: Profile, base_url: str, out: Path, api_key: str | None) -> int:
    skipped: dict[str, str] = {}
    live_ids: list[str] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with (
        httpx.Client(base_url=base_url, headers=headers, timeout=30) as client,
        _server_errors(base_url),
    ):
        client.get("/healthz")  # any answer will do: the server is there
        live_scenario = profile.scenario in ("live", "mixed")
        wants_live = live_scenario and profile.live_users + profile.event_users > 0
        if wants_live and not streams_api_present(client):
            reason = "live scenario skipped: the server has no streams API (GET /streams -> 404)"
            print(reason)
            skipped[WS_TARGET] = skipped[EVENT_TARGET] = reason
        elif wants_live:
            try:
                live_ids = add_streams(client, profile)
            except RuntimeError as exc:
                raise RunError(str(exc)) from None
        if not (live_scenario and profile.live_users):
            skipped.setdefault(WS_TARGET, f"scenario {profile.scenario!r} has no live viewers")
        if not (live_scenario and profile.event_users):
            skipped.setdefault(EVENT_TARGET, f"scenario {profile.scenario!r} has no event readers")
        if profile.scenario == "live":
            skipped.setdefault(DETECT_TARGET, "scenario 'live' runs no /detect users")
        try:
            if profile.scenario == "live" and not live_ids:
                raise RunError(
                    f"{profile.name}: nothing to run (scenario 'live' without live streams:"
                    f" {skipped.get(WS_TARGET, 'no live viewers or event readers')})"
                )
            code = run_locust(profile, base_url, out, live_ids, api_key)
        finally:
            for stream_id in live_ids:
                try:
                    client.delete(f"/streams/{stream_id}")
                except httpx.HTTPError as exc:
                    log.warning("could not remove stream %s: %s", stream_id, exc)
    if code != 0:
        raise RunError(
            f"Locust exited with {code} (it failed, not a target); see {out / 'locust.log'}"
        )
    stats = out / FINAL_STATS
    if not stats.exists():
        raise RunError(f"Locust wrote no {stats.name}; see {out / 'locust.log'}")
    rows = read_stats(stats)
    verdicts = evaluate(rows, profile.targets, skipped, profile.run_time_s)
    print(f"profile {profile.name} ({profile.description}); report: {out / 'report.html'}")
    shown = {k: v for k, v in rows.items() if k != "Aggregated"}
    print(format_table(shown, verdicts, profile.run_time_s))
    measured = sum(row.requests for row in shown.values())
    if not measured:
        raise RunError(
            "nothing was measured: no request was recorded in the run, so no target was"
            f" checked; see {out / 'locust.log'}"
        )
    ok = passed(verdicts)
    (out / "verdict.json").write_text(
        json.dumps(
            {"profile": profile.name, "passed": ok, "verdicts": [asdict(v) for v in verdicts]},
            indent=2,
        )
    )
    print("PASS" if ok else "FAIL: a target was missed")
    return 0 if ok else 1


def run_loadtest(args: argparse.Namespace) -> int:
    """The ``streamdet loadtest`` command."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        profile = _overrides(load_profile(args.profile), args)
    except ProfileError as exc:
        print(f"streamdet loadtest: {exc}", file=sys.stderr)
        return 2
    out: Path = args.out or Path("loadtest-results") / profile.name
    out.mkdir(parents=True, exist_ok=True)
    clear_outputs(out)
    if args.host:
        return run_profile(profile, args.host.rstrip("/"), out, args.api_key)
    settings: dict[str, object] = {**profile.server, "log_level": "info"}
    settings["model"] = args.model or profile.server.get(
        "model", str(shared_dir() / "models" / "yolov8n.pt")
    )
    settings.setdefault("allowed_file_dir", str(shared_dir() / "videos"))
    settings.setdefault("data_dir", str(out / "server-data"))  # no streams left behind
    try:
        with ServerProcess(settings, log_path=out / "server.log") as server:
            return run_profile(profile, server.base_url, out, args.api_key)
    except ServerError as exc:
        print(f"streamdet loadtest: {exc}", file=sys.stderr)
        return 2
