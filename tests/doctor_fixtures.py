"""Model factories for ``python -m maskedbranch.doctor`` (used by tests/test_doctor.py, and examples
of the factory contract): ``python -m maskedbranch.doctor doctor_fixtures:reference`` with this
folder on PYTHONPATH."""
import torch
from torch import nn

import maskedbranch


def _linear(value: float = 1.0) -> nn.Linear:
    layer = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(value)
    return layer


class IfElse(nn.Module):
    """The reference case: rank r feeds r + 1 ones, through layer1 when r is odd (an even batch),
    through layer2 when r is even."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = _linear()
        self.layer2 = _linear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] % 2 == 0:
            return self.layer1(x)
        return self.layer2(x)


class MaskedIfElse(nn.Module):
    """The same routing with maskedbranch.MaskedBranch: both layers stay in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = maskedbranch.MaskedBranch([_linear(), _linear()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x, 0 if x.shape[0] % 2 == 0 else 1)


class WithUnusedHead(nn.Module):
    """``extra`` is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class RandomLayerDrop(nn.Module):
    """LayerDrop with a Python ``if`` on a random draw: which blocks run differs per rank."""

    def __init__(self, depth: int = 4, p: float = 0.5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(depth))
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if not self.training or torch.rand(()) >= self.p:
                x = x + block(x)
        return x


class Supernet(nn.Module):
    """One of four choices per call, picked by the caller (random in a supernet job). With
    ``plain=True`` the choices are an nn.ModuleList called as ``choices[i](x)`` (if/else);
    ``unused_head=True`` adds a layer that is never called."""

    def __init__(self, plain: bool = False, unused_head: bool = False) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        layers = [nn.Linear(4, 4) for _ in range(4)]
        self.choices = nn.ModuleList(layers) if plain else maskedbranch.MaskedBranch(layers)
        self.plain = plain
        if unused_head:
            self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, choice: int) -> torch.Tensor:
        h = self.stem(x)
        return self.choices[choice](h) if self.plain else self.choices(h, choice)


class NotCalled(nn.Module):
    """A MaskedBranch that the forward never calls (left over from a refactoring)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.choices = maskedbranch.MaskedBranch([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Bypassed(nn.Module):
    """A MaskedBranch whose branches the forward calls directly, as the ModuleList it replaced."""

    def __init__(self) -> None:
        super().__init__()
        self.choices = maskedbranch.MaskedBranch([nn.Linear(4, 4) for _ in range(2)])

    def forward(self, x: torch.Tensor, choice: int) -> torch.Tensor:
        return self.choices[choice](x)


class PartlyCalled(Supernet):
    """Calls its MaskedBranch only when the choice is not negative."""

    def forward(self, x: torch.Tensor, choice: int) -> torch.Tensor:
        return super().forward(x, choice) if choice >= 0 else self.stem(x)


class Nested(nn.Module):
    """A Supernet (a MaskedBranch inside) as branch 1 of a MaskedBranch that always runs branch 0."""

    def __init__(self) -> None:
        super().__init__()
        self.outer = maskedbranch.MaskedBranch([nn.Linear(4, 4), Supernet()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(x, 0)


class ResidualStack(nn.Module):
    """LayerDrop with ResidualDropPath (whole batch dropped or kept, if/else gradient semantics)."""

    def __init__(self, depth: int, drop_prob: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            maskedbranch.ResidualDropPath(nn.Linear(4, 4), drop_prob, mode="batch", materialize_grads=None)
            for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Experts(nn.Module):
    """A mixture of four Linear experts with a router, in one of three forms: ``"functional"``
    (``maskedbranch.masked_branch`` over the experts: units of no module), ``"module"``
    (``maskedbranch.MaskedBranch``) or ``"plain"`` (a Python loop that calls the experts whose
    rows the router picked, as Hugging Face's MoE layers do). Tokens ``[..., d]`` are routed per
    row (per token) to their top ``k`` experts, weighted by the router's probabilities. The router
    reads the first four features scaled up: a row ``e_i`` (a one-hot row) goes to expert i."""

    def __init__(self, form: str = "functional", k: int = 1, d: int = 4, n: int = 4) -> None:
        super().__init__()
        self.form, self.k = form, k
        self.router = nn.Linear(d, n, bias=False)
        with torch.no_grad():
            self.router.weight.copy_(10 * torch.eye(n, d))
        layers = [nn.Linear(d, d) for _ in range(n)]
        self.experts = maskedbranch.MaskedBranch(layers) if form == "module" else nn.ModuleList(layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = tokens.reshape(-1, tokens.shape[-1])
        probs = self.router(rows).softmax(-1)
        top, idx = probs.topk(self.k, dim=-1)
        gate = torch.zeros_like(probs).scatter(-1, idx, top)  # [rows, experts]: nonzero at the top k
        if self.form == "functional":
            out = maskedbranch.masked_branch(list(self.experts), rows, gate)
        elif self.form == "module":
            out = self.experts(rows, gate)
        else:
            out = torch.zeros_like(rows)
            for e, expert in enumerate(self.experts):
                picked = gate[:, e].nonzero().flatten()
                if picked.numel():
                    out = out.index_add(0, picked, expert(rows[picked]) * gate[picked, e, None])
        return out.reshape(tokens.shape)


def expert_rows(rank: int) -> torch.Tensor:
    """Rank r's rows go to experts r and r + 1 (top-1): with 2 ranks, expert 3 is picked by none."""
    return torch.eye(4)[[rank, rank + 1, rank]] + 0.01


class FunctionalResidualStack(nn.Module):
    """LayerDrop with the functional ``maskedbranch.drop_add_residual`` (whole batch dropped or
    kept), with the automatic gradient policy (if/else semantics) like ResidualStack."""

    def __init__(self, depth: int, drop_prob: float) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(depth))
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = maskedbranch.drop_add_residual(x, block, self.drop_prob, self.training, mode="batch",
                                               materialize_grads=None)
        return x


def nllb_moe(routed: bool = False) -> nn.Module:
    """A tiny random Hugging Face NLLB-MoE (8 experts per sparse layer, routed per token). As HF
    writes it, its experts are called by a Python loop over the experts the router hit; with
    ``routed=True`` each layer's experts go through ``maskedbranch.masked_branch`` instead (the
    router's top-2 probabilities as the gate)."""
    import transformers
    from transformers.models.nllb_moe import modeling_nllb_moe

    class RoutedExperts(modeling_nllb_moe.NllbMoeExperts):
        def forward(self, hidden_states, router_mask, router_probs):
            experts = [self[f"expert_{i}"] for i in range(self.num_experts)]
            return maskedbranch.masked_branch(experts, hidden_states, router_probs.to(hidden_states.dtype))

    config = transformers.NllbMoeConfig(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64, num_experts=8, expert_capacity=8,
        encoder_sparse_step=2, decoder_sparse_step=2, encoder_layerdrop=0.0, decoder_layerdrop=0.0, moe_token_dropout=0.0,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)
    torch.manual_seed(0)
    model = transformers.NllbMoeModel(config)
    if routed:
        for m in model.modules():
            if type(m) is modeling_nllb_moe.NllbMoeExperts:
                m.__class__ = RoutedExperts  # the same modules and state_dict keys, another forward
    return model


def nllb_moe_inputs():
    from maskedbranch.doctor import Inputs

    g = torch.Generator().manual_seed(0)
    return Inputs(input_ids=torch.randint(3, 64, (2, 5), generator=g),
                  decoder_input_ids=torch.randint(3, 64, (2, 4), generator=g))


class Broken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.view(3, 5))  # a shape bug


def _half_square(out: torch.Tensor) -> torch.Tensor:
    return (0.5 * out**2).sum()


def reference():
    """(model, [inputs per rank], loss_fn): layer1 and layer2 diverge across the 4 ranks."""
    return IfElse(), [torch.ones(r + 1, 1) for r in range(4)], _half_square


def masked_reference():
    return MaskedIfElse(), [torch.ones(r + 1, 1) for r in range(4)], _half_square


def all_used():
    """(model, inputs): a model that uses every parameter; every rank feeds the same inputs."""
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(3, 4)


def unused_head():
    """A dict with make_inputs(rank)."""
    return {"model": WithUnusedHead(), "make_inputs": lambda rank: torch.randn(rank + 1, 4)}


def layer_drop():
    return RandomLayerDrop(), (torch.randn(2, 4),)


def broken():
    return Broken(), torch.randn(2, 4)


def keyword_inputs():
    """Per-rank inputs built with maskedbranch.doctor.Inputs and a keyword argument."""
    from maskedbranch.doctor import Inputs

    return Supernet(), lambda rank: Inputs(torch.randn(2, 4), choice=rank % 4)


def not_called():
    return NotCalled(), torch.randn(2, 4)


def not_a_model():
    return 42


def functional_experts():
    """Experts routed per row by maskedbranch.masked_branch: safe, expert 3 not sampled."""
    return Experts("functional"), expert_rows


def plain_experts():
    """The same experts called by a Python loop, the same rows on every rank: no expert diverges,
    and experts 2 and 3, which no rank picked, are routing choices, not parameters to remove."""
    return Experts("plain"), expert_rows(0)
