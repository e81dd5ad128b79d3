"""The model zoo: real transformers architectures guarded end to end against eager."""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zoo

from safecompile import EventKind, Shadow, State, safe_compile
from safecompile.testing import DriftingBackend, PoolBackend

# (batch, seq): the same shape thrice, then another (vision models ignore seq).
SHAPES = [(2, 8), (2, 8), (2, 8), (3, 12), (3, 12)]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each test starts with an empty dynamo cache and a fresh recompile budget."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def guard(model: zoo.ZooModel, shadow: Shadow, **options: Any) -> torch.nn.Module:
    """Guard the zoo model in place (compiled with aot_eager unless told otherwise)."""
    options.setdefault("backend", "aot_eager")
    return safe_compile(model.module, shadow=shadow, name=f"zoo.{model.name}", **options)


def messages(module: torch.nn.Module, kind: EventKind) -> list[str | None]:
    """The messages of the guard's events of one kind (for assertion failures)."""
    return [e.message for e in module.safecompile.events() if e.kind == kind]


def assert_no_rollback(module: torch.nn.Module) -> None:
    """Nothing rolled back: no rollback counted, no rollback event."""
    stats = module.safecompile.stats()
    assert stats.rollbacks == 0, stats.last_rollback
    assert not messages(module, EventKind.ROLLBACK)


def assert_clean(module: torch.nn.Module) -> None:
    """Shadow checks ran, none was skipped, nothing rolled back."""
    stats = module.safecompile.stats()
    skipped = messages(module, EventKind.SHADOW_SKIPPED)
    assert stats.shadow_checks > 0, f"no shadow check in {stats.compiled_calls} calls: {skipped}"
    assert stats.shadow_skipped == 0, skipped
    assert_no_rollback(module)


def run_inference(name: str, backend: str, **tolerance: float) -> None:
    """Five calls over two shapes through the guard; each equals the eager reference's."""
    model = zoo.BUILDERS[name]()
    reference = copy.deepcopy(model.module)
    guarded = guard(model, Shadow(canary=4, every=1), backend=backend)
    with torch.no_grad():
        for batch, seq in SHAPES:
            args, kwargs = model.inputs(batch, seq)
            got = model.output(guarded(*args, **kwargs))
            expected = model.output(reference(*args, **kwargs))
            torch.testing.assert_close(got, expected, **tolerance)
    assert_clean(guarded)


@pytest.mark.parametrize("name", list(zoo.BUILDERS))
def test_zoo_inference_matches_eager(name: str) -> None:
    """Each zoo model under aot_eager: every call equals eager, all shadow-checked, no trip."""
    run_inference(name, "aot_eager")


