"""safecompile in one minute: guard a model, watch it compile, fail safely, and roll back.

    python examples/quickstart.py                      # inductor: the real compiler
    python examples/quickstart.py --backend aot_eager  # quick: no C++ compiles

(``--backend`` defaults to ``$SAFECOMPILE_EXAMPLE_BACKEND`` when set, else ``inductor``.)

Three guarded callables, each showing one promise:

1. a small ranking model compiles and serves, shadow-checked against eager: each graph
   torch compiles is compared with eager on its first calls (its canary), and the model
   stays in state ``canary`` until every graph has passed its own;
2. a post-processing function that cannot compile under ``fullgraph=True`` (a graph
   break): the caller still gets eager's answer, the guard rolls back, and the event
   points at the user's own line;
3. a model whose compiled output drifts by 1% (a fault-injecting backend): the canary
   catches it, the caller never sees the drifted value.

Then the kill switch turns everything off at runtime, without a restart.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from _common import add_backend_option, canary_lines, log_events, summary

import safecompile
from safecompile import Shadow, safe_compile
from safecompile.observe.progress import spinner
from safecompile.testing import DriftingBackend


class Ranker(torch.nn.Module):
    """A toy two-layer scorer."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


def show(guarded: object) -> None:
    """Its state, counters and events, each event with the user's file:line."""
    controller = guarded.safecompile  # type: ignore[attr-defined]
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
    add_backend_option(parser, "inductor")
    args = parser.parse_args()

    # Show safecompile's state-change log events (it is silent unless you configure logging).
    log_events(sys.stdout, prefix="   log: ")

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
    with spinner(sys.stderr):  # on a terminal: "compiling demo.ranker [...] … 12 s"
        main()
