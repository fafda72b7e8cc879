"""What a stream URL may be, and how FFmpeg opens it.

Only video sources are accepted: RTSP (TCP by default, UDP on request), RTSPS, HTTP(S)
(MJPEG, HLS, progressive files) and local files under one allow-listed directory. Every
source is opened with an FFmpeg ``protocol_whitelist``, so a hostile source (an HLS
playlist naming ``file:///etc/passwd``, say) cannot reach other protocols than its own; a
local file (and an uploaded video) is read only by demuxers of one file
(:data:`FILE_FORMATS`), so a playlist or a concat list under the allowed directory cannot
name a file outside it.
"""

from __future__ import annotations

import random
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

Transport = Literal["tcp", "udp"]

NETWORK_SCHEMES = {"rtsp", "rtsps", "http", "https"}
MAX_URL_CHARS = 2048

# Protocols FFmpeg may use underneath each scheme (segments, RTP over UDP, TLS).
_WHITELIST = {
    "rtsp": "rtsp,rtp,srtp,udp,tcp,crypto",
    "rtsps": "rtsps,rtsp,rtp,srtp,udp,tcp,tls,crypto",
    "http": "http,https,tcp,tls,crypto,hls",
    "https": "http,https,tcp,tls,crypto,hls",
    "file": "file",
}


FILE_FORMATS = (
    "mov,matroska,webm,mpegts,mpegtsraw,avi,flv,live_flv,asf,mpeg,mpegvideo,m4v,h261,h263,"
    "h264,hevc,vvc,obu,ivf,mjpeg,mpjpeg,nut,ogg,mxf,dv,gif,apng,webp,yuv4mpegpipe,"
    # Cameras' and NVRs' own recordings: Dahua's .dav, HXVS, DVD/VOB, Windows TV, RealMedia.
    "dhav,hxvs,vob,wtv,rm,nuv,"
    "image2,jpeg_pipe,png_pipe,webp_pipe,bmp_pipe,gif_pipe,tiff_pipe"
)
"""FFmpeg demuxers a local file, or an uploaded video, may be read with: videos and pictures
of one file. The others include those that read the files a file names, and so reach past
``STREAMDET_ALLOWED_FILE_DIR`` (an HLS playlist naming ``/home/x/other.ts`` was played), or,
uploaded, anything on the server's disk and network: HLS (``hls``), DASH, ``concat`` lists.
``image2`` (FFmpeg's demuxer for a ``.jpg``) reads its one file: :data:`FILE_OPTIONS` turns
its numbered sequences (``img%03d.jpg``) off."""
FILE_OPTIONS = {
    "protocol_whitelist": "file",
    "format_whitelist": FILE_FORMATS,
    "pattern_type": "none",
}
FILE_FORMAT_REFUSED = (
    "a file is read as a video (MP4, MKV, WebM, MPEG-TS, AVI, FLV, ...) or a picture; a"
    " playlist (HLS .m3u8, DASH .mpd), a concat list or an image sequence names other files"
    " and is refused"
)
PLAYLIST_SUFFIXES = frozenset({".m3u8", ".m3u", ".mpd", ".ffconcat"})


class SourceError(ValueError):
    """The URL is malformed or not allowed; the message says what is accepted."""


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """A validated source.

    Attributes:
        url: the URL as given (credentials included: it is what FFmpeg opens).
        scheme: ``rtsp``, ``rtsps``, ``http``, ``https`` or ``file``.
        transport: RTSP lower transport.
        loop: restart a file (or a video file over HTTP) at its end.
        path: the resolved local path of a ``file`` source.
    """

    url: str
    scheme: str
    transport: Transport = "tcp"
    loop: bool = True
    path: Path | None = None

    @property
    def is_file(self) -> bool:
        return self.scheme == "file"

    @property
    def target(self) -> str:
        """What FFmpeg opens."""
        return str(self.path) if self.path is not None else self.url


