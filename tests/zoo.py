"""A model zoo: tiny real architectures from ``transformers``, random weights, no downloads.

Each builder makes a config small enough that an ``aot_eager`` compile takes seconds
(hidden 32, 2 layers, 2-4 heads, vocab 128, 32x32 images), seeds ``torch.manual_seed``
so two builds are identical, and returns a :class:`ZooModel` in ``eval()`` mode. Nothing
touches the Hugging Face hub: every model is ``XModel(XConfig(...))``.

Attention runs the implementation the default config gives (``sdpa`` in transformers 5);
every model here compiles with it under ``torch.compile(backend="aot_eager")``, so no
option had to be changed for that.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    ResNetConfig,
    ResNetModel,
    T5Config,
    T5EncoderModel,
    ViTConfig,
    ViTModel,
)

SEED = 0
VOCAB = 128
HIDDEN = 32
IMAGE = 32  # ViT and ResNet take 3x32x32 images

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class ZooModel:
    """A model, how to feed it, and which tensor of its output to compare."""

    name: str
    module: nn.Module
    inputs: Callable[[int, int], Inputs]  # (batch, seq) -> (args, kwargs)
    output: Callable[[Any], torch.Tensor]  # the model's output -> its main tensor


def _generator(batch: int, size: int) -> torch.Generator:
    """A generator seeded from the shape, so ``inputs(b, s)`` is the same on every call."""
    return torch.Generator().manual_seed(SEED + 1000 * batch + size)


def text_inputs(batch: int, seq: int, *, mask: bool = True) -> Inputs:
    """``input_ids`` (and an ``attention_mask`` whose later rows are right-padded)."""
    gen = _generator(batch, seq)
    kwargs: dict[str, Any] = {"input_ids": torch.randint(0, VOCAB, (batch, seq), generator=gen)}
    if mask:
        attention_mask = torch.ones(batch, seq, dtype=torch.long)
        for row in range(1, batch):  # row 0 is full length; each later row a bit shorter
            attention_mask[row, max(1, seq - row) :] = 0
        kwargs["attention_mask"] = attention_mask
    return (), kwargs


def image_inputs(batch: int, seq: int) -> Inputs:
    """``pixel_values`` of ``batch`` 3x32x32 images (``seq`` is ignored)."""
    del seq
    gen = _generator(batch, IMAGE)
    return (), {"pixel_values": torch.randn(batch, 3, IMAGE, IMAGE, generator=gen)}


def _last_hidden_state(out: Any) -> torch.Tensor:
    return out.last_hidden_state


def _logits(out: Any) -> torch.Tensor:
    return out.logits


def _ready(
    name: str, module: nn.Module, inputs: Callable[[int, int], Inputs], output: Any
) -> ZooModel:
    return ZooModel(name=name, module=module.eval(), inputs=inputs, output=output)


def _bert_config(*, dropout: float, **extra: Any) -> BertConfig:
    """The zoo's BERT: 2 layers, hidden 32, 2 heads (``extra``: a head's settings)."""
    return BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        **extra,
    )


def bert(*, dropout: float = 0.1) -> ZooModel:
    """BERT encoder (``BertModel``, no pooler), 2 layers, hidden 32, 2 heads."""
    torch.manual_seed(SEED)
    config = _bert_config(dropout=dropout)
    # No pooler: the main output is last_hidden_state, and a pooler left out of the loss
    # gets zero gradients (not None) under torch.compile, unlike eager.
    model = BertModel(config, add_pooling_layer=False)
    return _ready("bert", model, text_inputs, _last_hidden_state)


def gpt2(*, dropout: float = 0.1) -> ZooModel:
    """GPT-2 with its LM head (``GPT2LMHeadModel``), 2 layers, hidden 32, 2 heads."""
    torch.manual_seed(SEED)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=64,
        n_embd=HIDDEN,
        n_layer=2,
        n_head=2,
        bos_token_id=VOCAB - 1,  # GPT-2's default (50256) is outside this vocabulary
        eos_token_id=VOCAB - 1,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    return _ready("gpt2", GPT2LMHeadModel(config), text_inputs, _logits)


def llama(*, dropout: float = 0.0) -> ZooModel:
    """Llama with its LM head (``LlamaForCausalLM``), 2 layers, hidden 32, 4 heads, 2 KV heads."""
    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=dropout,
    )
    return _ready("llama", LlamaForCausalLM(config), text_inputs, _logits)


def t5_encoder(*, dropout: float = 0.1) -> ZooModel:
    """T5 encoder (``T5EncoderModel``), 2 layers, d_model 32, 2 heads, relative positions."""
    torch.manual_seed(SEED)
    config = T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
        dropout_rate=dropout,
    )
    return _ready("t5_encoder", T5EncoderModel(config), text_inputs, _last_hidden_state)


def vit(*, dropout: float = 0.0) -> ZooModel:
    """ViT (``ViTModel``, no pooler), 32x32 images in 8x8 patches, 2 layers, hidden 32, 2 heads."""
    torch.manual_seed(SEED)
    config = ViTConfig(
        image_size=IMAGE,
        patch_size=8,
        num_channels=3,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    model = ViTModel(config, add_pooling_layer=False)  # no pooler, as for BERT
    return _ready("vit", model, image_inputs, _last_hidden_state)


def resnet() -> ZooModel:
    """A CNN: ResNet (``ResNetModel``), basic blocks, 2 stages of 16 and 32 channels."""
    torch.manual_seed(SEED)
    config = ResNetConfig(
        num_channels=3,
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="basic",
        hidden_act="relu",
    )
    return _ready("resnet", ResNetModel(config), image_inputs, _last_hidden_state)


def cache_kwarg(module: nn.Module) -> str:
    """The keyword a decoder takes its KV cache by: ``cache`` (transformers >= 5.x, where
    ``past_key_values`` is deprecated) or ``past_key_values`` (older releases)."""
    params = inspect.signature(module.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_of(out: Any) -> Any:
    """The KV cache a decoder returned with ``use_cache=True``, by either name."""
    cache = out.get("cache")
    return out.get("past_key_values") if cache is None else cache


# Every builder takes no argument; those with dropout also take ``dropout=`` (0 for training).
BUILDERS: dict[str, Callable[..., ZooModel]] = {
    "bert": bert,
    "gpt2": gpt2,
    "llama": llama,
    "t5_encoder": t5_encoder,
    "vit": vit,
    "resnet": resnet,
}


def bert_classifier(*, labels: int = 3) -> nn.Module:
    """``BertForSequenceClassification`` (2 layers, hidden 32, no dropout) in ``train()``:
    called with ``labels`` it sets ``config.problem_type`` on its first call."""
    torch.manual_seed(SEED)
    config = _bert_config(dropout=0.0, num_labels=labels)
    return BertForSequenceClassification(config).train()
