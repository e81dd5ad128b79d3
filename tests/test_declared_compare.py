"""Drift you can explain and declare: a breach says where the outputs differ (and which
input mask the differences line up with); ``Shadow(compare=...)`` declares don't-care
positions (``ignore_where``) or a comparison of one's own, for every kind of check."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from safecompile import (
    Buckets,
    ConfigError,
    EventKind,
    Reason,
    Rollback,
    Shadow,
    State,
    ignore_where,
    safe_compile,
)
from safecompile.testing import DriftingBackend, drain_shadow_checks

NO_SPEED = Rollback(slower_ratio=None)  # cheap backends are slower than eager: not the point


def padded_zero(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Like eager ``nn.TransformerEncoder``'s fast path: eager returns 0 at the positions
    ``mask`` pads; compiled code returns values there. Equal elsewhere."""
    y = x * 2 + 1
    if not torch.compiler.is_compiling():
        y = y.masked_fill(mask.unsqueeze(-1), 0.0)
    return y


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(2, 6, 4)
    mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    return x, mask


def breach_event(g: Any) -> Any:
    [event] = [e for e in g.safecompile.events() if e.kind == EventKind.BREACH]
    return event


def test_breach_says_where_and_which_mask_it_lines_up_with() -> None:
    """Undeclared: the breach names how many elements differ, the worst one's index and
    its difference as a share, and that they differ only where ``mask`` is True; the
    rollback carries the same text. No tensor value is in the message."""
    g = safe_compile(padded_zero, backend="eager", rollback=NO_SPEED)
    x, mask = batch()

    out = g(x, mask)

    torch.testing.assert_close(out, padded_zero(x, mask))  # eager's answer
    assert g.safecompile.state == State.ROLLED_BACK
    event = breach_event(g)
    assert "8 of 48 elements differ" in event.message  # 2 positions x 4 features
    assert "they differ only where mask is True" in event.message
    assert "ignore_where('mask')" in event.message  # the declaration to make
    differ = event.details["differ"]
    assert differ["path"] == "out"
    assert differ["differ"] == 8
    assert differ["elements"] == 48
    assert differ["worst_index"][:2] in ([1, 4], [1, 5])
    assert differ["mask"] == "mask"
    assert differ["mask_value"] is True
    worst = tuple(differ["worst_index"])
    expected = (x * 2 + 1)[worst].abs().item()
    assert differ["worst_diff"] == pytest.approx(expected)
    assert f"{expected:.3g}" not in event.message  # a share, not the tensor's own units
    rollback = g.safecompile.stats().last_rollback
    assert rollback is not None
    assert rollback.reason == Reason.DRIFT
    assert "they differ only where mask is True" in (rollback.message or "")


def test_declared_mask_serves_compiled_in_canary_and_sampled_checks() -> None:
    """``ignore_where("mask")``: the masked positions are not compared, by the canary and
    the sampled checks alike; real positions still are, and report() shows it."""
    g = safe_compile(
        padded_zero,
        backend="eager",
        shadow=Shadow(canary=2, every=2, compare=ignore_where("mask")),
        rollback=NO_SPEED,
    )
    x, mask = batch()
    for _ in range(6):
        g(x, mask)

    c = g.safecompile
    assert c.state == State.COMPILED
    assert c.stats().compiled_calls == 6
    assert c.stats().shadow_checks == 4  # 2 canary + 2 sampled (every 2)
    assert c.stats().shadow_breaches == 0
    assert c.stats().max_abs_diff == 0.0  # the masked positions are not in the figures
    assert c.report()["shadow"]["compare"] == "ignore_where('mask')"


def test_declared_mask_still_catches_drift_on_real_positions() -> None:
    """The declaration hides the masked positions only: a 1% drift still trips."""
    g = safe_compile(
        padded_zero,
        backend=DriftingBackend(scale=1.01),
        shadow=Shadow(compare=ignore_where("mask")),
        rollback=NO_SPEED,
    )
    g(*batch())
    assert g.safecompile.state == State.ROLLED_BACK
    assert "differ" in breach_event(g).message


