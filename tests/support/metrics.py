"""Read a counter or gauge off a running server's Prometheus ``/metrics`` (tests and benchmarks)."""

from __future__ import annotations

import urllib.request


def scrape_metric(root_url: str, name: str, **labels: str) -> float:
    """Sum of every sample of metric ``name`` whose labels include ``labels`` (0.0 when absent)."""
    with urllib.request.urlopen(root_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, value = line.rsplit(" ", 1)
        if head.split("{")[0] != name:
            continue
        if all(f'{key}="{val}"' in head for key, val in labels.items()):
            total += float(value)
    return total
