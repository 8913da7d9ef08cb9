"""Byte-level tokenizer and chat template of the reference prefill worker (prefill process).

The reference worker cannot download a tokenizer, so text is tokenized as its
UTF-8 bytes (ids 0..255) and a handful of special tokens follow. The chat
template is deliberately plain::

    <|bos|>
    for each message:   <|user|> | <|assistant|> | <|system|>
                        then its parts in order:
                            text   -> its UTF-8 bytes
                            image  -> <|vision_start|> <|image|> * n <|vision_end|>
                            video  -> <|vision_start|> <|video|> * n <|vision_end|>
                        <|end|>
    <|assistant|>                                   (the generation prompt)

``n`` is the item's placeholder count (its merged-token count). A multi-turn
conversation re-sends every earlier message, so turn ``k + 1``'s tokens start
with turn ``k``'s prompt: that is what the prefix cache reuses.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

NUM_BYTE_TOKENS = 256


class Special(enum.IntEnum):
    """Special token ids, right after the 256 byte ids."""

    BOS = 256
    EOS = 257
    PAD = 258
    IMAGE = 259
    VIDEO = 260
    VISION_START = 261
    VISION_END = 262
    SYSTEM = 263
    USER = 264
    ASSISTANT = 265
    END = 266


# Ids in use; the LM's vocabulary must be at least this large.
MIN_VOCAB_SIZE = max(Special) + 1
# Vocabulary of the default LM: rounded up to a multiple of 16 for the matmul.
DEFAULT_VOCAB_SIZE = 272

ROLES: dict[str, Special] = {"system": Special.SYSTEM, "user": Special.USER, "assistant": Special.ASSISTANT}
PLACEHOLDERS: dict[str, Special] = {"image": Special.IMAGE, "video": Special.VIDEO}


@dataclass(frozen=True, slots=True)
class ItemSpan:
    """Where one media item's placeholders sit in the rendered prompt."""

    index: int  # the item's index among the request's media items, in order
    offset: int  # sequence position of its first placeholder
    length: int  # placeholder count

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class MediaPart:
    """A media item in a message; ``num_tokens`` comes from the input processor."""

    kind: str  # "image" | "video"
    num_tokens: int


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    token_ids: tuple[int, ...]
    spans: tuple[ItemSpan, ...]


def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def token_name(token_id: int) -> str:
    """Readable form of one id: the byte as text when printable, else its name."""
    if 0 <= token_id < NUM_BYTE_TOKENS:
        ch = chr(token_id)
        return repr(ch) if ch.isprintable() else f"<0x{token_id:02x}>"
    try:
        return f"<|{Special(token_id).name.lower()}|>"
    except ValueError:
        return f"<|unused_{token_id}|>"


def render_chat(messages: Sequence[tuple[str, Sequence[TextPart | MediaPart]]]) -> RenderedPrompt:
    """Token ids of a conversation and the span of every media item, in item order."""
    ids: list[int] = [Special.BOS]
    spans: list[ItemSpan] = []
    for role, parts in messages:
        if role not in ROLES:
            raise ValueError(f"message role must be one of {sorted(ROLES)}, got {role!r}")
        ids.append(ROLES[role])
        for part in parts:
            if isinstance(part, TextPart):
                ids.extend(encode_text(part.text))
                continue
            if part.kind not in PLACEHOLDERS:
                raise ValueError(f"media kind must be one of {sorted(PLACEHOLDERS)}, got {part.kind!r}")
            if part.num_tokens <= 0:
                raise ValueError(f"a media item needs at least one placeholder, got {part.num_tokens}")
            ids.append(Special.VISION_START)
            spans.append(ItemSpan(len(spans), len(ids), part.num_tokens))
            ids.extend([PLACEHOLDERS[part.kind]] * part.num_tokens)
            ids.append(Special.VISION_END)
        ids.append(Special.END)
    ids.append(Special.ASSISTANT)
    return RenderedPrompt(tuple(int(i) for i in ids), tuple(spans))
