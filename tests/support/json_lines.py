"""The JSON result a child process prints last, found among what else reaches its stdout."""

from __future__ import annotations

import json
from typing import Any


def last_json_object(stdout: str | bytes) -> Any:
    """The last stdout line that is a JSON object. UCX writes its own log lines to stdout (a
    warning about a request still pooled when an agent is torn down can come after the result)."""
    text = stdout.decode() if isinstance(stdout, bytes) else stdout
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"no JSON object on stdout:\n{text[-2000:]}")
