"""A mixture of experts with a learned top-2 router, on MaskedBranch: each token runs through its
two experts only, weighted by the router's probabilities, and the router gets its gradient.

    python examples/moe_router.py            # a few training steps on random tokens (CPU)

MaskedBranch routes rows: tokens [B, T, d] are flattened to [B*T, d] rows first (a 3-D input
would be read as B rows of [T, d]), and the output is reshaped back. The gate is a float
[B*T, E] tensor, zero except at each token's two experts: MaskedBranch runs expert e on the
rows whose weight for e is nonzero and sums ``weight * expert(row)``.

On a GPU, the router's output lives on the device, so each call reads the per-expert token
counts back to the host once (one synchronization: the counts decide the experts' batch sizes).
Under torch.compile the counts stay in the graph (docs/guides/compile.md); a gate computed on the
host (a CPU router, a fixed assignment) needs no readback at all.
"""
import torch
from torch import nn

import maskedbranch as mb


class MoE(nn.Module):
    def __init__(self, d: int = 32, hidden: int = 64, experts: int = 8, k: int = 2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, experts)
        self.experts = mb.MaskedBranch([nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)) for _ in range(experts)])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t, d = tokens.shape
        rows = tokens.reshape(b * t, d)  # MaskedBranch routes rows: [B*T, d]
        probs = self.router(rows).softmax(-1)
        top, idx = probs.topk(self.k, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        return self.experts(rows, weights).reshape(b, t, d)  # [B*T, E] weights: top-2 per token


def main() -> None:
    torch.manual_seed(0)
    model = MoE()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, target = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    for step in range(5):
        opt.zero_grad()
        loss = (model(tokens) + tokens - target).square().mean()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}, router grad norm {model.router.weight.grad.norm():.4f}")


if __name__ == "__main__":
    main()
