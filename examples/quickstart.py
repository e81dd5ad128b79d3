"""safecompile in one minute: guard a model, watch it compile, fail safely, and roll back.

    python examples/quickstart.py                     # aot_eager: a few seconds
    python examples/quickstart.py --backend inductor  # the real compiler (see below)

The backend is ``aot_eager`` unless ``--backend`` (or ``$SAFECOMPILE_EXAMPLE_BACKEND``)
names another: it traces and runs the same graphs as ``inductor`` without generating and
compiling C++, so the whole demo runs in a few seconds. ``--backend inductor`` is what you
would run in production; its first compile on a machine is cold (about 30 s for the
ranker's first graph on a 2-core CPU, generating and building C++), and later runs read
torch's on-disk caches.

Three guarded callables, each showing one promise:

1. a small ranking model compiles and serves, shadow-checked against eager: each graph
   torch compiles is compared with eager on its first calls (its canary), and the model
   stays in state ``canary`` until every graph has passed its own;
2. a post-processing function that cannot compile under ``fullgraph=True`` (a graph
   break): the caller still gets eager's answer, the guard rolls back, and the event
   points at the user's own line;
3. a model whose compiled output drifts by 1% (a fault-injecting backend): the canary
   catches it, the caller never sees the drifted value.

Then the kill switch turns everything off at runtime, without a restart. Everything here
is safecompile's public API; safecompile's log events are printed because this script
configures the standard library's logging (safecompile itself is silent by default).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import torch

import safecompile
from safecompile import Shadow, safe_compile
from safecompile.testing import DriftingBackend

BACKEND_ENV_VAR = "SAFECOMPILE_EXAMPLE_BACKEND"  # CI runs every example on aot_eager


class Ranker(torch.nn.Module):
    """A toy two-layer scorer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def summary(guarded: Any) -> str:
    """One line on a guarded callable: its name, state and call counts."""
    controller = guarded.safecompile
    stats = controller.stats()
    return (
        f"{controller.name}: state={controller.state.value} calls={stats.calls} "
        f"compiled={stats.compiled_calls} eager={stats.eager_calls} "
        f"graph_breaks={stats.graph_breaks} shadow_checks={stats.shadow_checks} "
        f"rollbacks={stats.rollbacks}"
    )


def canary_lines(guarded: Any) -> list[str]:
    """Why the state is what it is: each graph's calls, checks and canary checks left,
    from the controller's JSON report."""
    lines = []
    for graph in guarded.safecompile.report()["graphs"]:
        left = graph["canary_left"]
        where = f"{left} canary check(s) left" if left else "canary done"
        if graph["unchecked"]:
            where = f"never checked: {graph['unchecked']}"
        lines.append(
            f"graph {graph['id']} ({graph['inputs']}): {graph['calls']} call(s), "
            f"{graph['checks']} checked, {where}"
        )
    return lines


def show(guarded: Any) -> None:
    """Its state, counters and events, each event with the user's file:line."""
    controller = guarded.safecompile
    print(f"\n== {summary(guarded)}")
    for event in controller.events():
        where = f" at {os.path.basename(event.file)}:{event.line}" if event.file else ""
        reason = f" [{event.reason.value}]" if event.reason else ""
        first_line = (event.message or "").splitlines()[0] if event.message else ""
        if where and where.strip() in first_line:  # the message names the line itself
            where = ""
        print(f"   - {event.kind.value}{reason}{where}: {first_line}")


def main() -> None:
    parser = argparse.ArgumentParser(description="safecompile quickstart")
    parser.add_argument(
        "--backend",
        default=os.environ.get(BACKEND_ENV_VAR) or "aot_eager",
        help=f"torch.compile backend (default: ${BACKEND_ENV_VAR}, else aot_eager; "
        "inductor is the real compiler, with a cold first compile)",
    )
    args = parser.parse_args()

    # Show safecompile's state-change log events: it is silent unless the application
    # configures logging. With the standard library at INFO, each event is one line.
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="log: %(message)s")

    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, safecompile {safecompile.__version__}, backend={args.backend}"
    )

    # 1. A model, guarded in place: same object, same state_dict keys.
    model = safe_compile(
        Ranker().eval(), backend=args.backend, shadow=Shadow(canary=4, every=32), name="demo.ranker"
    )
    with torch.no_grad():
        for batch in (8, 8, 8, 8, 8, 16, 16):
            scores = model(torch.randn(batch, 32))
    print(f"\nscored a batch of {scores.shape[0]}; state_dict keys: {list(model.state_dict())}")
    show(model)

    # Why "canary": Shadow(canary=4) compares each graph's first 4 calls with eager, and the
    # state is the callable's: "canary" while any of its graphs still has checks left.
    print("   why canary: each graph's first 4 calls are checked against eager, and the model")
    print("   stays in canary until every graph has passed its own:")
    for line in canary_lines(model):
        print(f"     {line}")
    left = max(graph["canary_left"] for graph in model.safecompile.report()["graphs"])
    with torch.no_grad():
        for _ in range(left):
            model(torch.randn(16, 32))
    print(f"   {left} more batch(es) of 16 end the canary: state={model.safecompile.state.value}")

    # 2. A function that cannot compile with fullgraph=True: data-dependent Python control flow.
    @safe_compile(backend=args.backend, fullgraph=True, name="demo.postprocess")
    def postprocess(scores: torch.Tensor) -> torch.Tensor:
        if scores.max().item() > 0:  # .item() breaks the graph: fullgraph=True cannot compile this
            return scores.softmax(-1)
        return scores

    probs = postprocess(scores)
    print(f"\npostprocess still answered (sum of probabilities = {probs.sum().item():.3f})")
    show(postprocess)

    # 3. A compiled path that drifts by 1%: caught in the canary, never returned.
    def head(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ x.T).sum(-1)

    drifting = safe_compile(head, backend=DriftingBackend(scale=1.01), name="demo.head")
    x = torch.randn(8, 8)
    assert torch.equal(drifting(x), head(x)), "a drifted result reached the caller"
    print("\nthe drifting path was caught: the caller got eager's exact result")
    show(drifting)

    # 4. The kill switch: honoured at the next call, no restart.
    os.environ[safecompile.ENV_VAR] = "demo.*"
    with torch.no_grad():
        model(torch.randn(8, 32))
    print(f"\nwith {safecompile.ENV_VAR}=demo.* the ranker is {model.safecompile.state.value}")
    del os.environ[safecompile.ENV_VAR]
    with torch.no_grad():
        model(torch.randn(8, 32))
    print(f"and after unsetting it, {model.safecompile.state.value} again")


if __name__ == "__main__":
    main()
