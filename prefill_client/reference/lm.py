"""The reference worker's language model: a small Qwen3-style decoder (prefill process).

Structure and parameter names follow Qwen3's text model (``model.embed_tokens``,
``model.layers.N.self_attn.{q,k,v,o}_proj`` with per-head ``q_norm`` /
``k_norm``, ``mlp.{gate,up,down}_proj``, RMSNorm, rotary embeddings,
``lm_head``), so a small checkpoint of that family loads with
:func:`load_lm`; without one the weights are a deterministic random init
from a seed. Deepstack features are added to the hidden states after the
first ``num_deepstack_levels`` decoder layers, as Qwen3-VL does (level ``k``
after layer ``k``).

Positions are 1-D: M-RoPE (separate temporal / height / width sections for
image tokens) is not modelled, which changes logits but nothing the cache
layers observe. The model only prefills; there is no decode loop.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.errors import ConfigError
from prefill_client.reference.tokenizer import DEFAULT_VOCAB_SIZE, MIN_VOCAB_SIZE

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class LMConfig:
    """Shape of the decoder; ``hidden_size`` must equal the encoder's ``out_hidden_size``."""

    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    vocab_size: int = DEFAULT_VOCAB_SIZE
    num_deepstack_levels: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"LM {name} must be > 0, got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"LM num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"LM head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ConfigError(f"LM vocab_size {self.vocab_size} is below the tokenizer's {MIN_VOCAB_SIZE} ids")
        # Level k is added after layer k; one after the last layer would reach no later
        # layer, so it could not change the first token.
        if not 0 <= self.num_deepstack_levels < self.num_layers:
            raise ConfigError(
                f"LM num_deepstack_levels must be in [0, num_layers={self.num_layers}), "
                f"got {self.num_deepstack_levels}")

    @classmethod
    def from_hf(cls, raw: dict[str, Any], num_deepstack_levels: int) -> LMConfig:
        """From a Hugging Face ``config.json`` (a VL config's ``text_config`` is used when present)."""
        text = raw.get("text_config", raw)
        try:
            heads = int(text["num_attention_heads"])
            hidden = int(text["hidden_size"])
            return cls(
                hidden_size=hidden,
                num_layers=int(text["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(text.get("num_key_value_heads", heads)),
                head_dim=int(text.get("head_dim") or hidden // heads),
                intermediate_size=int(text["intermediate_size"]),
                vocab_size=int(text["vocab_size"]),
                num_deepstack_levels=num_deepstack_levels,
                rope_theta=float(text.get("rope_theta", 10000.0)),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            )
        except KeyError as exc:
            raise ConfigError(f"LM config.json lacks {exc.args[0]!r}") from None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, head_dim]`` for 1-D positions (rotate-half convention)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, c: LMConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        past: torch.Tensor, mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]``, ``past [2, P, kv_heads, head_dim]``, ``mask [T, P + T]`` (True attends).

        Returns the output and this step's KV ``[2, T, kv_heads, head_dim]`` (keys after rotary).
        """
        c, t = self.c, x.shape[0]
        q = _rotate(self.q_norm(self.q_proj(x).view(t, c.num_heads, c.head_dim)), cos, sin)
        k = _rotate(self.k_norm(self.k_proj(x).view(t, c.num_kv_heads, c.head_dim)), cos, sin)
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        keys = torch.cat([past[0], k], dim=0)
        values = torch.cat([past[1], v], dim=0)
        group = c.num_heads // c.num_kv_heads
        # [1, heads, T, D] layout for SDPA; kv heads repeat for grouped-query attention.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.repeat_interleave(group, dim=1).transpose(0, 1)[None],
            values.repeat_interleave(group, dim=1).transpose(0, 1)[None],
            attn_mask=mask[None, None],
        )
        out = out[0].transpose(0, 1).reshape(t, c.num_heads * c.head_dim)
        return self.o_proj(out), torch.stack([k, v])


class MLP(nn.Module):
    def __init__(self, c: LMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, c: LMConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: torch.Tensor, mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, kv = self.self_attn(self.input_layernorm(x), cos, sin, past, mask)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


class Backbone(nn.Module):
    def __init__(self, c: LMConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(c) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class TinyLM(nn.Module):
    """Decoder-only LM; :meth:`forward` is one static-shape prefill step."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int) -> TinyLM:
        """Deterministic random init: the same seed gives bit-identical weights everywhere."""
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        return self

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.model.embed_tokens(token_ids)
        return out

    def forward(
        self,
        hidden: torch.Tensor,
        deepstack: list[torch.Tensor],
        past_kv: torch.Tensor,
        past_len: torch.Tensor,
        last_index: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the layers over ``hidden [T, H]`` (new tokens, already merged).

        ``past_kv [layers, 2, P, kv_heads, head_dim]`` holds the cached prefix
        in its first ``past_len`` rows (the rest is padding, masked out); new
        token ``i`` sits at position ``past_len + i``. Padding rows of
        ``hidden`` come after the real ones, so causal masking keeps them out
        of every real row. Returns the logits of row ``last_index`` and this
        step's KV ``[layers, 2, T, kv_heads, head_dim]``.
        """
        c = self.config
        t, p = hidden.shape[0], past_kv.shape[2]
        steps = torch.arange(t, device=hidden.device)
        cos, sin = rope(past_len + steps, c.head_dim, c.rope_theta)
        past_valid = (torch.arange(p, device=hidden.device) < past_len)[None, :].expand(t, p)
        causal = steps[None, :] <= steps[:, None]
        mask = torch.cat([past_valid, causal], dim=1)
        cos, sin = cos.to(hidden.dtype), sin.to(hidden.dtype)
        new_kv = []
        x = hidden
        for i, layer in enumerate(self.model.layers):
            x, kv = layer(x, cos, sin, past_kv[i], mask)
            new_kv.append(kv)
            if i < len(deepstack):
                x = x + deepstack[i]
        last = self.model.norm(x.index_select(0, last_index.reshape(1)))
        return self.lm_head(last)[0], torch.stack(new_kv)


def build_lm(config: LMConfig, *, seed: int = 0, weights_dir: str | Path | None = None) -> TinyLM:
    """A random-init LM from ``config``, or the checkpoint in ``weights_dir``."""
    if weights_dir is not None:
        return load_lm(weights_dir, num_deepstack_levels=config.num_deepstack_levels)
    return TinyLM(config).init_weights(seed).eval()


def _remap(name: str) -> str | None:
    """Our parameter name for a checkpoint key; None for keys outside the language model."""
    if name.startswith("model.language_model."):  # Qwen3-VL nests the text model
        return "model." + name[len("model.language_model."):]
    if name.startswith(("model.embed_tokens.", "model.layers.", "model.norm.", "lm_head.")):
        return name
    return None


def load_lm(weights_dir: str | Path, *, num_deepstack_levels: int) -> TinyLM:
    """Load ``config.json`` + ``*.safetensors`` from a directory; every LM parameter must be present."""
    from safetensors.torch import load_file

    root = Path(weights_dir)
    try:
        raw = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--lm-weights {str(root)!r}: cannot read {CONFIG_FILE}: {exc}") from exc
    model = TinyLM(LMConfig.from_hf(raw, num_deepstack_levels))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"--lm-weights {str(root)!r} holds no *.safetensors file")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        for key, tensor in load_file(str(path)).items():
            ours = _remap(key)
            if ours is not None:
                state[ours] = tensor
    expected = dict(model.named_parameters())
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(k for k in set(state) - set(expected) if k != "lm_head.weight")
    if missing or unexpected:
        raise ConfigError(
            f"--lm-weights {str(root)!r}: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    with torch.no_grad():
        for name, param in expected.items():
            if tuple(state[name].shape) != tuple(param.shape):
                raise ConfigError(
                    f"--lm-weights {str(root)!r}: {name} is {tuple(state[name].shape)}, "
                    f"expected {tuple(param.shape)}")
            param.copy_(state[name].to(param.dtype))
    logger.info("loaded LM weights from %s (%d tensors)", root, len(expected))
    return model.eval()


def save_lm(model: TinyLM, weights_dir: str | Path) -> None:
    """Write ``config.json`` (Hugging Face keys) and ``model.safetensors``."""
    from safetensors.torch import save_file

    root = Path(weights_dir)
    root.mkdir(parents=True, exist_ok=True)
    c = model.config
    raw = {
        "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size,
        "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": c.tie_word_embeddings,
    }
    (root / CONFIG_FILE).write_text(json.dumps(raw, indent=2))
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()
               if not (c.tie_word_embeddings and k == "lm_head.weight")}
    save_file(tensors, str(root / WEIGHTS_FILE))
