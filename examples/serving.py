"""A small HTTP service: variable-length requests through a bucketed, shadowed model.

Needs the ``examples`` extra (FastAPI, uvicorn, the OpenTelemetry SDK and its Prometheus
exporter)::

    pip install -e '.[examples]'
    python examples/serving.py                      # http://127.0.0.1:8081, inductor
    python examples/serving.py --backend aot_eager  # quick compiles, no C++ compiler

The backend is ``inductor`` (what you would serve with; the warmup's cold compiles take
a minute or two on a CPU while eager answers) unless ``--backend`` (or
``$SAFECOMPILE_EXAMPLE_BACKEND``) names another. The port is 8081 (``--port``), clear of
``mkdocs serve``'s 8000. ``_common.py`` and ``_metrics.py`` beside this file hold what the
examples share. Then, from another terminal::

    curl -s localhost:8081/                                      # the endpoints
    curl -s localhost:8081/score --json '{"tokens": [5, 17, 42]}'  # one score per token
    curl -s localhost:8081/status                                # warm yet? the report
    curl -si localhost:8081/ready                                # 200 once compiled serves
    curl -s localhost:8081/fault --json '{"kind": "error"}'      # compiled code now fails
    curl -s localhost:8081/score --json '{"tokens": [5, 17, 42]}'  # same scores, by eager
    curl -s localhost:8081/status | grep '"state"'               # "rolled_back"
    curl -s localhost:8081/killswitch --json '{"on": true}'      # state "disabled"
    curl -s localhost:8081/metrics | grep '^safecompile_'        # the Prometheus scrape
    curl -s -X POST localhost:8081/reset                         # no fault, compile again

(``--json`` needs curl 7.82 or later; else ``-H 'content-type: application/json' -d``.)
FastAPI's interactive page for every endpoint is ``/docs`` (it loads Swagger UI from
a CDN, so it needs a network).

The model tags each token of a request with a score. Requests of any length up to 128
tokens are padded to the next power of two (``Buckets``), so at most 5 graphs are ever
compiled, one per bucket, all of them in the background at start-up (``Warmup``) while
eager answers; longer requests run eager. Each graph's first calls, then one call in 32,
are compared with eager before the answer goes out (``Shadow(mode="sync")``). The model
is sized so that compiling pays on a CPU (``bench/serving_model.py`` measures eager,
``torch.compile`` and this guarded call side by side); where it does not, the speed
verdict serves eager (``slower``) and measures again after ``RETRY_AFTER_S`` seconds,
doubling the wait while compiled stays slower. The ``eager`` and ``aot_eager`` backends
exist to test the plumbing and never beat eager, so with them the speed verdict is off.

``GET /ready`` is for a load balancer: 200 once the warmup has finished and compiled
graphs serve (also with the kill switch on: eager serving by an operator's choice),
503 while warming up or after a rollback (eager still answers correctly, only slower).
A rollback on every replica makes every one unready: use a load balancer that fails open
when no target is ready. ``/status``'s ``warm`` says the same.

``POST /fault`` makes the compiled code fail (``{"kind": "error"}``) or drift by 1%
(``{"kind": "drift"}``), to watch a live rollback of a path that serves: an error is
answered by eager at once; drift is caught at the next checked call (on a graph still in
its canary, the next call), and a checked call never returns the drifted value. Either
way the model rolls back to eager (state ``rolled_back``), the event names the reason and
the model's source line, and ``/ready`` turns 503; the compiled path is tried again after
``RETRY_AFTER_S`` (``POST /fault --json '{"kind": null}'`` ends the fault).
The kill switch is ``POST /killswitch`` here (``safecompile.disable()``), or
``SAFECOMPILE_DISABLE=serving.*`` in the environment at start (which ``/killswitch`` cannot
turn off); ``GET /metrics`` is the Prometheus scrape.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable
from typing import Annotated, Any, Literal

import torch
from _common import add_backend_option, log_events, needs_extra
from torch import nn
from torch.utils import _pytree as pytree

with needs_extra("examples"):
    import uvicorn
    from _metrics import exposition, prometheus_meter_provider
    from fastapi import FastAPI, Response
    from fastapi.routing import APIRoute
    from pydantic import BaseModel, Field

import safecompile
from safecompile import Buckets, Rollback, Shadow, Warmup, pow2, safe_compile

NAME = "serving.tagger"
VOCAB = 1000
MAX_TOKENS = 128  # the largest bucket; longer requests run eager
PORT = 8081  # mkdocs serve takes 8000

# What /status's sections mean: the controller's report, read by a person.
LEGEND = {
    "warm": (
        "whether compiled graphs answer requests: the start-up warmup has finished and no "
        "rollback is in force (/ready says the same to a load balancer)"
    ),
    "state": "pending | warming | canary | compiled | unchecked | rolled_back | disabled",
    "stats": "call counters since start (or /reset): compiled_calls + eager_calls == calls",
    "graphs": "one per graph torch compiled: its input shapes, calls, checks, canary left",
    "buckets": (
        "one per bucket size and request length seen: '16 (length 12) [mask=1x16:bool, "
        "tokens=1x16:int64]' is a 12-token request padded to the 16-token bucket, and the "
        "padded shapes its graph runs on; status ready = served compiled"
    ),
    "events": "what happened, newest last: compiles, checks that failed, rollbacks",
}


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, written out: five elementwise operators in eager, one
    fused loop compiled."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    """A pre-norm residual SwiGLU block (as in Llama): its norm, gate and residual are
    elementwise work that a compiler fuses and eager runs operator by operator."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.gate = nn.Linear(dim, 2 * dim, bias=False)
        self.up = nn.Linear(dim, 2 * dim, bias=False)
        self.down = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        return h + self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class Tagger(nn.Module):
    """Scores every token of a sequence in the context of the whole (unpadded) sequence.

    Sized so that compiling pays on a CPU: the fused elementwise work of four blocks
    outweighs the guarded call's own cost (``bench/serving_model.py`` measures it); a
    model of a few operators is served eager by the speed verdict, rightly."""

    def __init__(self, vocab: int = VOCAB, dim: int = 64, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(2 * dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.norm = RMSNorm(dim)
        self.out = nn.Linear(dim, 1)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # (batch, seq, dim)
        keep = mask.unsqueeze(-1).to(h.dtype)  # padding positions are 0
        context = (h * keep).sum(1, keepdim=True) / keep.sum(1, keepdim=True)
        h = torch.relu(self.mix(torch.cat([h, context.expand_as(h)], dim=-1)))
        for block in self.blocks:
            h = block(h)
        scores: torch.Tensor = self.out(self.norm(h)).squeeze(-1)  # (batch, seq)
        return scores


def build_model(seed: int = 0) -> Tagger:
    """The served model, with weights fixed by ``seed``."""
    torch.manual_seed(seed)
    return Tagger().eval()


def encode(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's tokens as the model's ``(tokens, mask)`` batch of one."""
    ids = torch.tensor([tokens], dtype=torch.long)
    return ids, torch.ones_like(ids, dtype=torch.bool)


class FaultSwitch:
    """A ``torch.compile`` backend: a real one whose compiled code fails or drifts on request.

    ``fault`` is read on every run of every compiled graph, so setting it takes effect at
    once, without a recompile: ``"error"`` raises, ``"drift"`` scales outputs by 1.01.
    """

    def __init__(self, backend: str) -> None:
        # lookup_backend turns a name into the compiler torch.compile(backend=name) uses.
        self.inner = torch._dynamo.lookup_backend(backend)
        self.fault: Literal["error", "drift"] | None = None
        self.__name__ = backend  # the label events, spans and metrics show

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        compiled = self.inner(gm, example_inputs)

        def run(*args: Any) -> Any:
            if self.fault == "error":
                raise RuntimeError("injected fault: the compiled code failed")
            out = compiled(*args)
            if self.fault == "drift":
                out = pytree.tree_map_only(torch.Tensor, self._drift, out)
            return out

        return run

    @staticmethod
    def _drift(t: torch.Tensor) -> torch.Tensor:
        return t * 1.01 if t.is_floating_point() else t


class ScoreRequest(BaseModel):
    """One sequence of token ids, of any length."""

    tokens: list[Annotated[int, Field(ge=0, lt=VOCAB)]] = Field(min_length=1)


class FaultRequest(BaseModel):
    """The fault the compiled code shows from now on (``null``: none)."""

    kind: Literal["error", "drift"] | None


class SwitchRequest(BaseModel):
    """``on``: the kill switch is on, the model runs eager."""

    on: bool


# Backends that never run faster than eager (they exist to test the plumbing): the speed
# verdict would rightly roll them back as "slower", so with them it is off.
TEST_BACKENDS = ("eager", "aot_eager")
RETRY_AFTER_S = 30.0  # after a trip, try the compiled path again (doubling while it fails)

# The states in which compiled graphs answer requests.
SERVING_COMPILED = ("canary", "compiled", "unchecked")


def guard(model: nn.Module, backend: Any, *, label: str) -> Any:
    """The example's guarded model: buckets, background warmup, shadow checks, rollback."""
    speed = None if label in TEST_BACKENDS else 1.05
    # Warmup compiles under the grad mode of this line, and torch compiles one graph per
    # grad mode: decorate under the no_grad() the requests run in, or warmup is wasted.
    with torch.no_grad():
        return safe_compile(
            model,
            name=NAME,
            backend=backend,
            dynamic=False,  # static shapes: one graph per bucket, as CUDA graphs want
            buckets=Buckets(dims={"tokens": 1, "mask": 1}, sizes=pow2(8, MAX_TOKENS)),
            warmup=Warmup(inputs=[encode(list(range(8)))], background=True),
            shadow=Shadow(canary=2, every=32, mode="sync"),
            rollback=Rollback(slower_ratio=speed, retry_after=RETRY_AFTER_S),
            meter_provider=prometheus_meter_provider(),
        )


def create_app(backend: str = "inductor") -> FastAPI:
    """The service: the guarded model and its endpoints."""
    faults = FaultSwitch(backend)
    model = guard(build_model(), faults, label=backend)
    controller = model.safecompile

    def warm() -> bool:
        """The start-up warmup has finished and compiled graphs answer requests now."""
        return controller.wait_warm(timeout=0) and controller.state.value in SERVING_COMPILED

    lock = threading.Lock()  # one request changes the switches at a time
    app = FastAPI(title="safecompile serving example")

    @app.post("/score")
    def score(request: ScoreRequest) -> dict[str, Any]:
        """One score per token; eager's answer whenever the compiled path cannot be trusted."""
        with torch.no_grad():
            scores = model(*encode(request.tokens))
        return {"scores": scores[0].tolist(), "state": controller.state.value}

    @app.get("/")
    def index() -> Response:
        """This list of endpoints."""
        return pretty(
            {
                "service": f"{NAME}: scores each token of a request (safecompile example)",
                "endpoints": endpoints(app),
                "docs": "/docs (every endpoint, to try from a browser)",
            }
        )

    @app.get("/status")
    def status() -> Response:
        """Warm yet, the state, counters, graphs, buckets and events (with a legend)."""
        return pretty({"legend": LEGEND, "warm": warm(), **controller.report()})

    @app.get("/ready")
    def ready() -> Response:
        """Readiness for a load balancer: 200 when warm and serving compiled, else 503."""
        state = controller.state.value
        body = {"ready": warm(), "state": state, "warmup_done": controller.wait_warm(timeout=0)}
        if state == "disabled":  # an operator's choice, fleet-wide: eager serves, stay in
            body["ready"] = body["warmup_done"]
        return pretty(body, status_code=200 if body["ready"] else 503)

    @app.post("/fault")
    def fault(request: FaultRequest) -> dict[str, Any]:
        """Make the compiled code fail or drift from its next run on."""
        with lock:
            faults.fault = request.kind
        return {"fault": faults.fault, "state": controller.state.value}

    @app.post("/killswitch")
    def killswitch(request: SwitchRequest) -> dict[str, Any]:
        """Turn the model's compiled path off (eager serves) or back on."""
        with lock:
            if request.on:
                safecompile.disable(NAME)
            else:
                safecompile.enable()
        with torch.no_grad():  # the switch is read at the next call: make one
            model(*encode([0]))
        return {"killswitch": request.on, "state": controller.state.value}

    @app.post("/reset")
    def reset() -> dict[str, Any]:
        """No fault, kill switch off, trips and graphs forgotten: compile again."""
        with lock:
            faults.fault = None
            safecompile.enable()
            controller.reset()
        return {"reset": True}  # the next call of each bucket compiles it again

    @app.get("/metrics")
    def metrics() -> Response:
        """The Prometheus scrape (OpenTelemetry metrics through its Prometheus exporter)."""
        return Response(exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def pretty(body: dict[str, Any], status_code: int = 200) -> Response:
    """JSON indented for a person reading it with curl."""
    text = json.dumps(body, indent=2) + "\n"
    return Response(text, status_code=status_code, media_type="application/json")


def endpoints(app: FastAPI) -> dict[str, str]:
    """``"POST /score": "the first line of its docstring"`` for each endpoint."""
    return {
        f"{method} {route.path}": (route.endpoint.__doc__ or "").strip().splitlines()[0]
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in sorted(route.methods)
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=PORT, help=f"port (default {PORT})")
    add_backend_option(parser, "inductor")
    args = parser.parse_args(argv)

    log_events(sys.stderr)  # compiled, rollback, disabled...: one line per state change
    app = create_app(args.backend)
    print(f"serving {NAME} on http://{args.host}:{args.port} ({args.backend})", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
