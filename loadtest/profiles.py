"""Hardware profiles: how hard to push (users, duration) and what must hold (targets).

A profile is a TOML file in ``loadtest/profiles/`` (or any path)::

    description = "..."
    scenario = "mixed"          # detect | live | mixed
    users = 4                   # detect users (closed loop, with think time)
    live_users = 2              # WebSocket subscribers (live and mixed)
    event_users = 1             # server-sent event readers of GET /events (live and mixed)
    live_streams = 1            # streams the runner adds for them
    spawn_rate = 4
    run_time_s = 40             # whole seconds (Locust's --run-time takes no fractions)
    wait_s = [0.5, 1.0]         # think time of a detect user, uniform in [min, max]

    [server]                    # streamdet serve settings when the runner starts the server
    max_batch = 2

    [targets."POST /detect"]    # one table per Locust request name
    p50_ms = 900
    p99_ms = 2500
    max_error_rate = 0.01       # failures / requests
    min_goodput_rps = 2.0       # successful requests per second
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
SCENARIOS = ("detect", "live", "mixed")


class ProfileError(ValueError):
    """A profile file is missing or malformed; the message names the file and the key."""


@dataclass(frozen=True, slots=True)
class Target:
    """What one Locust request name must achieve; ``None`` means not checked."""

    p50_ms: float | None = None
    p99_ms: float | None = None
    max_error_rate: float | None = None
    min_goodput_rps: float | None = None


@dataclass(frozen=True, slots=True)
class Profile:
    """A load profile and its targets."""

    name: str
    path: Path
    description: str = ""
    scenario: str = "detect"
    users: int = 4
    live_users: int = 0
    event_users: int = 0
    live_streams: int = 1
    live_max_fps: float = 5.0
    spawn_rate: float = 4.0
    run_time_s: float = 40.0
    wait_s: tuple[float, float] = (0.5, 1.0)
    server: dict[str, Any] = field(default_factory=dict)
    targets: dict[str, Target] = field(default_factory=dict)


def resolve(name_or_path: str) -> Path:
    """``cpu-ci`` -> ``loadtest/profiles/cpu-ci.toml``; a path is taken as it is."""
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        return path
    return PROFILE_DIR / f"{name_or_path}.toml"


def available() -> list[str]:
    """Names of the profiles shipped in ``loadtest/profiles``."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def load_profile(name_or_path: str) -> Profile:
    """Read and check a profile.

    Raises:
        ProfileError: missing file, bad TOML, unknown keys or values out of range.
    """
    path = resolve(name_or_path)
    if not path.is_file():
        raise ProfileError(
            f"no profile {name_or_path!r} ({path}); shipped profiles: {', '.join(available())}"
        )
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None
    known = set(Profile.__dataclass_fields__) - {"name", "path"}
    unknown = set(raw) - known
    if unknown:
        raise ProfileError(f"{path}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    targets: dict[str, Target] = {}
    for req_name, table in raw.pop("targets", {}).items():
        bad = set(table) - set(Target.__dataclass_fields__)
        if bad:
            raise ProfileError(
                f"{path}: targets.{req_name!r}: unknown key(s) {sorted(bad)};"
                f" known: {sorted(Target.__dataclass_fields__)}"
            )
        targets[req_name] = Target(**{k: float(v) for k, v in table.items()})
    if "wait_s" in raw:
        low, high = (float(v) for v in raw.pop("wait_s"))
        if not 0 <= low <= high:
            raise ProfileError(f"{path}: wait_s must be [min, max] with 0 <= min <= max")
        raw["wait_s"] = (low, high)
    profile = Profile(name=path.stem, path=path, targets=targets, **raw)
    if profile.scenario not in SCENARIOS:
        raise ProfileError(
            f"{path}: scenario {profile.scenario!r} unknown; choose one of {', '.join(SCENARIOS)}"
        )
    if min(profile.users, profile.live_users, profile.event_users) < 0 or profile.run_time_s <= 0:
        raise ProfileError(
            f"{path}: users, live_users, event_users must be >= 0 and run_time_s > 0"
        )
    if profile.run_time_s != int(profile.run_time_s):
        raise ProfileError(
            f"{path}: run_time_s must be whole seconds (Locust takes no fractions);"
            f" got {profile.run_time_s}"
        )
    return profile
