"""The native CPU frame-attention kernel against torch's SDPA, and when it is (not) used."""

from __future__ import annotations

import pytest
import torch

from common.errors import ConfigError
from encoder_server.vision import native
from encoder_server.vision.model import frame_attention, sdpa_frame_attention


def _kernel() -> object:
    if not native.cpu_supported():
        pytest.skip(f"no AVX-512 on this CPU (torch reports {torch.backends.cpu.get_cpu_capability()})")
    try:
        return native.build()
    except ConfigError as exc:
        pytest.skip(f"native kernel cannot be built here: {exc}")


@pytest.fixture(autouse=True)
def _default_mode() -> object:
    native.configure("auto")
    yield
    native.configure("auto")


# Lengths around the kernel's tiles (16 query rows, 16-key vectors, 256-key steps), a single patch,
# and the default preprocessing's largest frame (2048 patches).
LENGTHS = [1, 7, 15, 16, 17, 255, 256, 257, 600, 2048]


def _errors(kernel: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            frames: torch.Tensor) -> tuple[torch.Tensor, float, float, float]:
    """The kernel's output, its and SDPA's largest error against a float64 SDPA, and the output's scale."""
    exact = sdpa_frame_attention(q.double(), k.double(), v.double(), frames)
    out = kernel.frame_attention(q, k, v, frames)  # type: ignore[attr-defined]
    ours = float((out.double() - exact).abs().max())
    theirs = float((sdpa_frame_attention(q, k, v, frames).double() - exact).abs().max())
    return out, ours, theirs, float(exact.abs().max())


@pytest.mark.parametrize("head_dim", sorted(native.HEAD_DIMS))
def test_kernel_is_as_exact_as_sdpa_for_every_head_size(head_dim: int) -> None:
    kernel = _kernel()
    generator = torch.Generator().manual_seed(head_dim)
    lengths = LENGTHS if head_dim <= 32 else [1, 17, 256, 300]
    rows, heads = sum(lengths) + 40, 3
    # q, k, v as the tower makes them: views into one [rows, 3, heads, dim] tensor, rows strided.
    qkv = torch.randn(rows, 3, heads, head_dim, generator=generator) * 2
    q, k, v = qkv.unbind(1)
    frames = torch.tensor(lengths + [0] * 5, dtype=torch.int64)
    out, ours, theirs, scale = _errors(kernel, q, k, v, frames)
    # Both round in float32 and sum in different orders; measured: within 2x of SDPA's own error,
    # a few 1e-6 of the output's scale (tests/unit/test_vision.py holds the tower to transformers).
    assert ours <= 3 * theirs + 1e-6, (ours, theirs)
    assert ours <= 5e-6 * scale, (ours, scale)
    assert torch.equal(out[sum(lengths):], torch.zeros(40, heads, head_dim))


def test_kernel_keeps_large_score_ranges_finite() -> None:
    kernel = _kernel()
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(300, 2, 16, generator=generator) for _ in range(3))
    q = q * 40  # scores spread over thousands: most weights underflow to 0, none become NaN
    frames = torch.tensor([300])
    out, ours, theirs, _ = _errors(kernel, q, k, v, frames)
    assert torch.isfinite(out).all()
    assert ours <= 3 * theirs + 1e-6, (ours, theirs)


def test_kernel_refuses_inputs_it_was_not_written_for() -> None:
    kernel = _kernel()
    q = torch.randn(8, 1, 16)
    with pytest.raises(RuntimeError, match="float32 only"):
        kernel.frame_attention(q.double(), q.double(), q.double(), torch.tensor([8]))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="unsupported head_dim 12"):
        r = torch.randn(8, 1, 12)
        kernel.frame_attention(r, r, r, torch.tensor([8]))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="add up to 9 rows, more than the 8"):
        kernel.frame_attention(q, q, q, torch.tensor([4, 5]))  # type: ignore[attr-defined]


def test_dispatch_uses_the_kernel_only_where_it_applies() -> None:
    kernel = _kernel()
    assert native.prepare() is kernel or native.prepare() is not None
    assert native.kernel_for(torch.empty(4, 2, 16)) is not None
    assert native.kernel_for(torch.empty(4, 2, 16, dtype=torch.bfloat16)) is None  # float32 only
    assert native.kernel_for(torch.empty(4, 2, 12)) is None  # no variant for this head size
    assert native.describe(16, "cpu", torch.float32) == "native CPU kernel"
    native.configure("sdpa")
    assert native.kernel_for(torch.empty(4, 2, 16)) is None
    assert native.describe(16, "cpu", torch.float32) == "torch SDPA"


def test_bf16_and_sdpa_mode_go_through_sdpa() -> None:
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(40, 2, 16, generator=generator) for _ in range(3))
    frames = torch.tensor([24, 16])
    native.configure("sdpa")
    assert torch.equal(frame_attention(q, k, v, frames), sdpa_frame_attention(q, k, v, frames))
    native.configure("auto")
    b = [t.bfloat16() for t in (q, k, v)]
    assert torch.equal(frame_attention(*b, frames), sdpa_frame_attention(*b, frames))


def test_library_name_follows_the_source_and_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    name = native.library_name()
    assert name.startswith("epd_frame_attention_") and name == native.library_name()
    monkeypatch.setattr(native, "CFLAGS", (*native.CFLAGS, "-g"))
    assert native.library_name() != name


def test_native_mode_fails_loudly_without_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "cpu_supported", lambda: False)
    native.configure("native")
    with pytest.raises(ConfigError, match="needs an AVX-512 CPU"):
        native.prepare()
    native.configure("auto")
    assert native.prepare() is None  # auto: SDPA, no error
    assert native.kernel_for(torch.empty(4, 2, 16)) is None


def test_search_puts_the_compile_cache_first(tmp_path: object) -> None:
    native.configure("auto", str(tmp_path))
    dirs = native.search_dirs()
    assert dirs[0] == tmp_path / "native" and len(dirs) == 2  # type: ignore[operator]
