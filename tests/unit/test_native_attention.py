"""The native CPU frame-attention kernel against torch's SDPA, and when it is (not) used."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from common.errors import ConfigError
from encoder_server.vision import native
from encoder_server.vision.model import TanhGELU, frame_attention, sdpa_frame_attention
from encoder_server.vision.rotary import rotate, rotate_qk


def _kernel(isa: str | None = None) -> object:
    """The kernel's build for ``isa`` (default: this CPU's widest); skips where this CPU cannot run it."""
    capability = torch.backends.cpu.get_cpu_capability()
    if not native.cpu_supported():
        pytest.skip(f"no AVX2 with FMA on this CPU (torch reports {capability})")
    if isa is not None and isa not in native.cpu_isas():
        pytest.skip(f"this CPU cannot run the {isa} build (torch reports {capability})")
    try:
        return native.build(isa=isa)
    except ConfigError as exc:
        pytest.skip(f"native kernel cannot be built here: {exc}")


# Every build this CPU can run is tested: an AVX-512 CPU runs both.
ISAS = sorted(native.ISA_FLAGS)


@pytest.fixture(autouse=True)
def _default_mode() -> object:
    native.configure("auto")
    yield
    native.configure("auto")


# Lengths around the kernel's tiles (16 or 12 query rows, 8- and 16-key vectors, 256-key steps), a
# single patch, and the default preprocessing's largest frame (2048 patches).
LENGTHS = [1, 7, 9, 12, 13, 15, 16, 17, 255, 256, 257, 600, 2048]


def _errors(kernel: object, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            frames: torch.Tensor) -> tuple[torch.Tensor, float, float, float]:
    """The kernel's output, its and SDPA's largest error against a float64 SDPA, and the output's scale."""
    exact = sdpa_frame_attention(q.double(), k.double(), v.double(), frames)
    out = kernel.frame_attention(q, k, v, frames)  # type: ignore[attr-defined]
    ours = float((out.double() - exact).abs().max())
    theirs = float((sdpa_frame_attention(q, k, v, frames).double() - exact).abs().max())
    return out, ours, theirs, float(exact.abs().max())


@pytest.mark.parametrize(("isa", "head_dim"), [(isa, dim) for isa in ISAS for dim in sorted(native.HEAD_DIMS[isa])])
def test_kernel_is_as_exact_as_sdpa_for_every_head_size(isa: str, head_dim: int) -> None:
    kernel = _kernel(isa)
    assert kernel.isa() == isa and kernel.supports(head_dim)  # type: ignore[attr-defined]
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


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_keeps_large_score_ranges_finite(isa: str) -> None:
    kernel = _kernel(isa)
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(300, 2, 16, generator=generator) for _ in range(3))
    q = q * 40  # scores spread over thousands: most weights underflow to 0, none become NaN
    frames = torch.tensor([300])
    out, ours, theirs, _ = _errors(kernel, q, k, v, frames)
    assert torch.isfinite(out).all()
    assert ours <= 3 * theirs + 1e-6, (ours, theirs)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("order", ["rising", "falling"])
def test_kernel_is_exact_when_the_best_key_comes_last_or_first(isa: str, order: str) -> None:
    # Scores that rise (or fall) steadily along the frame's keys, over about 290 in base 2: a row's
    # best key is its last (or first) one. Where the kernel offsets scores by a score it has seen
    # rather than the running maximum, rising scores make it move that offset again and again.
    kernel = _kernel(isa)
    generator = torch.Generator().manual_seed(2)
    length, heads, dim = 600, 2, 16
    direction = torch.randn(dim, generator=generator)
    direction = direction / direction.norm()
    ramp = torch.linspace(-1.0, 1.0, length) if order == "rising" else torch.linspace(1.0, -1.0, length)
    k = (ramp[:, None] * direction * 20 + 0.3 * torch.randn(length, dim, generator=generator))
    q = direction * 20 + 0.3 * torch.randn(length, dim, generator=generator)
    v = torch.randn(length, heads, dim, generator=generator)
    q, k = (x[:, None, :].expand(length, heads, dim).contiguous() for x in (q, k))
    out, ours, theirs, _ = _errors(kernel, q, k, v, torch.tensor([length]))
    assert torch.isfinite(out).all()
    assert ours <= 3 * theirs + 1e-6, (ours, theirs)


@pytest.mark.parametrize("isa", ISAS)
def test_kernel_refuses_inputs_it_was_not_written_for(isa: str) -> None:
    kernel = _kernel(isa)
    q = torch.randn(8, 1, 16)
    with pytest.raises(RuntimeError, match="float32 only"):
        kernel.frame_attention(q.double(), q.double(), q.double(), torch.tensor([8]))  # type: ignore[attr-defined]
    # the Python side's list of head sizes is the build's own
    supported = [d for d in range(1, 257) if kernel.supports(d)]  # type: ignore[attr-defined]
    assert supported == sorted(native.HEAD_DIMS[isa])
    for dim in (12, 144, *sorted({16, 32, 48, 64, 72, 80, 96, 128} - native.HEAD_DIMS[isa])):
        assert not kernel.supports(dim)  # type: ignore[attr-defined]
        with pytest.raises(RuntimeError, match=f"unsupported head_dim {dim}"):
            r = torch.randn(8, 1, dim)
            kernel.frame_attention(r, r, r, torch.tensor([8]))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="add up to 9 rows, more than the 8"):
        kernel.frame_attention(q, q, q, torch.tensor([4, 5]))  # type: ignore[attr-defined]


