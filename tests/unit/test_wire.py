"""The committed generated code matches the schema, and the schema lints."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from common import wire
from common.wire import codegen


def test_generated_code_has_not_drifted(tmp_path) -> None:
    codegen.generate(tmp_path)
    for name in codegen.generated_names():
        fresh = (tmp_path / name).read_text()
        committed = (codegen.OUT_DIR / name).read_text()
        assert fresh == committed, (
            f"common/wire/{name} is stale: run `python -m common.wire.codegen` and commit")


def test_generated_modules_import_as_a_package() -> None:
    text = (codegen.OUT_DIR / "encoder_cache_pb2_grpc.py").read_text()
    assert "from common.wire import encoder_cache_pb2" in text
    assert "from epd.v1" not in text
    assert wire.pb2_grpc.EncoderCacheServiceStub is not None


def test_service_shape() -> None:
    service = wire.pb2.DESCRIPTOR.services_by_name["EncoderCacheService"]
    assert service.full_name == wire.SERVICE_NAME
    assert sorted(m.name for m in service.methods) == ["Encode", "Handshake", "Lookup", "Release"]


def test_buf_lint_standard(repo_root, venv_bin) -> None:
    buf = shutil.which("buf", path=str(venv_bin)) or shutil.which("buf")
    if buf is None:
        pytest.skip("buf is not installed (it comes with the test extra, buf-bin)")
    result = subprocess.run([buf, "lint"], cwd=repo_root, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
