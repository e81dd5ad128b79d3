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
    """A transformer encoder block (d_model 256) with a key-padding mask."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(
            D_MODEL, 8, dim_feedforward=4 * D_MODEL, dropout=0.0, batch_first=True
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.layer(x, src_key_padding_mask=mask)
        return out