def parse_source(
    url: str, allowed_file_dir: Path | None, transport: Transport = "tcp", loop: bool = True
) -> SourceSpec:
    """Validate ``url``.

    Raises:
        SourceError: malformed URL, scheme not allowed, or a file outside the allowed
            directory (setting ``STREAMDET_ALLOWED_FILE_DIR``).
    """
    if not url or len(url) > MAX_URL_CHARS:
        raise SourceError(f"url must be 1..{MAX_URL_CHARS} characters")
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in url):
        raise SourceError("url must not contain spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise SourceError(f"malformed url: {exc}") from None
    scheme = parts.scheme.lower()
    url = scheme + url[len(parts.scheme) :]  # FFmpeg knows "http", not "HTTP" (RFC 3986: same)
    if scheme == "file":
        return SourceSpec(
            url, scheme, transport, loop, _allowed_file(parts.netloc, parts.path, allowed_file_dir)
        )
    if scheme not in NETWORK_SCHEMES:
        raise SourceError(
            f"scheme {scheme or '(none)'!r} is not allowed; use rtsp://, rtsps://, http://,"
            " https://, or file:// under STREAMDET_ALLOWED_FILE_DIR"
        )
    if not parts.hostname:
        raise SourceError(f"url {redact(url)!r} has no host")
    if port == 0:
        raise SourceError("port 0 is not a valid source port")
    # "loop" also plays a video file over HTTP again at its end (a camera's stream has none).
    return SourceSpec(url, scheme, transport, loop and scheme in ("http", "https"), None)


def _allowed_file(netloc: str, raw_path: str, allowed_dir: Path | None) -> Path:
    if allowed_dir is None:
        raise SourceError(
            "file sources are disabled; set STREAMDET_ALLOWED_FILE_DIR to allow a directory"
        )
    if netloc not in ("", "localhost"):
        raise SourceError(f"file url must be local (file:///path), got host {netloc!r}")
    path = Path(unquote(raw_path))
    if "\0" in str(path):  # %00: Path.resolve raised ValueError (a 500)
        raise SourceError("file url must not contain a NUL character (%00)")
    if not path.is_absolute():
        raise SourceError("file url needs an absolute path: file:///dir/clip.mp4")
    if path.suffix.lower() in PLAYLIST_SUFFIXES:
        raise SourceError(f"file {path}: {FILE_FORMAT_REFUSED}")
    root = allowed_dir.resolve()
    try:
        resolved = path.resolve()  # follows symlinks, so a link cannot point outside
    except (OSError, RuntimeError) as exc:  # a symlink loop, a name too long
        raise SourceError(f"file {path}: {exc}") from None
    if not resolved.is_relative_to(root):
        raise SourceError(
            f"file {path} is outside the allowed directory {root}"
            " (setting STREAMDET_ALLOWED_FILE_DIR)"
        )
    if resolved.is_dir():
        raise SourceError(f"file {path} is a directory, not a video file")
    if not resolved.is_file():
        raise SourceError(f"file {path} does not exist under {root}")
    return resolved


def check_unmoved(path: Path) -> None:
    """Check that a ``file`` source's path, resolved when it was checked (so free of links),
    still is: a directory on it replaced by a link since (one to a directory outside the
    allowed one) would have FFmpeg open what is there. Called before each open (a file's
    every loop, a queued job's run).

    Raises:
        SourceError: the path now passes through a link, or cannot be resolved.
    """
    try:
        now = path.resolve()
    except (OSError, RuntimeError) as exc:
        raise SourceError(f"file {path}: {exc}") from None
    if now != path:
        raise SourceError(
            f"file {path}: a link now stands on its path, which was checked without one;"
            " refused (files are read from under STREAMDET_ALLOWED_FILE_DIR only)"
        )


SECRET_WORDS = frozenset(
    [
        "pass",
        "password",
        "passwd",
        "pwd",
        "token",
        "secret",
        "key",
        "apikey",
        "accesskey",
        "auth",
        "authorization",
        "signature",
        "sig",
        "credential",
        "credentials",
    ]
)
"""Query parameters that carry a secret, by name or by a word of it (``api_key``,
``auth_token``, ``X-Amz-Signature``): cameras' snapshot and stream URLs put their password
(``?user=admin&pwd=...``, Foscam's and others' CGI) or a token (``?token=...``) there."""


_SECRET_STEMS = ("pass", "pwd", "token", "secret", "credential")
"""How a word of a name that carries a secret begins or ends (``passw``, ``userpass``,
``usertoken``, ``clientsecret``); :data:`SECRET_WORDS` are whole words (``key`` but not
``keyframe``), and no word is searched inside (``author`` is no secret)."""
NOT_SECRET_WORDS = frozenset({"bypass", "passthrough", "passive", "compass", "tokens"})
"""Words that begin or end like a secret's name and are none (a YAML export masked them)."""


def _words(name: str) -> list[str]:
    """A parameter's name in lower-case words: split at punctuation and at a capital after a
    lower-case letter (``userPass``: user, pass)."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", unquote(name))
    return [w for w in re.split(r"[^a-z0-9]+", spaced.lower()) if w]


def _is_secret(name: str) -> bool:
    words = _words(name)
    if "".join(words) in SECRET_WORDS or any(w in SECRET_WORDS for w in words):
        return True
    return any(
        w not in NOT_SECRET_WORDS and (w.startswith(_SECRET_STEMS) or w.endswith(_SECRET_STEMS))
        for w in words
    )


_PATH_PARAM = re.compile(r";([^;=/]+)=([^;/]*)")
"""A path parameter, ``;name=value`` (``/cam;password=.../stream``)."""


def _masked_query(query: str) -> str:
    """A URL's query with the values of secret names ``***``."""
    pairs = [p.partition("=") for p in query.split("&")]
    return "&".join(f"{k}={'***' if _is_secret(k) else v}" if eq else k for k, eq, v in pairs)


def _secret_values(parts: Any) -> list[str]:
    """The secrets in a split URL: its password, or a user part that has none (a token sent
    as the user name), and the values of secret query and path parameters."""
    found = [unquote(parts.password or "")]
    user = unquote(parts.username or "")
    if parts.password is None and len(user) >= 8:  # a token as the user name, not "camera"
        found.append(user)
    pairs = [p.partition("=") for p in parts.query.split("&")]
    pairs += [(m[1], "=", m[2]) for m in _PATH_PARAM.finditer(parts.path)]
    for key, eq, value in pairs:
        if eq and _is_secret(key):
            found += [value, unquote(value)]
    return found


_USERINFO = re.compile(r"(^|[/\s])([^\s/@:]*):[^\s@]+@")
"""``user:password@`` in text that is no URL urlsplit reads (its password masked)."""


def redact(url: str) -> str:
    """``url`` with any secret replaced by ``***`` (for logs and the API): its password, or a
    user part that has none (a token given as the user name), and the values of query and
    path (``;password=``) parameters named as secrets (:func:`_is_secret`)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # "http://user:pw@[::1/x"
        return _USERINFO.sub(r"\1\2:***@", url)
    if "@" not in parts.netloc and "@" in url:
        # No authority it could read (a scheme mistyped: "mqtt//user:pw@host", "https:/..."),
        # which errors echo: a password before an "@" is masked all the same.
        return _USERINFO.sub(r"\1\2:***@", url)
    if parts.password is not None:
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        parts = parts._replace(netloc=f"{user}:***@{host}")
    elif "@" in parts.netloc:
        parts = parts._replace(netloc=f"***@{parts.netloc.rpartition('@')[2]}")
    if ";" in parts.path:
        path = _PATH_PARAM.sub(lambda m: f";{m[1]}=***" if _is_secret(m[1]) else m[0], parts.path)
        parts = parts._replace(path=path)
    if parts.query:
        parts = parts._replace(query=_masked_query(parts.query))
    return parts.geturl()


def redact_in(text: str, url: str) -> str:
    """``text`` (an error's message) with ``url`` redacted wherever it shows, and its secrets
    (password, secret query values of 4 characters or more) wherever else they do: FFmpeg's
    errors name the URL they failed on, password and all, and those went into a stream's
    ``last_error``, its state events and the log."""
    text = text.replace(url, redact(url))
    try:
        parts = urlsplit(url)
    except ValueError:
        return text
    secrets = _secret_values(parts)
    for secret in sorted(set(secrets), key=len, reverse=True):
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def open_options(spec: SourceSpec) -> dict[str, str]:
    """FFmpeg demuxer options for ``spec``."""
    options = {
        "protocol_whitelist": _WHITELIST[spec.scheme],
        # Probe at most 0.5 s / 500 kB: a live camera opens in ~0.3 s instead of ~2.3 s
        # (measured against the test RTSP server), and SPS/PPS come with every key frame.
        "analyzeduration": "500000",
        "probesize": "500000",
    }
    if spec.scheme in ("rtsp", "rtsps"):
        options["rtsp_transport"] = spec.transport
        # FFmpeg's probe (avformat_find_stream_info) bounds its wait by analyzeduration only
        # with packet durations, which RTP has none of: it read on until 20 frames counted
        # for a frame rate (fpsprobesize) or a first timestamp within 50 (max_ts_probe), or
        # probesize's bytes. The SDP and the first frame give codec and size: a 0.4 fps
        # camera opened in 7.5 s (3 frame intervals; a slower one at the open timeout, its
        # first frames held back that long), now in 2.5 s (one interval: the first frame is
        # read whole at the next); a 25 fps one in 0.09 s, not 0.7 (the test RTSP camera,
        # TCP and UDP; the frame rates found are the same).
        options["fpsprobesize"] = "0"
        options["max_ts_probe"] = "0"
    if spec.is_file:
        options |= FILE_OPTIONS
    return options


def upload_options() -> dict[str, str]:
    """FFmpeg options for an uploaded video (a job's): read as a local file, by demuxers of
    one file (an uploaded HLS playlist fetched the segments it named from the network)."""
    return dict(FILE_OPTIONS)


def explain_open_failure(spec_is_file: bool, text: str) -> str:
    """An open's failure as said: FFmpeg's "Invalid argument" for a file's demuxer not in
    :data:`FILE_FORMATS` says why."""
    if spec_is_file and "Invalid argument" in text:
        return f"{text} ({FILE_FORMAT_REFUSED})"
    return text


RTSP_PORT = 554
RTSP_PROBE_S = 2.0
"""How long :func:`rtsp_answer` waits for a source's first bytes, at most."""
SHOWN_BYTES = 40


def _resolve(host: str, port: int, end: float) -> list[tuple[int, int, int, Any]]:
    """``host``'s TCP addresses, looked up by :func:`socket.getaddrinfo` within ``end``
    (monotonic); :class:`TimeoutError` past it. The lookup has no timeout of its own (a
    resolver that does not answer held the caller for its retries, 5 s each): it runs in a
    thread of its own, left to end by itself when it is given up on."""
    found: list[list[tuple[int, int, int, Any]] | OSError] = []
    done = threading.Event()

    def look_up() -> None:
        try:
            infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
            found.append(
                [(family, kind, proto, address) for family, kind, proto, _, address in infos]
            )
        except OSError as exc:
            found.append(exc)
        finally:
            done.set()

    threading.Thread(target=look_up, name="rtsp-answer-resolve", daemon=True).start()
    if not done.wait(max(0.0, end - time.monotonic())):
        raise TimeoutError(f"{host} not resolved in time")
    result = found[0]
    if isinstance(result, OSError):
        raise result
    return result


def _connect(host: str, port: int, end: float) -> socket.socket:
    """A TCP connection to ``host``'s first address that takes one, name lookup and all
    within ``end`` (monotonic): :func:`socket.create_connection` bounds each address's
    connect only, not the lookup, nor all of them together."""
    error: OSError = TimeoutError(f"no address of {host} connected in time")
    for family, kind, proto, address in _resolve(host, port, end):
        if (left := end - time.monotonic()) <= 0:
            break
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        return sock
    raise error


def rtsp_answer(url: str, timeout_s: float) -> bytes | None:
    """The first bytes (up to :data:`SHOWN_BYTES`) an ``rtsp://`` source answers a plain
    RTSP ``OPTIONS`` request with, on a connection of its own; None where it sent nothing
    within ``timeout_s`` (or cannot be reached, or its name is not resolved within it).

    FFmpeg's open fails alike ("Invalid data found when processing input") where the port
    never answers and where it answers in another protocol (an HTTP server, SSH), and an
    answer that is no RTSP reply leaves it waiting for one until the open timeout: this
    tells them apart, after such a failure (it costs a working camera nothing).
    """
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or RTSP_PORT
    except ValueError:
        return None
    if host is None:
        return None
    target = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()  # no password
    request = f"OPTIONS {target} RTSP/1.0\r\nCSeq: 1\r\nUser-Agent: streamdet\r\n\r\n"
    end = time.monotonic() + timeout_s
    data = b""
    try:
        with _connect(host, port, end) as sock:
            sock.sendall(request.encode("latin-1", "replace"))
            while len(data) < SHOWN_BYTES and (left := end - time.monotonic()) > 0:
                sock.settimeout(left)
                chunk = sock.recv(SHOWN_BYTES - len(data))
                if not chunk:
                    break
                data += chunk
    except OSError:  # refused, reset, timed out: what came before it is the answer
        pass
    return data or None


def explain_rtsp_answer(answer: bytes, text: str, *, timed_out: bool) -> str | None:
    """What an RTSP open's failure (FFmpeg's ``text``) says, given the source's ``answer``
    (:func:`rtsp_answer`): None where the answer says nothing more (an RTSP reply, and the
    open ran out of time)."""
    if not answer.startswith(b"RTSP/"):
        shown = answer[:SHOWN_BYTES].decode("latin-1")
        return (
            f"the camera answered, but not with RTSP (first bytes: {shown!r}): check the"
            f" URL's scheme and port (rtsp:// is port {RTSP_PORT} unless the URL names"
            " another; a web server, or another service, listens on this one); " + text
        )
    if timed_out:
        return None
    return (
        "the camera answered RTSP, but FFmpeg could not use its answer to the stream's"
        " request (usually a stream description, SDP, that it cannot read): check the URL's"
        " path names the camera's video stream; " + text
    )


SNAPSHOT_FPS = 1.0
"""How often a still-image URL (a camera's ``snapshot.jpg``) is fetched when its stream sets
no ``max_fps``."""


def is_still_image(format_name: str) -> bool:
    """Whether FFmpeg opened a source with an image demuxer (``image2``, ``jpeg_pipe``,
    ``png_pipe``, ...): a URL that answers one picture a request, as a camera's snapshot URL
    does."""
    return format_name == "image2" or format_name.endswith("_pipe")


def backoff_delay(attempt: int, initial_s: float, max_s: float, rng: random.Random) -> float:
    """Delay before reconnect ``attempt`` (1-based): exponential, capped, full jitter.

    The delay is uniform in ``[cap / 2, cap]`` with ``cap = min(max_s, initial_s * 2**(n-1))``,
    so many cameras failing together do not retry in lock step, and none waits longer than
    ``max_s``.
    """
    if attempt < 1:
        raise ValueError("attempt is 1-based")
    cap = min(max_s, initial_s * 2.0 ** min(attempt - 1, 30))
    return rng.uniform(cap / 2, cap)
