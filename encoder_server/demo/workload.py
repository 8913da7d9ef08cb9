"""The demo's workload: media and interleaved multi-turn chats, generated on the spot (demo orchestrator).

Media: twelve images of different sizes and aspect ratios (PNG and JPEG) and
one short video, drawn with Pillow/numpy from a seed. Users: each worker
serves several users whose conversations interleave in its request stream.
Each user follows the same six-turn script, with its own images:

====  ==============  =========================================================
turn  action          what it exercises
====  ==============  =========================================================
0     ``new``         a new chat with one image (encoder miss)
1     ``follow-up``   the history re-sent plus a second image (prefix hit)
2     ``same-image``  the first image again, at a new position (logical hit)
3     ``video``       the history plus the shared video
4     ``replay``      turn 3 sent again unchanged (everything from the prefix)
5     ``fresh-text``  a new chat: new text with an old image of a user on the
                      other worker and its own first image (cross-worker reuse)
====  ==============  =========================================================

Turns past six start the script again with the next images of the pool. The
requests are written in ``epd prefill``'s JSONL format
(:mod:`prefill_client.reference.chat`), one file per worker, media paths relative to it.
"""

from __future__ import annotations

import io
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

logger = logging.getLogger(__name__)

# (width, height, format): square, landscape, portrait, 3:1 strips, 16:9, a large one.
IMAGE_SPECS: tuple[tuple[int, int, str], ...] = (
    (256, 256, "PNG"), (320, 240, "JPEG"), (240, 320, "PNG"), (480, 160, "JPEG"),
    (160, 480, "PNG"), (512, 384, "JPEG"), (640, 360, "PNG"), (360, 640, "JPEG"),
    (448, 448, "PNG"), (600, 400, "JPEG"), (300, 500, "PNG"), (720, 720, "JPEG"),
)
VIDEO_SIZE = (256, 192)
VIDEO_FRAMES = 6
VIDEO_FPS = 2.0
ACTIONS = ("new", "follow-up", "same-image", "video", "replay", "fresh-text")
SYSTEM_PROMPT = "You are a helpful assistant that looks at pictures and clips."
MAX_USERS_PER_WORKER = 16
MAX_REQUESTS_PER_USER = 60


@dataclass(frozen=True, slots=True)
class Media:
    """One generated image or video, as files under the workload directory."""

    key: str  # "img03", "video"
    kind: str  # "image" | "video"
    paths: tuple[str, ...]  # relative to the workload directory
    frames: tuple[bytes, ...]
    fps: float
    width: int
    height: int
    fmt: str


@dataclass(frozen=True, slots=True)
class PlannedRequest:
    """One request of a worker's stream and the media it carries, in prompt order."""

    worker: int
    index: int  # position in the worker's stream (the worker's request index)
    user: int  # global user number
    action: str
    media: tuple[str, ...]  # Media keys
    body: dict[str, Any]  # the JSON object of the request line


@dataclass(frozen=True, slots=True)
class Workload:
    root: Path
    media: dict[str, Media]
    streams: tuple[tuple[PlannedRequest, ...], ...]  # per worker

    def request_file(self, worker: int) -> Path:
        return self.root / f"worker{worker}.jsonl"

    @property
    def num_requests(self) -> int:
        return sum(len(s) for s in self.streams)


def _encode(pixels: np.ndarray, fmt: str) -> bytes:
    buf = io.BytesIO()
    image = Image.fromarray(pixels, "RGB")
    if fmt == "JPEG":
        image.save(buf, format="JPEG", quality=90)
    else:
        image.save(buf, format="PNG")
    return buf.getvalue()


