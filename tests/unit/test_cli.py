from __future__ import annotations

import subprocess

from common.cli import SUBCOMMANDS


def test_help_lists_every_subcommand(venv_bin) -> None:
    out = subprocess.run([str(venv_bin / "epd"), "--help"], capture_output=True, text=True, check=True)
    for name in ("encoder", "prefill", "demo", "bench"):
        assert name in SUBCOMMANDS
        assert name in out.stdout


def test_unknown_command_fails(venv_bin) -> None:
    result = subprocess.run([str(venv_bin / "epd"), "frobnicate"], capture_output=True, text=True)
    assert result.returncode != 0
    assert "frobnicate" in result.stderr


def test_bench_lists_and_refuses_unknown_scripts(venv_bin) -> None:
    listing = subprocess.run([str(venv_bin / "epd"), "bench", "--help"], capture_output=True, text=True)
    assert listing.returncode == 0 and "merge" in listing.stdout
    unknown = subprocess.run([str(venv_bin / "epd"), "bench", "no-such-bench"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "no-such-bench" in unknown.stderr


def test_every_subcommand_help_renders(venv_bin) -> None:
    """argparse %-formats help texts: a setting's help with a literal "%" must still render."""
    for name in ("encoder", "prefill"):
        out = subprocess.run([str(venv_bin / "epd"), name, "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "--model-id" in out.stdout
