"""Preprocessing: parity with the Hugging Face Qwen2-VL image processor, video, config."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from common.errors import ConfigError
from encoder_server.preprocess import (
    CLIP_MEAN,
    CLIP_STD,
    PreprocessConfig,
    Preprocessor,
)
from common.media import sample_frame_indices, smart_resize
from encoder_server.vision import VisionConfig

hf_pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

QWEN3 = PreprocessConfig(min_pixels=32 * 32 * 4, max_pixels=32 * 32 * 96)
QWEN2 = PreprocessConfig(patch_size=14, image_mean=CLIP_MEAN, image_std=CLIP_STD,
                         min_pixels=56 * 56, max_pixels=28 * 28 * 80)


def encode(image: Image.Image, fmt: str, **save: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def noise(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def gradient(width: int, height: int) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    rgb = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8))


# (width, height, kind, mode, format): small, large, tall, wide, odd sizes; up- and down-scaling.
CASES = [
    (64, 64, "noise", "RGB", "PNG"),
    (37, 211, "noise", "RGB", "PNG"),
    (500, 90, "gradient", "RGB", "JPEG"),
    (333, 257, "noise", "RGBA", "PNG"),
    (640, 480, "gradient", "L", "PNG"),
    (123, 77, "noise", "P", "GIF"),
    (300, 299, "gradient", "RGB", "WEBP"),
    (17, 900, "gradient", "RGB", "JPEG"),
    (1000, 180, "noise", "LA", "PNG"),
]


def hf_processor(config: PreprocessConfig) -> object:
    return hf_pil.Qwen2VLImageProcessorPil(
        patch_size=config.patch_size, merge_size=config.merge_size,
        temporal_patch_size=config.temporal_patch_size, min_pixels=config.min_pixels,
        max_pixels=config.max_pixels, image_mean=list(config.image_mean), image_std=list(config.image_std),
    )


@pytest.mark.parametrize("config", [QWEN3, QWEN2], ids=["qwen3-p16", "qwen2-p14"])
def test_pixel_values_equal_hf_processor(config: PreprocessConfig) -> None:
    processor = hf_processor(config)
    ours = Preprocessor(config)
    for seed, (width, height, kind, mode, fmt) in enumerate(CASES):
        picture = noise(width, height, seed) if kind == "noise" else gradient(width, height)
        data = encode(picture.convert(mode), fmt)
        item = ours.image(data, item=f"case{seed}")
        ref = processor(Image.open(io.BytesIO(data)), return_tensors="pt")  # type: ignore[operator]
        assert list(item.grid_thw) == ref["image_grid_thw"][0].tolist(), (width, height, fmt)
        assert torch.equal(item.hf_pixel_values(), ref["pixel_values"]), (width, height, mode, fmt)
        t, h, w = item.grid_thw
        assert item.num_tokens == t * h * w // config.merge_size**2
        assert item.kind == "image" and item.pixel_values.dtype == torch.float32
        # the rows hold the frame once: half the bytes of Hugging Face's, which repeat it
        assert item.repeat == 2 and item.pixel_values.shape == (t * h * w, ref["pixel_values"].shape[1] // 2)


def test_exif_orientation_is_applied() -> None:
    picture = gradient(96, 40)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    data = encode(picture, "JPEG", exif=exif.tobytes())
    item = Preprocessor(QWEN3).image(data)
    upright = Image.open(io.BytesIO(data))
    from PIL import ImageOps

    ref = hf_processor(QWEN3)(ImageOps.exif_transpose(upright), return_tensors="pt")  # type: ignore[operator]
    assert torch.equal(item.hf_pixel_values(), ref["pixel_values"])
    _, h, w = item.grid_thw
    assert h > w  # the 96x40 landscape became a portrait


def test_gif_uses_first_frame() -> None:
    first, second = noise(64, 48, 1), noise(64, 48, 2)
    data = encode(first, "GIF", save_all=True, append_images=[second])
    frame0 = Image.open(io.BytesIO(data))
    ref = hf_processor(QWEN3)(frame0, return_tensors="pt")  # type: ignore[operator]
    assert torch.equal(Preprocessor(QWEN3).image(data).hf_pixel_values(), ref["pixel_values"])


def test_sixteen_bit_grayscale_keeps_the_high_byte() -> None:
    wide = (np.arange(48 * 40, dtype=np.uint32).reshape(40, 48) * 34).astype(np.uint16)
    data16 = encode(Image.fromarray(wide), "PNG")
    data8 = encode(Image.fromarray((wide >> 8).astype(np.uint8)), "PNG")
    pre = Preprocessor(QWEN3)
    assert torch.equal(pre.image(data16).pixel_values, pre.image(data8).pixel_values)


def test_video_frames_fill_temporal_patches() -> None:
    pre = Preprocessor(QWEN3)
    frames = [noise(96, 64, s) for s in (10, 11, 12)]
    data = [encode(f, "PNG") for f in frames]
    video = pre.video(data)
    singles = [pre.image(d).hf_pixel_values() for d in data]
    t, h, w = video.grid_thw
    assert t == 2 and video.kind == "video"  # 3 frames padded with the last to 4 = 2 temporal patches
    assert video.num_tokens == t * h * w // 4
    p = QWEN3.patch_size
    per_frame = h * w
    vid = video.pixel_values.view(t, per_frame, 3, 2, p, p)
    img = [s.view(per_frame, 3, 2, p, p) for s in singles]
    assert torch.equal(vid[0, :, :, 0], img[0][:, :, 0])
    assert torch.equal(vid[0, :, :, 1], img[1][:, :, 0])
    assert torch.equal(vid[1, :, :, 0], img[2][:, :, 0])
    assert torch.equal(vid[1, :, :, 1], img[2][:, :, 0])  # padding repeats the last frame
    # An image is its single frame twice.
    assert torch.equal(img[0][:, :, 0], img[0][:, :, 1])


def test_video_sampling_by_fps() -> None:
    assert sample_frame_indices(8, None, 2.0, 2) == list(range(8))
    assert sample_frame_indices(8, 8.0, 2.0, 2) == [0, 7]
    assert sample_frame_indices(30, 30.0, 2.0, 2) == [0, 29]
    assert sample_frame_indices(60, 30.0, 2.0, 2) == [0, 20, 39, 59]
    assert sample_frame_indices(5, 1.0, 2.0, 2) == list(range(5))  # already slower than the target
    pre = Preprocessor(QWEN3)
    data = [encode(noise(64, 64, s), "PNG") for s in range(8)]
    sampled = pre.video(data, fps=8.0)
    explicit = pre.video([data[0], data[7]])
    assert sampled.grid_thw == explicit.grid_thw
    assert torch.equal(sampled.pixel_values, explicit.pixel_values)


def test_smart_resize_bounds() -> None:
    assert smart_resize(224, 224, 28, 56 * 56, 28 * 28 * 1280) == (224, 224)
    h, w = smart_resize(4000, 3000, 32, 1024, 32 * 32 * 100)
    assert h % 32 == 0 and w % 32 == 0 and h * w <= 32 * 32 * 100
    h, w = smart_resize(10, 20, 32, 32 * 32 * 8, 32 * 32 * 100)
    assert h * w >= 32 * 32 * 8
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300, 32, 1024, 10**6)


def test_config_from_qwen3_preprocessor_json(tmp_path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast",
    }))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({
        "size": {"longest_edge": 25165824, "shortest_edge": 4096}, "fps": 2,
    }))
    config = PreprocessConfig.from_pretrained_dir(tmp_path, max_video_frames=8)
    assert (config.patch_size, config.min_pixels, config.max_pixels) == (16, 65536, 16777216)
    assert (config.video_min_pixels, config.video_max_pixels, config.video_sample_fps) == (4096, 25165824, 2.0)
    assert config.image_mean == (0.5, 0.5, 0.5) and config.max_video_frames == 8


def test_config_from_qwen2_preprocessor_json(tmp_path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_processor_type": "Qwen2VLImageProcessor",
    }))
    config = PreprocessConfig.from_pretrained_dir(tmp_path)
    assert (config.patch_size, config.min_pixels, config.max_pixels) == (14, 3136, 12845056)
    assert config.image_mean == CLIP_MEAN and config.image_std == CLIP_STD


def test_config_falls_back_to_encoder_config(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vision_config": {"patch_size": 14, "depth": 2}}))
    config = PreprocessConfig.from_pretrained_dir(tmp_path)
    assert config.patch_size == 14 and config.max_pixels == 512 * 28 * 28


def test_fingerprint_tracks_pixel_parameters_only() -> None:
    base = PreprocessConfig()
    assert base.fingerprint() == PreprocessConfig().fingerprint()
    assert len(base.fingerprint()) == 32
    assert base.fingerprint() == PreprocessConfig(max_image_pixels=1000, max_video_frames=3).fingerprint()
    changed = [PreprocessConfig(image_mean=(0.4, 0.5, 0.5)), PreprocessConfig(max_pixels=base.max_pixels * 2),
               PreprocessConfig(patch_size=14), PreprocessConfig(video_sample_fps=1.0),
               PreprocessConfig(rescale_factor=1 / 256)]
    prints = {c.fingerprint() for c in changed}
    assert len(prints) == len(changed) and base.fingerprint() not in prints


def test_for_encoder_reads_the_checkpoint_when_present(tmp_path) -> None:
    from encoder_server.vision import load_encoder

    encoder = load_encoder()
    assert PreprocessConfig.for_encoder(encoder) == PreprocessConfig.for_encoder(encoder.config)
    assert PreprocessConfig.for_encoder(encoder, weights_dir=tmp_path, max_video_frames=3).max_video_frames == 3
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 4096,
                                                                            "longest_edge": 65536}}))
    config = PreprocessConfig.for_encoder(encoder, weights_dir=tmp_path)
    assert (config.min_pixels, config.max_pixels) == (4096, 65536)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"patch_size": 14}))
    with pytest.raises(ConfigError, match="does not match"):
        PreprocessConfig.for_encoder(encoder, weights_dir=tmp_path)


def test_warmup_item_is_a_real_minimum_image() -> None:
    item = Preprocessor(QWEN3).warmup_item()
    assert item.kind == "image" and item.num_tokens == QWEN3.min_pixels // QWEN3.factor**2
    assert torch.allclose(item.pixel_values, torch.full_like(item.pixel_values, 128 / 255 * 2 - 1), atol=1e-6)


def test_config_checks() -> None:
    vision = VisionConfig()
    PreprocessConfig.for_encoder(vision).check_matches(vision)
    with pytest.raises(ConfigError, match="does not match"):
        PreprocessConfig(patch_size=14).check_matches(vision)
    with pytest.raises(ConfigError, match="min_pixels"):
        PreprocessConfig(min_pixels=10**7, max_pixels=10**6)
    with pytest.raises(ConfigError, match="image_std"):
        PreprocessConfig(image_std=(0.5, 0.0, 0.5))
