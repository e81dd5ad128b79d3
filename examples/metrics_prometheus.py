"""safecompile's metrics on a Prometheus endpoint, scraped once by the example itself.

Needs the ``prometheus`` extra (the OpenTelemetry SDK, its Prometheus exporter and
prometheus-client)::

    pip install -e '.[prometheus]'
    python examples/metrics_prometheus.py                 # $SAFECOMPILE_METRICS_PORT or 9464
    python examples/metrics_prometheus.py --port 0        # any free port
    python examples/metrics_prometheus.py --serve 60      # then keep serving 60 s for Prometheus
    python examples/metrics_prometheus.py --buckets       # histogram buckets printed too
    python examples/metrics_prometheus.py --backend inductor  # the real compiler

The backend is ``aot_eager`` unless ``--backend`` (or ``$SAFECOMPILE_EXAMPLE_BACKEND``)
names another. ``_common.py`` and ``_metrics.py`` beside this file hold what the examples
share (the ``--backend`` option, a summary line, the Prometheus meter provider).

An OpenTelemetry ``MeterProvider`` with a ``PrometheusMetricReader`` (from
``opentelemetry-exporter-prometheus``) is handed to the guarded callables; prometheus_client
serves it on 127.0.0.1. Three callables run some calls:

- ``example.score`` compiles and serves, shadow-checked for its first 8 calls;
- ``example.broken`` fails to compile (an injected backend failure): eager serves it;
- ``example.drifting`` drifts by 1% (an injected fault): its canary check rolls it back.

Then the example scrapes its own endpoint over HTTP and prints the ``safecompile_*``
lines (histogram buckets left out unless ``--buckets``), for instance::

    safecompile_calls_total{...,safecompile_function="example.score",...="compiled"} 40.0
    safecompile_rollbacks_total{...,safecompile_function="example.broken",...} 1.0

A Prometheus server scrapes the same endpoint with ``--serve SECONDS``, ``scrape_configs:
[{job_name: safecompile, static_configs: [{targets: ["127.0.0.1:9464"]}]}]``. It exits by
itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.request

import torch
from _common import add_backend_option, needs_extra, summary

with needs_extra("prometheus"):
    from _metrics import prometheus_meter_provider, safecompile_lines
    from prometheus_client import start_http_server

from safecompile import Shadow, safe_compile
from safecompile.testing import DriftingBackend, FailingBackend

MAX_LINES = 80  # printed from the scrape, at most


def score(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ x.T).sum(dim=-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("SAFECOMPILE_METRICS_PORT", "9464")),
        help="port on 127.0.0.1 (0: any free port; default $SAFECOMPILE_METRICS_PORT or 9464)",
    )
    parser.add_argument("--calls", type=int, default=40, help="calls per callable")
    parser.add_argument("--serve", type=float, default=0.0, help="seconds to keep serving")
    parser.add_argument("--buckets", action="store_true", help="print histogram buckets too")
    add_backend_option(parser, "aot_eager")
    args = parser.parse_args(argv)

    meter_provider = prometheus_meter_provider()
    server, thread = start_http_server(args.port, addr="127.0.0.1")
    port = server.server_port
    url = f"http://127.0.0.1:{port}/metrics"
    print(f"# serving {url}", file=sys.stderr)

    try:
        common = {"meter_provider": meter_provider, "backend": args.backend}
        guarded = [
            safe_compile(score, name="example.score", shadow=Shadow(canary=8, every=0), **common),
            safe_compile(
                score, name="example.broken", shadow=None, **{**common, "backend": FailingBackend()}
            ),
            safe_compile(
                score,
                name="example.drifting",
                shadow=Shadow(canary=8, every=0),
                **{**common, "backend": DriftingBackend(scale=1.01)},
            ),
        ]
        with torch.no_grad():
            x = torch.randn(16, 32)
            for _ in range(args.calls):
                for g in guarded:
                    g(x)

        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read().decode("utf-8")
        lines = safecompile_lines(body, buckets=True)
        shown = safecompile_lines(body, buckets=args.buckets)
        for line in shown[:MAX_LINES]:
            print(line)
        hidden = len(lines) - min(len(shown), MAX_LINES)
        if hidden:
            print(
                f"# {hidden} more safecompile_ lines (histogram buckets: --buckets)",
                file=sys.stderr,
            )
        for g in guarded:
            print(f"# {summary(g)}", file=sys.stderr)
        if args.serve > 0:
            print(f"# serving for {args.serve:g} s more", file=sys.stderr)
            time.sleep(args.serve)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
        meter_provider.shutdown()
    return 0 if lines else 1


if __name__ == "__main__":
    sys.exit(main())