def render_picture(width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """A smooth colour field with a few shapes and light noise: distinct per seed, compressible."""
    coarse = rng.integers(0, 256, size=(max(2, height // 64), max(2, width // 64), 3), dtype=np.uint8)
    image = Image.fromarray(coarse, "RGB").resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 7))):
        x0, x1 = sorted(int(v) for v in rng.integers(0, width, 2))
        y0, y1 = sorted(int(v) for v in rng.integers(0, height, 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        if rng.random() < 0.5:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
        else:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
    noise = rng.integers(-12, 13, size=(height, width, 3))
    pixels: np.ndarray = np.clip(np.asarray(image, dtype=np.int16) + noise, 0, 255).astype(np.uint8)
    return pixels


def render_video(width: int, height: int, frames: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A square moving across a fixed background: frames share a size, as a video's must."""
    background = render_picture(width, height, rng)
    side = min(width, height) // 3
    colour = rng.integers(0, 256, 3, dtype=np.uint8)
    out = []
    for f in range(frames):
        frame = background.copy()
        x = (f * (width - side)) // max(1, frames - 1)
        y = (height - side) // 2
        frame[y:y + side, x:x + side] = colour
        out.append(frame)
    return out


def make_media(root: Path, seed: int) -> dict[str, Media]:
    """Write the image pool and the video under ``root/media``."""
    folder = root / "media"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    media: dict[str, Media] = {}
    for i, (width, height, fmt) in enumerate(IMAGE_SPECS):
        data = _encode(render_picture(width, height, rng), fmt)
        rel = f"media/img{i:02d}.{'png' if fmt == 'PNG' else 'jpg'}"
        (root / rel).write_bytes(data)
        media[f"img{i:02d}"] = Media(f"img{i:02d}", "image", (rel,), (data,), 0.0, width, height, fmt)
    frames = [_encode(f, "PNG") for f in render_video(*VIDEO_SIZE, VIDEO_FRAMES, rng)]
    paths = tuple(f"media/video_f{i}.png" for i in range(len(frames)))
    for rel, data in zip(paths, frames, strict=True):
        (root / rel).write_bytes(data)
    media["video"] = Media("video", "video", paths, tuple(frames), VIDEO_FPS, *VIDEO_SIZE, "PNG")
    return media


def _part(m: Media) -> dict[str, Any]:
    if m.kind == "image":
        return {"type": "image", "path": m.paths[0]}
    return {"type": "video", "paths": list(m.paths), "fps": m.fps}


class _User:
    """One user's conversation state while the script is played."""

    def __init__(self, number: int, total_users: int, users_per_worker: int) -> None:
        self.number = number
        self.total = total_users
        self.per_worker = users_per_worker
        self.messages: list[dict[str, Any]] = []
        self.media: list[str] = []
        self.last: tuple[list[dict[str, Any]], list[str]] = ([], [])

    def images(self, cycle: int) -> tuple[str, str, str]:
        """This cycle's own two images and an image of a user on another worker."""
        n = len(IMAGE_SPECS)
        base = 2 * (self.number + cycle * self.total)
        peer = (self.number + self.per_worker) % self.total
        other = 2 * (peer + cycle * self.total)
        return f"img{base % n:02d}", f"img{(base + 1) % n:02d}", f"img{other % n:02d}"

    def turn(self, t: int, pool: dict[str, Media]) -> tuple[str, list[dict[str, Any]], list[str]]:
        action = ACTIONS[t % len(ACTIONS)]
        a, b, other = self.images(t // len(ACTIONS))
        g = self.number
        if action == "new":
            question = {"type": "text", "text": f"User {g}: what is in this picture?"}
            self.messages = [{"role": "system", "content": SYSTEM_PROMPT},
                             {"role": "user", "content": [question, _part(pool[a])]}]
            self.media = [a]
        elif action == "replay":
            messages, media = self.last
            return action, messages, media
        elif action == "fresh-text":
            self.messages = [{"role": "user", "content": [
                {"type": "text", "text": f"User {g} has a fresh question, turn {t}: how do these two differ?"},
                _part(pool[other]), _part(pool[a])]}]
            self.media = [other, a]
        else:
            key, text = {"follow-up": (b, "And what is in this one?"),
                         "same-image": (a, "Back to the first picture: which colour dominates?"),
                         "video": ("video", "Now describe what moves in this clip.")}[action]
            self.messages = self.messages + [
                {"role": "assistant", "content": f"I see {len(self.media)} item(s) so far, user {g}."},
                {"role": "user", "content": [{"type": "text", "text": text}, _part(pool[key])]}]
            self.media = self.media + [key]
        self.last = (list(self.messages), list(self.media))
        return action, self.last[0], self.last[1]


def generate(root: Path, *, workers: int = 2, users: int = 3, requests_per_user: int = 6,
             seed: int = 0) -> Workload:
    """Media plus one interleaved request stream per worker, written under ``root``."""
    if workers <= 0:
        raise ValueError(f"workers must be > 0, got {workers}")
    if not 1 <= users <= MAX_USERS_PER_WORKER:
        raise ValueError(f"users per worker must be in 1..{MAX_USERS_PER_WORKER}, got {users}")
    if not 1 <= requests_per_user <= MAX_REQUESTS_PER_USER:
        raise ValueError(f"requests per user must be in 1..{MAX_REQUESTS_PER_USER}, got {requests_per_user}")
    media = make_media(root, seed)
    total = workers * users
    people = [_User(g, total, users) for g in range(total)]
    streams: list[tuple[PlannedRequest, ...]] = []
    for w in range(workers):
        stream: list[PlannedRequest] = []
        # Round-robin over the worker's users: their conversations interleave.
        for t in range(requests_per_user):
            for u in range(users):
                user = people[w * users + u]
                action, messages, keys = user.turn(t, media)
                stream.append(PlannedRequest(w, len(stream), user.number, action, tuple(keys),
                                             {"messages": messages}))
        streams.append(tuple(stream))
        with open(root / f"worker{w}.jsonl", "w", encoding="utf-8") as f:
            for req in stream:
                f.write(json.dumps(req.body) + "\n")
    logger.debug("workload: %d media, %d requests in %d streams", len(media), sum(map(len, streams)), workers)
    return Workload(root, media, tuple(streams))