@pytest.mark.inductor
@pytest.mark.parametrize("name", ["bert", "resnet"])
def test_zoo_inference_matches_eager_inductor(name: str) -> None:
    """BERT and ResNet under real inductor: calls equal eager, shadow-checked, no trip."""
    run_inference(name, "inductor", rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_zoo_training_gradients_match_eager(name: str) -> None:
    """Training (dropout 0): backward through the guard gives eager's gradient for every param."""
    model = zoo.BUILDERS[name](dropout=0.0)
    model.module.train()
    reference = copy.deepcopy(model.module)
    guarded = guard(model, Shadow(canary=4, every=1))
    for _ in range(3):
        args, kwargs = model.inputs(2, 8)
        for module in (guarded, reference):
            module.zero_grad(set_to_none=True)
            model.output(module(*args, **kwargs)).pow(2).mean().backward()
        for (param_name, expected), got in zip(
            reference.named_parameters(), guarded.parameters(), strict=True
        ):
            assert expected.grad is not None, param_name
            assert got.grad is not None, param_name
            torch.testing.assert_close(got.grad, expected.grad, msg=param_name)
    assert_clean(guarded)


def test_zoo_variable_shape_traffic() -> None:
    """GPT-2 on 40 random (batch, seq) shapes: all equal eager; checks bounded by the canary."""
    model = zoo.gpt2()
    reference = copy.deepcopy(model.module)
    canary = 4
    guarded = guard(model, Shadow(canary=canary, every=0))
    rng = random.Random(0)
    with torch.no_grad():
        for _ in range(40):
            args, kwargs = model.inputs(rng.randint(1, 4), rng.randint(4, 32))
            got = model.output(guarded(*args, **kwargs))
            torch.testing.assert_close(got, model.output(reference(*args, **kwargs)))
    stats = guarded.safecompile.stats()
    assert stats.calls == 40
    assert stats.calls == stats.compiled_calls + stats.eager_calls
    assert stats.shadow_checks <= canary * stats.graphs + 4, (stats.shadow_checks, stats.graphs)


def test_zoo_kv_cache_decoding_matches_eager() -> None:
    """Llama prefill then 3 decode steps on its KV cache: logits and cache lengths equal eager."""
    model = zoo.llama()
    reference = copy.deepcopy(model.module)
    guarded = guard(model, Shadow(canary=4, every=1))
    key = zoo.cache_kwarg(reference)
    _, kwargs = zoo.text_inputs(2, 6, mask=False)
    tokens = kwargs["input_ids"]
    caches: dict[str, Any] = {"guarded": None, "reference": None}
    with torch.no_grad():
        for step in range(4):  # step 0: the prompt; then one token at a time
            outs = {}
            for which, module in (("guarded", guarded), ("reference", reference)):
                extra = {} if caches[which] is None else {key: caches[which]}
                outs[which] = module(input_ids=tokens, use_cache=True, **extra)
                caches[which] = zoo.cache_of(outs[which])
            torch.testing.assert_close(
                outs["guarded"].logits, outs["reference"].logits, msg=f"step {step}"
            )
            assert (
                caches["guarded"].get_seq_length()
                == caches["reference"].get_seq_length()
                == (6 + step)
            )
            tokens = outs["reference"].logits[:, -1:].argmax(-1)
    assert_no_rollback(guarded)


# ------------------------------------------------------------ calls that update Python state

PROMPT = 6
NEW_TOKENS = 4


def generate(module: torch.nn.Module, **options: Any) -> torch.Tensor:
    _, kwargs = zoo.text_inputs(2, PROMPT, mask=False)
    with torch.no_grad():
        out: torch.Tensor = module.generate(  # type: ignore[operator]
            kwargs["input_ids"],
            attention_mask=torch.ones_like(kwargs["input_ids"]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=zoo.VOCAB - 1,
            **options,
        )
    return out


@pytest.mark.parametrize(
    ("name", "cache"), [("gpt2", "dynamic"), ("llama", "dynamic"), ("llama", "static")]
)
def test_zoo_generate_with_a_kv_cache_is_checked_on_every_graph(name: str, cache: str) -> None:
    """``generate()`` updates its KV cache in every call (a ``DynamicCache`` rebinds its
    layers' tensors, a ``StaticCache`` writes them in place): every graph gets its canary
    checks, none is skipped, and the tokens are eager's."""
    model = zoo.BUILDERS[name](dropout=0.0)
    reference = copy.deepcopy(model.module)
    guarded = guard(model, Shadow(canary=8, every=64))
    options = {} if cache == "dynamic" else {"cache_implementation": "static"}
    torch.testing.assert_close(generate(guarded, **options), generate(reference, **options))
    stats = guarded.safecompile.stats()
    assert stats.shadow_skipped == 0, messages(guarded, EventKind.SHADOW_SKIPPED)
    assert stats.shadow_checks == stats.compiled_calls == NEW_TOKENS
    graphs = guarded.safecompile.report()["graphs"]
    assert all(g["checks"] == g["calls"] > 0 for g in graphs if g["compiled"]), graphs
    assert guarded.safecompile.state is State.CANARY  # canary=8: checks still to come
    assert_no_rollback(guarded)


def test_zoo_drift_while_decoding_is_caught_and_the_tokens_are_eagers() -> None:
    """A backend whose outputs drift by 1%: the first checked decode call breaches, the
    callable rolls back, and generate() returns exactly eager's tokens."""
    model = zoo.gpt2(dropout=0.0)
    reference = copy.deepcopy(model.module)
    guarded = guard(model, Shadow(canary=8, every=64), backend=DriftingBackend(scale=1.01))
    torch.testing.assert_close(generate(guarded), generate(reference))
    stats = guarded.safecompile.stats()
    assert stats.shadow_breaches == 1
    assert guarded.safecompile.state is State.ROLLED_BACK
    assert stats.compiled_calls == 0


def test_zoo_classifier_training_with_labels_is_checked() -> None:
    """``BertForSequenceClassification`` with labels sets ``config.problem_type`` on its
    first call (then the same value again): checked on every call, gradients eager's."""
    module = zoo.bert_classifier()
    reference = copy.deepcopy(module)
    guarded = safe_compile(
        module, backend="aot_eager", shadow=Shadow(canary=3, every=1), name="zoo.classifier"
    )
    labels = torch.tensor([0, 2])
    for _ in range(3):
        _, kwargs = zoo.text_inputs(2, 8)
        for m in (guarded, reference):
            m.zero_grad(set_to_none=True)
            m(**kwargs, labels=labels).loss.backward()
        for (param_name, expected), got in zip(
            reference.named_parameters(), guarded.parameters(), strict=True
        ):
            torch.testing.assert_close(got.grad, expected.grad, msg=param_name)
    assert module.config.problem_type == "single_label_classification"
    stats = guarded.safecompile.stats()
    assert (stats.shadow_checks, stats.shadow_skipped) == (3, 0), messages(
        guarded, EventKind.SHADOW_SKIPPED
    )
    assert guarded.safecompile.state is State.COMPILED
    assert_clean(guarded)


@pytest.mark.parametrize(("name", "cache"), [("gpt2", "dynamic"), ("llama", "static")])
def test_zoo_generate_on_a_pool_backend_is_checked_without_false_drift(
    name: str, cache: str
) -> None:
    """Decoding where every run writes its outputs into the same tensors, as CUDA graphs
    do (``testing.PoolBackend``): the checks compare each call's own outputs and cache
    updates, so none breaches, and the tokens are eager's."""
    model = zoo.BUILDERS[name](dropout=0.0)
    reference = copy.deepcopy(model.module)
    guarded = guard(model, Shadow(canary=8, every=64), backend=PoolBackend())
    options = {} if cache == "dynamic" else {"cache_implementation": "static"}
    torch.testing.assert_close(generate(guarded, **options), generate(reference, **options))
    stats = guarded.safecompile.stats()
    assert stats.shadow_checks == stats.compiled_calls == NEW_TOKENS
    assert stats.shadow_skipped == 0, messages(guarded, EventKind.SHADOW_SKIPPED)
    assert_no_rollback(guarded)
