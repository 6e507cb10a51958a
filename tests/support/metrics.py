"""Read a counter or gauge off a running server's Prometheus ``/metrics`` (tests and benchmarks)."""

from __future__ import annotations

import time
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


def wait_until_idle(root_url: str, timeout: float = 30.0) -> float:
    """Seconds until the engine has no request running or waiting (or ``timeout``): what a client
    that went away (a disconnected stream, a load test's) left behind has been cleared."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if scrape_metric(root_url, "vllm:num_requests_running") == 0 and \
                scrape_metric(root_url, "vllm:num_requests_waiting") == 0:
            return time.monotonic() - start
        time.sleep(0.25)
    return timeout
