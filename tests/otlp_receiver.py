"""A tiny OTLP/HTTP trace receiver for tests: 127.0.0.1, an ephemeral port, one thread.

It decodes ``ExportTraceServiceRequest`` protobufs (``opentelemetry-proto``) posted to
``/v1/traces`` and keeps the spans. It is bounded: it shuts itself down after
``max_seconds`` even if a test forgets to, and keeps at most ``max_spans`` spans.

    with OTLPReceiver() as receiver:
        exporter = OTLPSpanExporter(endpoint=receiver.traces_endpoint)
        ...
        spans = receiver.wait_for_spans(1)
"""

from __future__ import annotations

import gzip
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

_MAX_BODY = 16 * 1024 * 1024


def attribute_value(value: AnyValue) -> Any:
    """A protobuf ``AnyValue`` as a Python value."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [attribute_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: attribute_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def attributes_of(item: Any) -> dict[str, Any]:
    """The attributes of a protobuf span, span event or resource as a dict."""
    return {kv.key: attribute_value(kv.value) for kv in item.attributes}


class OTLPReceiver:
    """Receives OTLP/HTTP protobuf trace exports on 127.0.0.1 until stopped (or timed out)."""

    def __init__(self, *, max_seconds: float = 30.0, max_spans: int = 10_000) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.spans: list[Span] = []
        self.scopes: list[str] = []
        self.errors: list[str] = []
        self._max_spans = max_spans
        self._cond = threading.Condition()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="otlp-receiver",
            daemon=True,
        )
        self._timer = threading.Timer(max_seconds, self.stop)
        self._timer.daemon = True
        self._stopped = False

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def traces_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/traces"

    def start(self) -> OTLPReceiver:
        self._thread.start()
        self._timer.start()
        return self

    def stop(self) -> None:
        with self._cond:
            if self._stopped:
                return
            self._stopped = True
            self._cond.notify_all()
        self._timer.cancel()
        if self._thread.is_alive():  # shutdown() waits for serve_forever: only if it runs
            self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OTLPReceiver:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def wait_for_spans(self, count: int, timeout: float = 10.0) -> list[Span]:
        """The spans received, once at least ``count`` have arrived (or at ``timeout``)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.spans) >= count or self._stopped, timeout)
            return list(self.spans)

    def _receive(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        with self._cond:
            self.requests.append(request)
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        if len(self.spans) < self._max_spans:
                            self.spans.append(span)
                            self.scopes.append(scope_spans.scope.name)
            self._cond.notify_all()

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if self.path != "/v1/traces":
                    self._reply(404, b"")
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if length > _MAX_BODY:
                    self._reply(413, b"")
                    return
                body = self.rfile.read(length)
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                try:
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    elif encoding == "deflate":
                        body = zlib.decompress(body)
                    receiver._receive(body)
                except Exception as exc:  # a bad request is the test's failure, not ours
                    receiver.errors.append(repr(exc))
                    self._reply(400, b"")
                    return
                self._reply(200, ExportTraceServiceResponse().SerializeToString())

            def _reply(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # keep test output clean

        return Handler