def test_declared_mask_applies_to_async_checks() -> None:
    """Async checks compare as declared too (on the worker, with copies of the inputs)."""
    declared = safe_compile(
        padded_zero,
        backend="eager",
        shadow=Shadow(canary=3, mode="async", compare=ignore_where("mask")),
        rollback=NO_SPEED,
    )
    undeclared = safe_compile(
        padded_zero, backend="eager", shadow=Shadow(canary=3, mode="async"), rollback=NO_SPEED
    )
    x, mask = batch()
    for _ in range(3):
        declared(x, mask)
    undeclared(x, mask)
    drain_shadow_checks()

    assert declared.safecompile.stats().shadow_checks == 3
    assert declared.safecompile.state == State.COMPILED
    assert undeclared.safecompile.state == State.ROLLED_BACK
    assert "they differ only where mask is True" in breach_event(undeclared).message


def test_declared_mask_applies_to_a_buckets_first_call() -> None:
    """A bucket's first padded call is verified against eager as declared, so the bucket
    serves (without it, the masked positions trip the callable)."""

    def run(shadow: Shadow) -> Any:
        g = safe_compile(
            padded_zero,
            backend="eager",
            buckets=Buckets(dims={"x": 1, "mask": 1}, sizes=(8,), pad_value={"mask": 1}),
            shadow=shadow,
            rollback=NO_SPEED,
        )
        g(*batch())
        return g.safecompile

    assert run(Shadow(compare=ignore_where("mask"))).state == State.CANARY
    assert run(Shadow()).state == State.ROLLED_BACK


