from __future__ import annotations

import dataclasses

import argparse
import re

import pytest

from common.config import (
    CacheConfig,
    CacheMode,
    EncoderServerConfig,
    PrefillConfig,
    ProxyConfig,
    TransportKind,
    add_arguments,
    build,
    build_from_mapping,
    describe,
)
from common.errors import ConfigError


def _parse(cls: type, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, cls)
    return parser.parse_args(argv)


def test_min_hold_defaults_by_mode() -> None:
    assert CacheConfig(mode=CacheMode.EPD).effective_min_hold_ms == 100
    assert CacheConfig(mode=CacheMode.MONOLITHIC).effective_min_hold_ms == 0
    assert CacheConfig(mode=CacheMode.EPD, min_hold_ms=5).effective_min_hold_ms == 5


def test_precedence_cli_over_env_over_default() -> None:
    env = {"EPD_PORT": "7000", "EPD_MIN_HOLD_MS": "7", "EPD_MODEL_ID": "from-env"}
    cfg = build(EncoderServerConfig, _parse(EncoderServerConfig, ["--port", "8000"]), env)
    assert cfg.port == 8000
    assert cfg.cache.min_hold_ms == 7
    assert cfg.model_id == "from-env"
    assert cfg.metrics_port == 9400
    assert build(EncoderServerConfig, None, {}) == EncoderServerConfig()


