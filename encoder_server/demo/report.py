"""The demo's report: ``/metrics`` of all three processes and the workers' request lines, combined (demo orchestrator).

Layers, as the metrics reference defines them: 1 input processor (on the
workers, and the encoder's own pixel cache), 2b prefix cache, 2a logical
encoder cache (workers), 3 device encoder cache (encoder; hits = queries -
misses). Pull throughput is bytes pulled over the summed pull latency (the
``epd_pull_latency_seconds`` histogram's sum), i.e. the rate while a pull is
in flight. TTFT percentiles split requests whose media were all served
without running the encoder ("hit") from those with an encoder miss.
Padding waste is ``active_blocks * block_size - active_real_tokens`` at the
end of the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from common import metrics as m

ENCODER_MISS = "encoder-miss"
LAYERS = ("prefix", "local", "encoder-hit", ENCODER_MISS)


@dataclass(slots=True)
class Samples:
    """Parsed exposition samples; lookups sum over every matching series (and process)."""

    rows: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    @classmethod
    def parse(cls, *texts: str) -> Samples:
        rows = [(s.name, dict(s.labels), float(s.value))
                for text in texts for fam in text_string_to_metric_families(text) for s in fam.samples]
        return cls(rows)

    def get(self, name: str, **labels: str) -> float:
        return sum(v for n, lab, v in self.rows
                   if n == name and all(lab.get(k) == want for k, want in labels.items()))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for n, lab, v in self.rows:
            if n == name and label in lab:
                out[lab[label]] = out.get(lab[label], 0.0) + v
        return out


def _total(name: str) -> str:
    return f"{name}_total"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile ``q`` in [0, 100]; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ttft_split(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """TTFT p50/p99 (ms) of requests with media: all served without the encoder running vs any miss."""
    groups: dict[str, list[float]] = {"hit": [], "miss": []}
    for r in records:
        layers = [item["layer"] for item in r.get("items", [])]
        if layers:
            groups["miss" if ENCODER_MISS in layers else "hit"].append(float(r["ttft_ms"]))
    out: dict[str, dict[str, Any]] = {}
    for name, values in groups.items():
        p50, p99 = percentile(values, 50), percentile(values, 99)
        out[name] = {"requests": len(values),
                     "p50_ms": None if p50 is None else round(p50, 2),
                     "p99_ms": None if p99 is None else round(p99, 2)}
    return out


def _hits(queries: float, hits: float) -> dict[str, Any]:
    return {"queries": int(queries), "hits": int(hits),
            "hit_rate": round(hits / queries, 4) if queries else None}


def build_report(
    *,
    transport: str,
    transport_detail: str,
    encoder_metrics: Samples,
    worker_metrics: Samples,
    records: Sequence[Sequence[Mapping[str, Any]]],
    verification: Mapping[str, Any],
    block_size: int,
    cache_blocks: int,
    workload: Mapping[str, Any],
    elapsed_s: float,
) -> dict[str, Any]:
    """One JSON-ready object; ``records`` are each worker's per-request lines."""
    enc, wrk = encoder_metrics, worker_metrics
    all_records = [r for stream in records for r in stream]
    items = {layer: 0 for layer in LAYERS}
    for r in all_records:
        for item in r.get("items", []):
            items[item["layer"]] = items.get(item["layer"], 0) + 1
    device_queries = enc.get(_total(m.DEVICE_EC_QUERIES))
    device_misses = enc.get(_total(m.DEVICE_EC_MISSES))
    pull_bytes = wrk.get(_total(m.EPD_PULL_BYTES))
    pull_seconds = wrk.get(f"{m.EPD_PULL_LATENCY}_sum")
    active_blocks = int(enc.get(m.DEVICE_EC_ACTIVE_BLOCKS))
    real_tokens = int(enc.get(m.DEVICE_EC_ACTIVE_REAL_TOKENS))
    waste = active_blocks * block_size - real_tokens
    failures = {k: int(v) for k, v in wrk.by_label(_total(m.EPD_LOAD_FAILURES), "reason").items() if v}
    return {
        "transport": transport,
        "transport_detail": transport_detail,
        "requests": len(all_records),
        "requests_per_worker": [len(stream) for stream in records],
        "workload": dict(workload),
        "items": {"total": sum(items.values()), **items},
        "layers": {
            "input_processor": {
                "workers": _hits(wrk.get(_total(m.MM_CACHE_QUERIES)), wrk.get(_total(m.MM_CACHE_HITS))),
                "encoder": _hits(enc.get(_total(m.MM_CACHE_QUERIES)), enc.get(_total(m.MM_CACHE_HITS))),
            },
            "prefix": _hits(wrk.get(_total(m.PREFIX_CACHE_QUERIES)), wrk.get(_total(m.PREFIX_CACHE_HITS))),
            "logical_encoder_cache": _hits(
                wrk.get(_total(m.SCHEDULER_EC_QUERIES)), wrk.get(_total(m.SCHEDULER_EC_HITS))),
            "device_cache": {**_hits(device_queries, device_queries - device_misses),
                             "misses": int(device_misses)},
        },
        "evictions": int(enc.get(_total(m.DEVICE_EC_EVICTIONS))),
        "pulls": {
            "items": int(wrk.get(_total(m.EPD_PULLS))),
            "bytes": int(pull_bytes),
            "seconds": round(pull_seconds, 6),
            "gb_per_s": round(pull_bytes / pull_seconds / 1e9, 4) if pull_seconds > 0 else None,
        },
        "ttft": ttft_split(all_records),
        "padding": {
            "block_size": block_size, "cache_blocks": cache_blocks, "active_blocks": active_blocks,
            "active_real_tokens": real_tokens, "waste_tokens": waste,
            "waste_pct": round(100 * waste / (active_blocks * block_size), 2) if active_blocks else 0.0,
        },
        "load_failures": failures,
        "handshakes": {k: int(v) for k, v in wrk.by_label(_total(m.EPD_HANDSHAKES), "result").items()},
        **verification,
        "elapsed_s": round(elapsed_s, 2),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _rate(h: Mapping[str, Any]) -> str:
    rate = h.get("hit_rate")
    return f"queries {h['queries']:>5}  hits {h['hits']:>5}" + ("" if rate is None else f"  ({100 * rate:.0f}%)")


def format_report(r: Mapping[str, Any]) -> str:
    """The human-readable report (same content as the JSON)."""
    layers, items, pulls, pad = r["layers"], r["items"], r["pulls"], r["padding"]
    per_worker = ", ".join(f"worker {i}: {n}" for i, n in enumerate(r["requests_per_worker"]))
    gbps = "-" if pulls["gb_per_s"] is None else f"{pulls['gb_per_s']:.3f} GB/s"
    ttft = r["ttft"]
    failures = ", ".join(f"{k} {v}" for k, v in sorted(r["load_failures"].items())) or "none"
    device = layers["device_cache"]
    lines = [
        "",
        "epd demo report",
        f"  transport              {r['transport']} ({r['transport_detail']})",
        f"  requests               {r['requests']} ({per_worker})",
        f"  media items            {items['total']}: " + ", ".join(f"{k} {items[k]}" for k in LAYERS),
        f"  L1 input processor     workers {_rate(layers['input_processor']['workers'])}",
        f"                         encoder {_rate(layers['input_processor']['encoder'])}",
        f"  L2b prefix cache       blocks  {_rate(layers['prefix'])}",
        f"  L2a logical enc cache  items   {_rate(layers['logical_encoder_cache'])}",
        f"  L3 device enc cache    items   {_rate(device)}  misses {device['misses']}",
        f"  evictions              {r['evictions']} blocks",
        f"  pulls                  {pulls['items']} items, {pulls['bytes'] / 1e6:.2f} MB in "
        f"{pulls['seconds'] * 1e3:.1f} ms of pulls: {gbps}",
        f"  TTFT, all hits         p50 {_ms(ttft['hit']['p50_ms'])}  p99 {_ms(ttft['hit']['p99_ms'])}"
        f"  ({ttft['hit']['requests']} requests)",
        f"  TTFT, encoder miss     p50 {_ms(ttft['miss']['p50_ms'])}  p99 {_ms(ttft['miss']['p99_ms'])}"
        f"  ({ttft['miss']['requests']} requests)",
        f"  padding waste          {pad['waste_tokens']} of {pad['active_blocks'] * pad['block_size']} rows "
        f"({pad['waste_pct']:.1f}%) in {pad['active_blocks']} active blocks of {pad['block_size']}",
        f"  load failures          {failures}",
        f"  verification           {r['verified_items']} merged items matched a local reference encode, "
        f"{r['verified_prefix_items']} prefix-cache items checked by their first merge",
        f"  mismatches             {r['mismatches']}",
    ]
    lines += [f"    {d}" for d in r.get("mismatch_details", [])]
    lines.append(f"  elapsed                {r['elapsed_s']:.1f} s")
    return "\n".join(lines)