def test_equals_zero_for_a_keep_mask_and_transposed_dims() -> None:
    """``equals=0`` ignores where a 1-keep/0-pad mask is 0; ``dims`` lines a (batch, seq)
    mask up with a (seq, batch, ...) output."""

    def seq_first(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        y = x.transpose(0, 1) * 2  # (seq, batch, dim)
        if not torch.compiler.is_compiling():
            y = y * keep.transpose(0, 1).unsqueeze(-1)
        return y

    x, mask = batch()
    keep = (~mask).float()
    undeclared = safe_compile(seq_first, backend="eager", rollback=NO_SPEED)
    undeclared(x, keep)
    message = breach_event(undeclared).message
    assert "they differ only where keep is 0" in message
    assert "ignore_where('keep', equals=0, dims=(1, 0))" in message

    g = safe_compile(
        seq_first,
        backend="eager",
        shadow=Shadow(compare=ignore_where("keep", equals=0, dims=(1, 0))),
        rollback=NO_SPEED,
    )
    g(x, keep)
    assert g.safecompile.state == State.CANARY


def test_callable_compare_decides_like_scientist() -> None:
    """A callable gets ``(eager_out, compiled_out, args, kwargs)`` and its bool decides;
    False trips with a reason that names it."""
    seen: list[tuple[Any, ...]] = []

    def real_tokens_close(eager: Any, compiled: Any, args: Any, kwargs: Any) -> bool:
        seen.append((eager, compiled, args, kwargs))
        keep = ~args[1].unsqueeze(-1)
        return bool(torch.allclose(eager * keep, compiled * keep))

    def never(eager: Any, compiled: Any, args: Any, kwargs: Any) -> bool:
        return False

    x, mask = batch()
    g = safe_compile(
        padded_zero,
        backend="eager",
        shadow=Shadow(compare=real_tokens_close),
        rollback=NO_SPEED,
    )
    g(x, mask)
    assert g.safecompile.state == State.CANARY
    eager, compiled, args, kwargs = seen[0]
    assert torch.equal(eager, padded_zero(x, mask))
    assert not torch.equal(compiled, eager)  # the compiled output, values at the padding
    assert args[0] is x
    assert kwargs == {}
    assert g.safecompile.report()["shadow"]["compare"].endswith("real_tokens_close")

    h = safe_compile(affine, backend="eager", shadow=Shadow(compare=never), rollback=NO_SPEED)
    h(torch.randn(8))
    assert h.safecompile.state == State.ROLLED_BACK
    assert "returned False" in (h.safecompile.stats().last_rollback.message or "")  # type: ignore[union-attr]


def affine(x: torch.Tensor) -> torch.Tensor:
    return x * 3 + 1


@pytest.mark.parametrize(
    ("compare", "match"),
    [
        (lambda eager, compiled: True, "four positional arguments"),
        (5, "must be None, safecompile.ignore_where"),
        ("mask", "must be None, safecompile.ignore_where"),
    ],
)
def test_shadow_compare_is_validated(compare: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Shadow(compare=compare)


def test_ignore_where_is_validated() -> None:
    with pytest.raises(ConfigError, match="must name an argument"):
        ignore_where("not a name")
    with pytest.raises(ConfigError, match="distinct non-negative"):
        ignore_where("mask", dims=(0, 0))
    with pytest.raises(ConfigError, match="bool or a number"):
        ignore_where("mask", equals="pad")  # type: ignore[arg-type]


def test_ignore_where_names_a_parameter_at_decoration() -> None:
    """The argument is checked against the function's signature when decorating, with a
    did-you-mean; a module's forward is what is checked."""
    with pytest.raises(ConfigError, match=r"'maks', which is not a parameter.*did you mean 'mask'"):
        safe_compile(padded_zero, shadow=Shadow(compare=ignore_where("maks")))
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
    with pytest.raises(ConfigError, match="did you mean 'src_key_padding_mask'"):
        safe_compile(layer, shadow=Shadow(compare=ignore_where("src_key_padding_maks")))


# The case: the most common encoder in torch.nn, served with a padding mask.


def encoder() -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(2, 6, 16)
    mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    return x, mask


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_transformer_encoder_with_padding_mask() -> None:
    """Eager's nested-tensor fast path returns 0 at padded positions; the compiled graph
    returns values there. Declared: served compiled. Undeclared: rolled back, and the
    event says where and that it is the padding."""
    x, mask = padded_batch()
    with torch.no_grad():
        reference = encoder()(x, src_key_padding_mask=mask)
        assert reference[1, 4:].abs().max() == 0  # the fast path's zeros

        declared = safe_compile(
            encoder(),
            backend="aot_eager",
            shadow=Shadow(canary=2, compare=ignore_where("src_key_padding_mask")),
            rollback=NO_SPEED,
        )
        for _ in range(3):
            out = declared(x, src_key_padding_mask=mask)
        torch.testing.assert_close(out[0], reference[0])  # real tokens agree
        assert declared.safecompile.state == State.COMPILED
        assert declared.safecompile.stats().compiled_calls == 3

        undeclared = safe_compile(encoder(), backend="aot_eager", rollback=NO_SPEED)
        out = undeclared(x, src_key_padding_mask=mask)

    assert torch.equal(out, reference)  # eager's answer, zeros and all
    c = undeclared.safecompile
    assert c.state == State.ROLLED_BACK
    rollback = c.stats().last_rollback
    assert rollback is not None
    assert rollback.reason == Reason.DRIFT
    message = rollback.message or ""
    assert "32 of 192 elements differ" in message  # 2 padded positions x 16 features
    assert "they differ only where src_key_padding_mask is True" in message
    differ = breach_event(undeclared).details["differ"]
    assert differ["worst_index"][:2] in ([1, 4], [1, 5])
    assert differ["mask"] == "src_key_padding_mask"


def test_declared_comparison_keys_persisted_verdicts() -> None:
    """A bucket verdict verified under one declared comparison is not reused under another
    (nor under none); the key names it the same way in every process."""
    from safecompile.base.options import Options

    def key(shadow: Shadow) -> Any:
        return Options(shadow=shadow).verdict_key(checks=True)["extra"]

    assert "compare" not in key(Shadow())
    assert key(Shadow(compare=ignore_where("mask")))["compare"] == "ignore_where('mask')"
    assert key(Shadow(compare=ignore_where("mask", equals=0)))["compare"] != "ignore_where('mask')"
