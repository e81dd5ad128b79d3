"""examples/serving.py as a real service: uvicorn on 127.0.0.1, driven over HTTP by httpx.

One server (a subprocess on a free port, the cheap ``aot_eager`` backend) serves the whole
module; every test leaves it reset (``POST /reset``). Scores are compared with the same
seeded model run eagerly in this process.
"""

from __future__ import annotations

import importlib.util
import inspect
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest
import torch

from tests.redis_server import terminate

ROOT = Path(__file__).resolve().parents[1]
SERVING = ROOT / "examples" / "serving.py"
START_TIMEOUT_S = 90.0  # torch's import and FastAPI's start-up, on a loaded machine
WARM_TIMEOUT_S = 180.0  # the background warmup compiles 5 buckets, at nice 19
LENGTHS = (1, 3, 8, 9, 17, 31, 64, 100, 128, 129)  # every bucket, and one too long for any


@pytest.fixture(scope="module")
def serving() -> Iterator[ModuleType]:
    """The example as a module (for its model and encoding), imported as the script is."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(SERVING.parent))  # it imports its sibling _common
        spec = importlib.util.spec_from_file_location("serving_example", SERVING)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module


@pytest.fixture(scope="module")
def eager(serving: ModuleType) -> Callable[[list[int]], torch.Tensor]:
    """The served model's scores for one request, computed here without safecompile."""
    model = serving.build_model()

    def scores(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            out: torch.Tensor = model(*serving.encode(tokens))[0]
        return out

    return scores


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def server(
    example_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[httpx.Client]:
    """The example's server, up and answering; stopped (killed if need be) afterwards."""
    port = _free_port()
    log = tmp_path_factory.mktemp("serving") / "server.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, str(SERVING), "--port", str(port)],
            cwd=ROOT,
            env=example_env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60.0) as client:
            deadline = time.monotonic() + START_TIMEOUT_S
            while True:
                assert process.poll() is None, f"the server exited:\n{log.read_text()}"
                assert time.monotonic() < deadline, f"no answer:\n{log.read_text()}"
                try:
                    client.get("/status")
                    break
                except httpx.TransportError:
                    time.sleep(0.2)  # a real process starting: nothing to fake
            yield client
    finally:
        terminate(process, timeout=15)


@pytest.fixture
def fresh(server: httpx.Client) -> Iterator[httpx.Client]:
    """The server, left reset after the test: no fault, kill switch off, graphs forgotten."""
    yield server
    assert server.post("/reset").json() == {"reset": True}


def ready(client: httpx.Client) -> dict[str, Any]:
    """``GET /ready``'s body; its status code is 200 exactly when it says ready."""
    response = client.get("/ready")
    body: dict[str, Any] = response.json()
    assert response.status_code == (200 if body["ready"] else 503), body
    return body


def wait_warm(client: httpx.Client) -> None:
    """Until the start-up warmup has finished (it runs at the lowest CPU priority)."""
    deadline = time.monotonic() + WARM_TIMEOUT_S
    while not ready(client)["warmup_done"]:
        # not warm while the warmup runs (it may end between the two requests: then warm
        # comes with the warmup done)
        assert not status(client)["warm"] or ready(client)["warmup_done"]
        assert time.monotonic() < deadline, status(client)
        time.sleep(0.2)  # the server's own background warmup: nothing to fake


@pytest.fixture
def client(fresh: httpx.Client) -> httpx.Client:
    """The server once warm (a reset warms up again, in the background), left reset after
    the test."""
    wait_warm(fresh)
    return fresh


def tokens_of(length: int) -> list[int]:
    """A request of ``length`` token ids, different for each length."""
    return [(7 * i + length) % 1000 for i in range(length)]


def assert_eager_scores(
    client: httpx.Client, eager: Callable[[list[int]], torch.Tensor], tokens: list[int]
) -> str:
    """Score one request; its scores are eager's (fp32 tolerance). Returns the state."""
    response = client.post("/score", json={"tokens": tokens})
    assert response.status_code == 200, response.text
    answer = response.json()
    torch.testing.assert_close(torch.tensor(answer["scores"]), eager(tokens))
    state: str = answer["state"]
    return state


def status(client: httpx.Client) -> dict[str, Any]:
    report: dict[str, Any] = client.get("/status").json()
    return report


def rollbacks_since_reset(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The rollback events after the last reset (events outlive a reset)."""
    kinds = [e["kind"] for e in report["events"]]
    start = len(kinds) - kinds[::-1].index("reset") if "reset" in kinds else 0
    return [e for e in report["events"][start:] if e["kind"] == "rollback"]


def compile_one(client: httpx.Client, eager: Callable[[list[int]], torch.Tensor]) -> None:
    """After a reset (which warms up again in the background): requests until one is
    served compiled (the speed verdict, started afresh, may time one on eager first)."""
    wait_warm(client)
    for _ in range(10):
        assert assert_eager_scores(client, eager, tokens_of(5)) == "canary"
        if status(client)["stats"]["compiled_calls"] == 1:
            return
    raise AssertionError(f"no request served compiled: {status(client)['stats']}")


def test_scores_match_eager_while_warming_and_compiled(
    fresh: httpx.Client, eager: Callable[[list[int]], torch.Tensor]
) -> None:
    """Every length gets eager's scores, while the buckets compile and once they have; the
    warmup compiles one graph per bucket, and a request longer than any bucket runs eager."""
    client = fresh
    for length in LENGTHS:
        assert_eager_scores(client, eager, tokens_of(length))

    wait_warm(client)
    assert len(status(client)["graphs"]) == 5  # one a bucket: 8, 16, 32, 64, 128
    before = status(client)["stats"]
    states = {assert_eager_scores(client, eager, tokens_of(n)) for n in LENGTHS * 3}

    report = status(client)
    assert states <= {"canary", "compiled"}
    assert report["state"] == "compiled", report["graphs"]  # 3 calls a bucket: canary of 2
    assert report["warm"]
    assert ready(client)["ready"]
    assert len(report["graphs"]) == 5  # and no more
    assert report["stats"]["compiled_calls"] - before["compiled_calls"] == 3 * 9
    assert report["stats"]["eager_calls"] - before["eager_calls"] == 3  # the 129 tokens
    assert report["stats"]["shadow_breaches"] == 0


def test_bad_request_is_refused(client: httpx.Client) -> None:
    """Token ids outside the vocabulary, or none: 422, and nothing is called."""
    calls = status(client)["stats"]["calls"]

    assert client.post("/score", json={"tokens": [5, 1000]}).status_code == 422
    assert client.post("/score", json={"tokens": []}).status_code == 422
    assert status(client)["stats"]["calls"] == calls


def test_error_fault_rolls_back_live(
    client: httpx.Client,
    eager: Callable[[list[int]], torch.Tensor],
    serving: ModuleType,
) -> None:
    """Compiled code that starts failing: that very request gets eager's scores, the model
    rolls back (runtime_error, at the failing line) and eager serves from then on."""
    compile_one(client, eager)

    assert client.post("/fault", json={"kind": "error"}).json()["fault"] == "error"
    assert assert_eager_scores(client, eager, tokens_of(5)) == "rolled_back"
    assert assert_eager_scores(client, eager, tokens_of(40)) == "rolled_back"

    report = status(client)
    [rollback] = rollbacks_since_reset(report)
    assert rollback["reason"] == "runtime_error"
    assert rollback["error_type"] == "RuntimeError"
    assert rollback["file"] == str(SERVING)
    source, first = inspect.getsourcelines(serving.FaultSwitch.__call__)
    raise_line = first + next(i for i, line in enumerate(source) if "raise RuntimeError" in line)
    assert rollback["line"] == raise_line
    assert report["stats"]["rollbacks"] == 1
    assert report["stats"]["compiled_calls"] == 1  # only the call before the fault


def test_fault_lands_on_the_compiled_path_that_serves(
    client: httpx.Client, eager: Callable[[list[int]], torch.Tensor]
) -> None:
    """Once warm, compiled graphs answer every bucketed request and /ready says 200; a
    fault then is caught on that path: eager's scores, a runtime_error rollback, /ready
    503 and ``warm`` false (the test backend runs with the speed verdict off, so nothing
    else moves it off the compiled path)."""
    compile_one(client, eager)  # after the last test's reset: compile one bucket again
    before = status(client)["stats"]
    for _ in range(3):
        assert assert_eager_scores(client, eager, tokens_of(5)) in {"canary", "compiled"}
    report = status(client)
    assert report["stats"]["compiled_calls"] - before["compiled_calls"] == 3
    assert report["stats"]["eager_calls"] == before["eager_calls"]
    # compiled graphs serve: the warmup's other buckets may still be in their canary
    assert report["state"] in {"canary", "compiled"}
    assert report["warm"]
    assert ready(client)["ready"]

    client.post("/fault", json={"kind": "error"})
    assert assert_eager_scores(client, eager, tokens_of(5)) == "rolled_back"

    report = status(client)
    [rollback] = rollbacks_since_reset(report)
    assert rollback["reason"] == "runtime_error"
    assert report["stats"]["compiled_calls"] - before["compiled_calls"] == 3
    assert not report["warm"]
    body = ready(client)
    assert body == {"ready": False, "state": "rolled_back", "warmup_done": True}


def test_drift_fault_is_caught_by_the_canary(
    client: httpx.Client, eager: Callable[[list[int]], torch.Tensor]
) -> None:
    """Compiled code that drifts by 1% on a graph in its canary: the drifted scores never
    go out; the model rolls back for drift."""
    client.post("/fault", json={"kind": "drift"})

    assert assert_eager_scores(client, eager, tokens_of(12)) == "rolled_back"
    assert assert_eager_scores(client, eager, tokens_of(12)) == "rolled_back"

    report = status(client)
    assert [e["reason"] for e in rollbacks_since_reset(report)] == ["drift"]
    assert report["stats"]["shadow_breaches"] == 1
    assert report["stats"]["max_rel_diff"] == pytest.approx(0.01, rel=1e-3)


def test_kill_switch(client: httpx.Client, eager: Callable[[list[int]], torch.Tensor]) -> None:
    """The kill switch turns the compiled path off and on, without a restart."""
    compile_one(client, eager)

    assert client.post("/killswitch", json={"on": True}).json()["state"] == "disabled"
    compiled = status(client)["stats"]["compiled_calls"]
    assert assert_eager_scores(client, eager, tokens_of(5)) == "disabled"
    assert status(client)["stats"]["compiled_calls"] == compiled
    assert ready(client)["ready"]  # an operator's choice, fleet-wide: the replica stays in
    assert not status(client)["warm"]  # but no compiled graph answers

    assert client.post("/killswitch", json={"on": False}).json()["state"] != "disabled"
    assert assert_eager_scores(client, eager, tokens_of(5)) in {"canary", "compiled"}
    assert status(client)["stats"]["compiled_calls"] > compiled


def test_metrics_scrape(
    client: httpx.Client,
    eager: Callable[[list[int]], torch.Tensor],
    prometheus_value: Callable[..., float],
) -> None:
    """/metrics is the Prometheus text of safecompile's OpenTelemetry metrics: calls per
    path, compile durations, shadow checks, and rollbacks by reason."""

    def metric(name: str, **labels: str) -> float:
        response = client.get("/metrics")
        assert response.headers["content-type"].startswith("text/plain")
        return prometheus_value(response.text, name, function="serving.tagger", **labels)

    calls = metric("safecompile_calls_total", path="compiled")
    rollbacks = metric("safecompile_rollbacks_total", reason="runtime_error")
    compiles = metric("safecompile_compile_duration_seconds_count")
    compile_one(client, eager)
    eager_calls = metric("safecompile_calls_total", path="eager")
    client.post("/fault", json={"kind": "error"})
    assert_eager_scores(client, eager, tokens_of(5))

    assert metric("safecompile_calls_total", path="compiled") == calls + 1
    assert metric("safecompile_calls_total", path="eager") == eager_calls + 1
    assert metric("safecompile_rollbacks_total", reason="runtime_error") == rollbacks + 1
    assert metric("safecompile_compile_duration_seconds_count") == compiles  # warm: none
    assert metric("safecompile_shadow_checks_total", result="pass") > 0


def test_index_lists_the_endpoints(server: httpx.Client, serving: ModuleType) -> None:
    """``GET /`` lists every endpoint with what it does, and points at ``/docs``; the
    default port is clear of ``mkdocs serve``'s 8000."""
    response = server.get("/")

    assert response.status_code == 200
    body = response.json()
    assert set(body["endpoints"]) == {
        "GET /",
        "POST /score",
        "GET /status",
        "GET /ready",
        "POST /fault",
        "POST /killswitch",
        "POST /reset",
        "GET /metrics",
    }
    assert all(body["endpoints"].values())  # each with its docstring's first line
    assert body["docs"].startswith("/docs")
    assert server.get("/docs").status_code == 200
    assert serving.PORT == 8081


def test_status_reads_as_indented_json_with_a_legend(
    client: httpx.Client, eager: Callable[[list[int]], torch.Tensor]
) -> None:
    """``GET /status`` is indented JSON, and its legend explains each section, the bucket
    keys included."""
    compile_one(client, eager)
    response = client.get("/status")

    assert response.headers["content-type"] == "application/json"
    assert response.text.startswith('{\n  "legend": {\n')
    body = response.json()
    assert set(body["legend"]) <= set(body)
    assert "padded to the 16-token bucket" in body["legend"]["buckets"]
    assert any(key.startswith("8 (length ") for key in body["buckets"]), body["buckets"]