def test_types_enums_and_lists() -> None:
    cfg = build(PrefillConfig, _parse(PrefillConfig, ["--encoder", "a:1, b:2", "--transport", "mock"]), {})
    assert cfg.encoders == ("a:1", "b:2")
    assert cfg.transport is TransportKind.MOCK
    cfg = build(EncoderServerConfig, None, {"EPD_CACHE_BLOCKS": "0x10", "EPD_CACHE_MODE": "MONOLITHIC"})
    assert cfg.cache.num_blocks == 16
    assert cfg.cache.mode is CacheMode.MONOLITHIC


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"EPD_PORT": "eighty"}, "EPD_PORT"),
        ({"EPD_PORT": "70000"}, "port"),
        ({"EPD_BLOCK_SIZE": "0"}, "block_size"),
        ({"EPD_BLOCK_SIZE": "-64"}, "block_size must be > 0, got -64"),
        ({"EPD_BLOCK_SIZE": "wide"}, "EPD_BLOCK_SIZE"),
        ({"EPD_CACHE_BLOCKS": "1"}, "num_blocks"),
        ({"EPD_CACHE_DTYPE": "int8"}, "int8"),
        ({"EPD_TRANSPORT": "carrier-pigeon"}, "EPD_TRANSPORT"),
        ({"EPD_DRAIN_GRACE_S": "nan"}, "EPD_DRAIN_GRACE_S"),
        ({"EPD_TLS_CERT": "cert.pem"}, "tls-key"),
    ],
)
def test_bad_values_raise_config_error_naming_them(env: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        build(EncoderServerConfig, None, env)


def test_layout_sizing_precedence() -> None:
    assert CacheConfig(block_size=256, cache_tokens=1000).layout(64, 1).num_blocks == 5
    by_bytes = CacheConfig(block_size=16, cache_bytes=16 * 64 * 2 * 2 * 10).layout(64, 1)
    assert by_bytes.num_blocks == 10
    assert CacheConfig(block_size=16, num_blocks=3, cache_bytes=10**9).layout(64, 1).num_blocks == 3
    with pytest.raises(ConfigError, match="cache_bytes"):
        CacheConfig(block_size=16, cache_bytes=100).layout(64, 1)


def test_block_size_default_comes_from_the_row_width() -> None:
    cfg = build(EncoderServerConfig, None, {})
    assert cfg.cache.block_size is None
    assert cfg.cache.layout(64, 2).block_size == 64  # the tiny model: 384-byte rows
    assert cfg.cache.layout(4096, 3).block_size == 32  # 32 KiB rows: 1 MiB blocks
    assert CacheConfig(dtype="float32").layout(4096, 3).block_size == 16  # 64 KiB rows: the floor
    # An empty variable means "not set": the automatic default.
    assert build(EncoderServerConfig, None, {"EPD_BLOCK_SIZE": ""}).cache.layout(4096, 3).block_size == 32


def test_explicit_block_size_is_honoured() -> None:
    assert CacheConfig(block_size=256).layout(64, 2).block_size == 256
    assert build(EncoderServerConfig, None, {"EPD_BLOCK_SIZE": "256"}).cache.layout(4096, 3).block_size == 256
    args = _parse(EncoderServerConfig, ["--block-size", "24"])
    assert build(EncoderServerConfig, args, {"EPD_BLOCK_SIZE": "256"}).cache.layout(64, 2).block_size == 24


def test_block_counts_use_the_resolved_block_size() -> None:
    assert CacheConfig(cache_tokens=1000).layout(64, 2).num_blocks == 17  # ceil(1000 / 64) + 1
    assert CacheConfig(cache_tokens=1000).layout(4096, 3).num_blocks == 33  # ceil(1000 / 32) + 1
    assert CacheConfig(cache_bytes=10 * 64 * 384).layout(64, 2).num_blocks == 10


def test_frozen() -> None:
    cfg = EncoderServerConfig()
    with pytest.raises(Exception):
        cfg.port = 1  # type: ignore[misc]


def test_from_mapping_by_field_or_flag_name_then_env() -> None:
    mapping = {"encoders": ["a:1", "b:2"], "rpc-timeout-s": 3, "tls_ca": "/ca.pem", "auth_token": "t",
               "keep_freed_memory": False}
    cfg = build_from_mapping(PrefillConfig, mapping, "extra", {"EPD_MODEL_ID": "m", "EPD_RPC_TIMEOUT_S": "9"})
    assert cfg.encoders == ("a:1", "b:2") and cfg.rpc_timeout_s == 3.0 and cfg.model_id == "m"
    assert cfg.tls.ca == "/ca.pem" and cfg.tls.auth_token == "t" and cfg.keep_freed_memory is False
    assert build_from_mapping(PrefillConfig, {"encoder": "x:1"}, "extra").encoders == ("x:1",)
    with pytest.raises(ConfigError, match="extra: unknown setting 'encodrs'"):
        build_from_mapping(PrefillConfig, {"encodrs": "x:1"}, "extra")
    with pytest.raises(ConfigError, match="extra 'pull_timeout_s' has an invalid value 'soon'"):
        build_from_mapping(PrefillConfig, {"pull_timeout_s": "soon"}, "extra")


def test_proxy_config_checks_its_urls() -> None:
    with pytest.raises(ConfigError, match="backend must be an http"):
        build(ProxyConfig, None, {"EPD_PROXY_BACKENDS": "vllm:8000"})
    assert build(ProxyConfig, None, {"EPD_PROXY_ALLOW_REMOTE_MEDIA": "a.example, b.example"}).allow_remote_media == (
        "a.example", "b.example")


def test_proxy_lookup_min_bytes_reaches_the_proxys_client() -> None:
    from prefill_client.consumer.known import DERIVE_MIN_BYTES
    from prefill_client.proxy.clients import new_client

    assert build(ProxyConfig, None, {}).lookup_min_bytes == DERIVE_MIN_BYTES
    cfg = build(ProxyConfig, _parse(ProxyConfig, ["--lookup-min-bytes", "1048576"]), {"EPD_PROXY_LOOKUP_MIN_BYTES": "7"})
    assert cfg.lookup_min_bytes == 1 << 20
    client = new_client(dataclasses.replace(cfg, transport="mock"), "m")
    try:
        assert client._known._min_bytes == 1 << 20
    finally:
        client.close()
    with pytest.raises(ConfigError, match="lookup_min_bytes must be >= 0"):
        build(ProxyConfig, None, {"EPD_PROXY_LOOKUP_MIN_BYTES": "-1"})


def test_proxy_model_id_is_optional() -> None:
    # Unset, the proxy takes each request's model (else the backends' /v1/models) for the handshake.
    assert build(ProxyConfig, None, {}).model_id is None
    assert build(ProxyConfig, None, {"EPD_MODEL_ID": ""}).model_id is None
    assert build(ProxyConfig, _parse(ProxyConfig, ["--model-id", "my-vlm"]), {"EPD_MODEL_ID": "x"}).model_id == "my-vlm"
    with pytest.raises(ConfigError, match="model_id must be non-empty when given"):
        ProxyConfig(model_id=" ")


@pytest.mark.parametrize("cls", [EncoderServerConfig, PrefillConfig, ProxyConfig])
def test_readme_documents_every_flag_and_env(cls: type, repo_root) -> None:
    readme = (repo_root / "README.md").read_text()
    for info in describe(cls):
        assert f"`{info.flag}`" in readme, f"README lacks flag {info.flag}"
        assert f"`{info.env}`" in readme, f"README lacks env var {info.env}"
