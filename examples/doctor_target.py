"""A small transformer block to point the doctor at.

    python -m safecompile doctor examples/doctor_target.py:doctor_target
    python -m safecompile doctor examples/doctor_target.py:doctor_target --backend aot_eager

``doctor_target()`` returns a :class:`~safecompile.doctor.DoctorTarget`: the model (in
``eval()`` mode, as it serves) and one example call per shape it serves. The doctor compiles
each example cold, sweeps batch and sequence lengths around the first one, times compiled
against eager and compares their outputs. The target's backend is ``inductor`` (the
doctor's verdict is about the compiler you will serve with; its first compiles are cold,
tens of seconds on a CPU), or ``$SAFECOMPILE_EXAMPLE_BACKEND`` when set; the doctor's
``--backend`` overrides both. ``_common.py`` beside this file is the examples' shared helper.
"""

from __future__ import annotations

import torch
from _common import example_backend
from torch import nn

from safecompile.doctor import DoctorTarget


class Block(nn.Module):
    """Pre-norm self-attention and MLP, GPT style."""

    def __init__(self, dim: int = 128, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        keep = mask[:, None, None, :]  # (b, 1, 1, s): padding positions are False
        attn = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class TinyLM(nn.Module):
    """Token embedding, two blocks, a tied output head."""

    def __init__(self, vocab: int = 1000, dim: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        logits: torch.Tensor = self.norm(x) @ self.embed.weight.T
        return logits


def _call(batch: int, seq: int, vocab: int = 1000) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.bool)
    mask[:, seq - seq // 4 :] = False  # the last quarter is padding
    return tokens, mask


def doctor_target() -> DoctorTarget:
    """The model as it serves, and the shapes it serves most."""
    torch.manual_seed(0)
    model = TinyLM().eval()
    return DoctorTarget(
        fn=model, inputs=[_call(8, 64), _call(1, 64)], backend=example_backend("inductor")
    )


if __name__ == "__main__":
    target = doctor_target()
    with torch.no_grad():
        print(target.fn(*target.inputs[0]).shape)
