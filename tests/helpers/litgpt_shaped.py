"""A model with LitGPT's module layout: `transformer = ModuleDict(wte, h=ModuleList(blocks), ln_f)` and `lm_head`.
The blocks live in a ModuleList inside a ModuleDict, neither with a forward of its own (what Fabric's default FSDP2
wrapping must look into)."""

from __future__ import annotations

import torch


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn, self.mlp = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.relu(self.attn(x)))


class LitGPTShaped(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.lm_head = torch.nn.Linear(8, 16)
        self.transformer = torch.nn.ModuleDict(
            dict(wte=torch.nn.Embedding(16, 8), h=torch.nn.ModuleList([Block(), Block()]), ln_f=torch.nn.LayerNorm(8))
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def tokens(seed: int) -> torch.Tensor:
    """A batch of 4 sequences of 6 token ids below the vocabulary size (16)."""
    return torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(seed))
