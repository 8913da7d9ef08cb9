"""The encoder's start-up, piece by piece: nothing slow before the port, the gate, the compile cache.

The whole sequence, on a real process with compiled graphs, is in
``tests/system/test_encoder_startup.py``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import config, layout, metrics
from common.config import LIVENESS_SERVICE, READINESS_SERVICE, EncoderServerConfig, build
from common.errors import ConfigError
from common.wire import PROTOCOL_VERSION, SERVICE_NAME, pb2, pb2_grpc
from encoder_server.compile_cache import use_compile_cache
from encoder_server.server import EncoderServer, WarmupAbandoned

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE",
             "TORCHINDUCTOR_AUTOGRAD_CACHE")


def test_listening_imports_no_torch() -> None:
    """torch takes seconds to import: the modules that bind the port must not need it."""
    probe = ("import sys, common.config, encoder_server.cli, encoder_server.server; "
             "sys.exit('torch' in sys.modules)")
    subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, check=True, timeout=60)


def test_config_knows_the_layout_dtypes_without_torch() -> None:
    assert {dtype.value for dtype in config.CacheDtype} == set(layout.DTYPES)


def test_bucket_list_setting() -> None:
    assert build(EncoderServerConfig, None, {"EPD_ENCODER_BUCKETS": "16, 0x40"}).encoder_buckets == (16, 64)
    assert build(EncoderServerConfig, None, {"EPD_ENCODER_BUCKETS": ""}).encoder_buckets is None
    for bad in ("16,x", "0,64"):
        with pytest.raises(ConfigError, match="EPD_ENCODER_BUCKETS|encoder_buckets"):
            build(EncoderServerConfig, None, {"EPD_ENCODER_BUCKETS": bad})


def test_compile_cache_dir_is_created_and_handed_to_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in CACHE_ENV:
        monkeypatch.delenv(name, raising=False)  # restored after the test
    path = use_compile_cache(str(tmp_path / "a" / "b"))
    assert path.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(path)
    assert os.environ["TRITON_CACHE_DIR"] == str(path / "triton")
    assert os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"


def test_an_unusable_compile_cache_dir_is_a_config_error_naming_it(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=str(blocker / "cache")):
        use_compile_cache(str(blocker / "cache"))


def test_the_cli_refuses_an_unusable_compile_cache_dir_before_listening(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    proc = subprocess.run(
        [sys.executable, "-m", "common.cli", "encoder", "--port", "0", "--metrics-port", "-1",
         "--compile-cache-dir", str(blocker / "cache"), "--listening-file", str(tmp_path / "listening.json")],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert str(blocker / "cache") in proc.stderr
    assert not (tmp_path / "listening.json").exists()


def _start_refused(weights: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPD_")}
    return subprocess.run(
        [sys.executable, "-m", "common.cli", "encoder", "--port", "0", "--metrics-port", "-1", "--transport", "mock",
         "--weights", str(weights), "--encoder-backend", "eager", *args],
        cwd=REPO_ROOT, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=180)


def test_our_tower_refuses_a_checkpoint_of_another_family_naming_its_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2}}))
    proc = _start_refused(tmp_path, "--tower", "qwen3vl")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Qwen2_5_VLForConditionalGeneration (model_type 'qwen2_5_vl') is not a Qwen3-VL checkpoint" in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (the vLLM tower)")
def test_an_architecture_vllm_does_not_know_is_refused_at_start_naming_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["SeeingLlamaForConditionalGeneration"],
        "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_hidden_layers": 1,
        "num_key_value_heads": 2, "vocab_size": 300}))
    proc = _start_refused(tmp_path)  # --tower auto: not Qwen3-VL, so the vLLM tower
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "architecture SeeingLlamaForConditionalGeneration" in proc.stderr, proc.stderr[-2000:]


def test_while_warming_up_health_answers_and_every_cache_rpc_is_refused() -> None:
    """In-process: listen(), then the calls a client could make before warm_up() ran."""
    cfg = EncoderServerConfig(port=0, metrics_port=-1, encoder_backend="eager")

    async def scenario() -> None:
        server = EncoderServer(cfg)
        try:
            await server.listen()
            server.gate.progress = "1/5 bucket graphs ready"
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                health = health_pb2_grpc.HealthStub(channel)
                statuses = {service: (await health.Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=5)).status
                            for service in ("", LIVENESS_SERVICE, READINESS_SERVICE, SERVICE_NAME)}
                assert statuses == {"": health_pb2.HealthCheckResponse.NOT_SERVING,
                                    LIVENESS_SERVICE: health_pb2.HealthCheckResponse.SERVING,
                                    READINESS_SERVICE: health_pb2.HealthCheckResponse.NOT_SERVING,
                                    SERVICE_NAME: health_pb2.HealthCheckResponse.NOT_SERVING}
                stub = pb2_grpc.EncoderCacheServiceStub(channel)
                calls = [
                    stub.Handshake(pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, model_id="m"),
                                   timeout=5),
                    stub.Encode(pb2.EncodeRequest(model_id="m", items=[pb2.MediaItem(image=b"x")]), timeout=5),
                    stub.Lookup(pb2.LookupRequest(model_id="m", mm_hashes=["0" * 32]), timeout=5),
                    stub.Release(pb2.ReleaseRequest(lease_ids=[1]), timeout=5),
                ]
                for call in calls:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call
                    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert info.value.details() == (
                        "encoder is warming up (1/5 bucket graphs ready); retry later or use another encoder")
            for method in ("Handshake", "Encode", "Lookup", "Release"):
                assert server.metrics.registry.get_sample_value(
                    metrics.EPD_ENCODE_REQUESTS + "_total", {"method": method, "code": "UNAVAILABLE"}) == 1
            server.abandon_warm_up()  # a SIGTERM before anything was loaded
            with pytest.raises(WarmupAbandoned):
                await server.warm_up()
            assert server.transport is None and server.cache is None
        finally:
            await server.stop()

    asyncio.run(scenario())
