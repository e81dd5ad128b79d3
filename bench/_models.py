"""Models the benchmarks share, so every bench measures the same thing."""

from __future__ import annotations

import torch
from torch import nn

D_MODEL = 256


class MLP(nn.Module):
    """3x Linear(512) with ReLUs: the issue's small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


class Block(nn.Module):
    """A transformer encoder block (d_model 256, 8 heads unless told) with a key-padding
    mask."""

    def __init__(self, d_model: int = D_MODEL, heads: int = 8) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layer(x, src_key_padding_mask=mask)
        return out
