"""What the trainer examples compare: per-step gradients and final parameters recorded by each
run (``{"grads": [{name: grad or None}, ...], "params": {name: tensor}}``)."""
import torch


def same(a, b):
    """Equal gradients (a missing one counts as zeros) in every step, and equal parameters."""
    def z(g, p):
        return torch.zeros_like(p) if g is None else g
    return all(torch.equal(z(x[n], a["params"][n]), z(y[n], a["params"][n])) for x, y in zip(a["grads"], b["grads"]) for n in x) \
        and all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
