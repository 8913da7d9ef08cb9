"""Chat requests of the reference prefill worker: types and the JSONL format (prefill process).

One request per line::

    {"messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image", "path": "cat.png"},
            {"type": "video", "paths": ["f0.jpg", "f1.jpg"], "fps": 2}
        ]},
        {"role": "assistant", "content": "A cat."},
        ...
    ]}

``content`` may also be a plain string (text only). Relative paths are read
from the directory of the requests file. A multi-turn conversation re-sends
the whole history every turn, as a chat API does. The Python API takes bytes
directly (:meth:`MediaItem.image`, :meth:`MediaItem.video`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import media
from common.errors import InvalidRequestError

logger = logging.getLogger(__name__)

MAX_REQUEST_LINE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One image or video of a request, as bytes."""

    kind: str  # "image" | "video"
    frames: tuple[bytes, ...]  # one entry for an image
    fps: float = 0.0
    label: str = ""  # for messages and the encoder's per-item errors

    def __post_init__(self) -> None:
        if self.kind not in ("image", "video"):
            raise InvalidRequestError(f"media kind must be 'image' or 'video', got {self.kind!r}")
        if not self.frames or any(not f for f in self.frames):
            raise InvalidRequestError(f"media item {self.label or '?'} has no bytes")
        if self.kind == "image" and len(self.frames) != 1:
            raise InvalidRequestError(f"image {self.label or '?'} must have one frame, got {len(self.frames)}")
        if self.fps < 0:
            raise InvalidRequestError(f"video {self.label or '?'} has a negative fps {self.fps}")

    @classmethod
    def image(cls, data: bytes, label: str = "") -> MediaItem:
        return cls("image", (data,), 0.0, label)

    @classmethod
    def video(cls, frames: Sequence[bytes], fps: float = 0.0, label: str = "") -> MediaItem:
        return cls("video", tuple(frames), float(fps), label)

    def content_hash(self) -> str:
        return media.content_hash(self.kind, self.frames, self.fps)


@dataclass(frozen=True, slots=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    parts: tuple[str | MediaItem, ...]


@dataclass(frozen=True, slots=True)
class ChatRequest:
    messages: tuple[Message, ...]

    @property
    def media(self) -> list[MediaItem]:
        """Every media item of the conversation, in prompt order."""
        return [p for m in self.messages for p in m.parts if isinstance(p, MediaItem)]

    @classmethod
    def user(cls, *parts: str | MediaItem) -> ChatRequest:
        """A one-message request (handy in tests and scripts)."""
        return cls((Message("user", tuple(parts)),))

    def then(self, role: str, *parts: str | MediaItem) -> ChatRequest:
        """This conversation with one more message appended."""
        return ChatRequest(self.messages + (Message(role, tuple(parts)),))


def _read(base_dir: Path, path: object, where: str) -> bytes:
    if not isinstance(path, str) or not path:
        raise InvalidRequestError(f"{where}: 'path' must be a non-empty string, got {path!r}")
    full = Path(path) if Path(path).is_absolute() else base_dir / path
    try:
        return full.read_bytes()
    except OSError as exc:
        raise InvalidRequestError(f"{where}: cannot read {path!r}: {exc.strerror}") from exc


def _part(obj: Any, base_dir: Path, where: str) -> str | MediaItem:
    if not isinstance(obj, dict):
        raise InvalidRequestError(f"{where}: a content part must be an object, got {type(obj).__name__}")
    kind = obj.get("type")
    if kind == "text":
        text = obj.get("text")
        if not isinstance(text, str):
            raise InvalidRequestError(f"{where}: 'text' must be a string, got {text!r}")
        return text
    if kind == "image":
        return MediaItem.image(_read(base_dir, obj.get("path"), where), label=where)
    if kind == "video":
        paths = obj.get("paths")
        if not isinstance(paths, list) or not paths:
            raise InvalidRequestError(f"{where}: 'paths' must be a non-empty list, got {paths!r}")
        fps = obj.get("fps", 0.0)
        if not isinstance(fps, (int, float)) or isinstance(fps, bool) or fps < 0:
            raise InvalidRequestError(f"{where}: 'fps' must be a number >= 0, got {fps!r}")
        frames = [_read(base_dir, p, f"{where} frame {i}") for i, p in enumerate(paths)]
        return MediaItem.video(frames, float(fps), label=where)
    raise InvalidRequestError(f"{where}: part type must be text, image or video, got {kind!r}")


def parse_request(obj: Any, base_dir: Path, where: str = "request") -> ChatRequest:
    """A request from its decoded JSON object; paths resolve against ``base_dir``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("messages"), list) or not obj["messages"]:
        raise InvalidRequestError(f"{where}: expected an object with a non-empty 'messages' list")
    messages: list[Message] = []
    for m, msg in enumerate(obj["messages"]):
        at = f"{where} message {m}"
        if not isinstance(msg, dict):
            raise InvalidRequestError(f"{at}: must be an object, got {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if role not in ("system", "user", "assistant"):
            raise InvalidRequestError(f"{at}: role must be system, user or assistant, got {role!r}")
        if isinstance(content, str):
            parts: list[str | MediaItem] = [content]
        elif isinstance(content, list):
            parts = [_part(p, base_dir, f"{at} part {k}") for k, p in enumerate(content)]
        else:
            raise InvalidRequestError(f"{at}: content must be a string or a list, got {content!r}")
        messages.append(Message(role, tuple(parts)))
    return ChatRequest(tuple(messages))


def load_requests(path: str | Path) -> list[ChatRequest]:
    """Every request of a JSONL file (blank lines skipped)."""
    path = Path(path)
    requests: list[ChatRequest] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read requests file {str(path)!r}: {exc.strerror}") from exc
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path.name}:{n}"
        if len(line) > MAX_REQUEST_LINE_BYTES:
            raise InvalidRequestError(f"{where}: line is {len(line)} characters, the limit is {MAX_REQUEST_LINE_BYTES}")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{where}: not JSON: {exc.msg} at column {exc.colno}") from exc
        requests.append(parse_request(obj, path.parent, where))
    return requests