def test_dispatch_uses_the_kernel_only_where_it_applies() -> None:
    kernel = _kernel()
    assert native.prepare() is kernel or native.prepare() is not None
    assert native.kernel_for(torch.empty(4, 2, 16)) is not None
    assert native.kernel_for(torch.empty(4, 2, 16, dtype=torch.bfloat16)) is None  # float32 only
    assert native.kernel_for(torch.empty(4, 2, 12)) is None  # no variant for this head size
    # the AVX2 build leaves 64 and up to SDPA; the AVX-512 build takes them
    assert (native.kernel_for(torch.empty(4, 2, 64)) is not None) == (native.cpu_isa() == "avx512")
    assert native.describe(16, "cpu", torch.float32) == f"native CPU kernel ({native.cpu_isa()})"
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
    name = native.library_name("avx2")
    assert name.startswith("epd_frame_attention_avx2_") and name == native.library_name("avx2")
    assert native.library_name("avx512") != name
    monkeypatch.setattr(native, "CFLAGS", (*native.CFLAGS, "-g"))
    assert native.library_name("avx2") != name


def test_native_mode_fails_loudly_without_avx2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "cpu_isas", lambda: ())
    native.configure("native")
    with pytest.raises(ConfigError, match="needs an x86-64 CPU with AVX2 and FMA"):
        native.prepare()
    native.configure("auto")
    assert native.prepare() is None  # auto: SDPA, no error
    assert native.kernel_for(torch.empty(4, 2, 16)) is None


def test_search_puts_the_compile_cache_first(tmp_path: object) -> None:
    native.configure("auto", str(tmp_path))
    dirs = native.search_dirs()
    assert dirs[0] == tmp_path / "native" and len(dirs) == 2  # type: ignore[operator]


def test_build_refuses_an_isa_this_cpu_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "cpu_isas", lambda: ("avx2",))
    with pytest.raises(ConfigError, match="cannot run the avx512 build"):
        native.build(isa="avx512")
    with pytest.raises(ConfigError, match="no build of the native attention kernel for 'sse2'"):
        native.build(isa="sse2")


def test_an_avx512_cpu_falls_back_to_the_avx2_build_then_to_sdpa(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    built: list[str | None] = []
    avx2_module = types.SimpleNamespace(isa=lambda: "avx2")

    def fake_build(directory: object = None, isa: str | None = None) -> object:
        built.append(isa)
        if isa == "avx512":
            raise ConfigError("cannot build the native attention kernel in 'x': no compiler")
        return avx2_module

    monkeypatch.setattr(native, "cpu_isas", lambda: ("avx512", "avx2"))
    monkeypatch.setattr(native, "build", fake_build)
    native.configure("native")
    with caplog.at_level("WARNING", logger=native.__name__):
        assert native.prepare() is avx2_module
    assert built == ["avx512", "avx2"]
    assert native.kernel_for(torch.empty(4, 2, 64)) is None  # the AVX2 build's head sizes now apply
    assert "the avx2 build of the native kernel" in caplog.text and "no compiler" in caplog.text

    def failing_build(directory: object = None, isa: str | None = None) -> object:
        raise ConfigError(f"cannot build the {isa} build")

    monkeypatch.setattr(native, "build", failing_build)
    native.configure("native")  # native: every build failed, so start-up fails, naming each failure
    with pytest.raises(ConfigError, match="cannot build the avx512 build; cannot build the avx2 build"):
        native.prepare()
    native.configure("auto")  # auto: SDPA
    assert native.prepare() is None


@pytest.mark.parametrize("isa", ISAS)
def test_gelu_tanh_is_as_exact_as_torchs(isa: str) -> None:
    kernel = _kernel(isa)
    generator = torch.Generator().manual_seed(3)
    for shape in [(8192, 64), (7, 3), (1, 1), (0, 4), (33,)]:
        x = torch.randn(*shape, generator=generator) * 4
        exact = F.gelu(x.double(), approximate="tanh")
        out = kernel.gelu_tanh(x)  # type: ignore[attr-defined]
        assert out.shape == x.shape and out.dtype == torch.float32
        if x.numel():
            theirs = float((F.gelu(x, approximate="tanh").double() - exact).abs().max())
            assert float((out.double() - exact).abs().max()) <= 2 * theirs + 1e-7
    # far tails and a NaN: x itself, 0 to float precision, NaN; a strided view is read as it lies
    edges = torch.tensor([-1e4, -30.0, 30.0, 1e4, float("nan")])
    out = kernel.gelu_tanh(edges)  # type: ignore[attr-defined]
    assert out[:2].abs().max() < 1e-12 and torch.equal(out[2:4], edges[2:4]) and out[4].isnan()
    wide = torch.randn(64, 40, generator=generator)
    strided = kernel.gelu_tanh(wide[:, ::2])  # type: ignore[attr-defined]
    assert torch.equal(strided, kernel.gelu_tanh(wide[:, ::2].contiguous()))  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="float32 CPU tensors only"):
        kernel.gelu_tanh(wide.double())  # type: ignore[attr-defined]


