"""A video job's frames drawn into an MP4 (``"render": true``): boxes with track ids, the
region of interest, zones and counting lines with their running counts, as ``latest.jpg``
draws a live stream's; H.264 (libx264) at the sampled frames' own times, so it plays in any
browser at the video's speed. Written by the job's thread as its results come, in order."""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

from engines.types import Detections, Image
from server.render import line_label, render, zone_label
from streams.detect import StreamDetect

VIDEO_FILE = "video.mp4"
MAX_WIDTH = 1920  # a larger video is drawn scaled down to this width
TIME_BASE = Fraction(1, 1000)


class AnnotatedVideo:
    """The MP4 at ``path`` of a job sampling ``fps`` frames a second (None: every frame) of a
    video probed as ``video``, opened at the first frame (its size comes with it)."""

    def __init__(
        self, path: Path, detect: StreamDetect, fps: float | None, video: Mapping[str, Any]
    ) -> None:
        self._path = path
        self._detect = detect
        rate = min((r for r in (fps, video.get("fps")) if r), default=25.0)
        self._rate = Fraction(rate).limit_denominator(1001)
        self._container: Any = None
        self._stream: Any = None
        self._size = (0, 0)
        self._last_pts = -1

    def write(
        self, image: Image, detections: Detections | None, pts: float, counts: dict[str, Any]
    ) -> None:
        """One processed frame (``detections`` None: the engine failed on it, drawn bare)."""
        import av

        detect = self._detect
        drawn = render(
            image,
            MAX_WIDTH,
            detections=detections,
            region=detect.roi,
            lines=[(line, line_label(line.name, counts["crossings"])) for line in detect.lines],
            zones=[(zone, zone_label(zone.name, counts["zones"])) for zone in detect.zones],
        )
        if self._container is None:
            self._open(drawn.shape[1], drawn.shape[0])
        width, height = self._size
        if drawn.shape[0] - height > 1 or drawn.shape[1] - width > 1:
            # A video that grew (a stream may change size at a keyframe): the whole picture,
            # scaled to the video's size (it was cut to its top-left corner).
            frame = av.VideoFrame.from_ndarray(drawn, format="rgb24")
            frame = frame.reformat(width=width, height=height)
        else:  # its size, less an odd side's last row or column
            frame = av.VideoFrame.from_ndarray(drawn[:height, :width], format="rgb24")
        self._last_pts = max(self._last_pts + 1, round(pts / TIME_BASE))
        frame.pts, frame.time_base = self._last_pts, TIME_BASE
        for packet in self._stream.encode(frame):
            self._container.mux(packet)

    def _open(self, width: int, height: int) -> None:
        import av

        self._size = (width - width % 2, height - height % 2)  # 4:2:0 needs even sides
        container = av.open(str(self._path), "w", format="mp4", options={"movflags": "+faststart"})
        stream = container.add_stream(
            "libx264", rate=self._rate, options={"preset": "veryfast", "crf": "23"}
        )
        stream.width, stream.height = self._size
        stream.pix_fmt = "yuv420p"
        stream.time_base = stream.codec_context.time_base = TIME_BASE  # the frames' own times
        self._container, self._stream = container, stream

    def close(self) -> None:
        """Flush the encoder and finish the file (nothing if no frame came)."""
        if self._container is None:
            return
        try:
            for packet in self._stream.encode(None):
                self._container.mux(packet)
        finally:
            self._container.close()
            self._container = None
