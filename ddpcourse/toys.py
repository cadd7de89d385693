"""Tiny models and generated data: everything a chapter trains on is made here, never downloaded.

Sizes are chosen so a 2-core laptop trains them in seconds, and every generator takes a seed so
that a single-process run and a DDP run can be compared number for number.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def make_regression(
    num_samples: int,
    in_features: int = 8,
    out_features: int = 1,
    noise: float = 0.1,
    seed: int = 0,
) -> TensorDataset:
    """A noisy linear-plus-sine regression problem: ``y = sin(x @ W) + noise``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, in_features, generator=generator)
    w = torch.randn(in_features, out_features, generator=generator) / in_features**0.5
    y = torch.sin(2 * x @ w) + noise * torch.randn(num_samples, out_features, generator=generator)
    return TensorDataset(x, y)


class TinyMLP(nn.Module):
    """Two hidden layers with tanh: small, smooth, and enough to make training visible."""

    def __init__(self, in_features: int = 8, hidden: int = 32, out_features: int = 1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, out_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_model(seed: int, **sizes) -> TinyMLP:
    """A TinyMLP whose initial weights depend only on ``seed``."""
    torch.manual_seed(seed)
    return TinyMLP(**sizes)


def flat_parameters(model: nn.Module) -> torch.Tensor:
    """All parameters as one detached vector (for comparing two models in one number)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