def test_tower_gelu_takes_the_kernel_only_in_eager_float32_inference() -> None:
    kernel = _kernel()
    gelu = TanhGELU()
    x = torch.randn(100, 64)
    assert native.elementwise_kernel_for(x) is kernel
    assert torch.equal(gelu(x), kernel.gelu_tanh(x))  # type: ignore[attr-defined]
    assert native.elementwise_kernel_for(x.bfloat16()) is None
    grad = x.clone().requires_grad_()
    assert native.elementwise_kernel_for(grad) is None
    gelu(grad).sum().backward()  # torch's op, so gradients flow
    assert grad.grad is not None
    native.configure("sdpa")  # no kernel: torch's
    assert native.elementwise_kernel_for(x) is None
    assert torch.equal(gelu(x), F.gelu(x, approximate="tanh"))


@pytest.mark.parametrize("isa", ISAS)
def test_rotary_bf16_equals_the_reference_bit_for_bit(isa: str) -> None:
    kernel = _kernel(isa)
    generator = torch.Generator().manual_seed(4)
    for rows, heads, dim in [(2560, 16, 64), (37, 3, 72), (5, 1, 2)]:
        # q and k as the tower hands them over: a strided [rows, 2, heads, dim] view of qkv
        qkv = (torch.randn(rows, 3, heads, dim, generator=generator) * 5).bfloat16()
        angles = torch.randn(rows, dim // 2, generator=generator) * 10
        cos, sin = angles.cos(), angles.sin()
        exact = rotate(qkv[:, :2], cos[:, None, None], sin[:, None, None], torch.bfloat16)
        out = kernel.rotary_bf16(qkv[:, :2], cos, sin)  # type: ignore[attr-defined]
        assert out.shape == (rows, 2, heads, dim) and out.dtype == torch.bfloat16 and out.is_contiguous()
        assert torch.equal(out.view(torch.int16), exact.view(torch.int16))
    # infinities, NaN and the largest finite values round as torch rounds them
    edges = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.3e38, -3.3e38, 1e-40, 1.0, 0.0])
    x = edges.view(-1, 1, 1, 1).expand(-1, 1, 1, 2).contiguous().bfloat16()
    cos, sin = torch.full((8, 1), 0.75), torch.full((8, 1), 0.5)
    out = kernel.rotary_bf16(x, cos, sin)  # type: ignore[attr-defined]
    exact = rotate(x, cos[:, None, None], sin[:, None, None], torch.bfloat16)
    assert torch.equal(out.isnan(), exact.isnan()) and torch.equal(out[~out.isnan()], exact[~exact.isnan()])


@pytest.mark.parametrize("isa", ISAS)
def test_rotary_bf16_refuses_inputs_it_was_not_written_for(isa: str) -> None:
    kernel = _kernel(isa)
    x = torch.zeros(4, 2, 3, 8, dtype=torch.bfloat16)
    cos = torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match="bfloat16 CPU tensor"):
        kernel.rotary_bf16(x.float(), cos, cos)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="contiguous last dim"):
        kernel.rotary_bf16(torch.zeros(4, 2, 8, 3, dtype=torch.bfloat16).transpose(2, 3), cos, cos)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"\[rows, dim / 2\] float32"):
        kernel.rotary_bf16(x, torch.zeros(4, 8), cos)  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match=r"\[rows, dim / 2\] float32"):
        kernel.rotary_bf16(x, cos.bfloat16(), cos)  # type: ignore[attr-defined]


def test_tower_rotary_takes_the_kernel_only_in_eager_bf16_inference() -> None:
    kernel = _kernel()
    generator = torch.Generator().manual_seed(6)
    qk = torch.randn(20, 2, 2, 16, generator=generator).bfloat16()
    cos, sin = torch.rand(20, 8, generator=generator), torch.rand(20, 8, generator=generator)
    assert native.bf16_kernel_for(qk) is kernel
    assert native.bf16_kernel_for(qk.float()) is None
    assert native.bf16_kernel_for(qk.clone().requires_grad_()) is None
    reference = rotate(qk, cos[:, None, None], sin[:, None, None], torch.bfloat16)
    assert torch.equal(rotate_qk(qk, cos, sin, torch.bfloat16), reference)
    native.configure("sdpa")  # no kernel: torch's element-wise ops, the same values
    assert native.bf16_kernel_for(qk) is None
    assert torch.equal(rotate_qk(qk, cos, sin, torch.bfloat16), reference)
    f32 = qk.float()
    assert torch.equal(rotate_qk(f32, cos, sin, torch.float32), rotate(f32, cos[:, None, None], sin[:, None, None],
                                                                         torch.float32))
