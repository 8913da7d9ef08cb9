"""Print the README's configuration tables: ``python -m common.config`` (a developer's command)."""

from __future__ import annotations

from common.config import EncoderServerConfig, PrefillConfig, ProxyConfig, markdown_reference

for config_cls in (EncoderServerConfig, PrefillConfig, ProxyConfig):
    print(f"### {config_cls.__name__}\n\n{markdown_reference(config_cls)}\n")
