"""Every Python snippet of the README and the guides runs, on tiny stand-ins for the names it
takes from its surroundings (`model`, `x`, `self`, a pretrained checkpoint), and prints what the
text says it prints: comment lines right after a `print(...)` line are its expected output.

A new snippet fails here until it is given its surroundings in SETUPS, so the docs cannot drift
from the code unnoticed."""
import contextlib
import io
import pathlib
import re
import textwrap
import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

import maskedbranch as mb

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs" / "guides").glob("*.md"))


def snippets():
    """(doc, first code line, code) for every ```python block."""
    out = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for match in re.finditer(r"^( *)```python\n(.*?)^ *```", text, re.S | re.M):
            code = textwrap.dedent(match.group(2))
            first = next(line for line in code.splitlines() if line.strip())
            out.append((doc, first.strip(), code))
    return out


def expected_prints(code):
    """{index of a print line: the comment lines right after it, without '# '}."""
    lines, want = code.splitlines(), {}
    for i, line in enumerate(lines):
        if line.startswith("print("):
            block = []
            for after in lines[i + 1:]:
                if not after.startswith("#"):
                    break
                block.append(after[2:])
            if block:
                want[i] = block
    return want


@contextlib.contextmanager
def one_rank_group():
    """A real one-process gloo group for snippets that wrap a model in DDP or FSDP2."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def dynamo_config_restored():
    import torch._dynamo

    saved = {k: getattr(torch._dynamo.config, k) for k in ("capture_scalar_outputs", "capture_dynamic_output_shape_ops", "optimize_ddp")}
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(torch._dynamo.config, k, v)
        torch._dynamo.reset()


class Tagged(nn.Module):
    """A model with the keyword arguments the doctor snippets pass (`mask`, `attention_mask`)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.choices = mb.MaskedBranch([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x, mask=None, attention_mask=None):
        gate = mask if mask is not None else attention_mask
        return self.head(self.choices(self.stem(x), gate if gate is not None else 0))


def tiny_wav2vec2(monkeypatch):
    """`from_pretrained` of the checkpoint the snippets name, built from a tiny config instead
    (no download): the class, the LayerDrop keyword and the patch are the snippet's."""
    transformers = pytest.importorskip("transformers")
    from hf_tiny import AUDIO

    def from_pretrained(cls, name, **kwargs):
        assert name == "facebook/wav2vec2-base"
        return cls(transformers.Wav2Vec2Config(**dict(AUDIO, vocab_size=12, **kwargs)))

    monkeypatch.setattr(transformers.Wav2Vec2ForCTC, "from_pretrained", classmethod(from_pretrained))


def readme_doctor(monkeypatch):
    return dict(model=Tagged(), x=torch.randn(4, 8), m=torch.rand(4, 3) < 0.5, x0=torch.randn(4, 8), x1=torch.randn(4, 8),
                m1=torch.rand(4, 3) < 0.5)


def guide_doctor(monkeypatch):
    env = readme_doctor(monkeypatch)
    env["batch"] = lambda rank: torch.randn(4, 8)
    return env


def drop_path_fragment(monkeypatch):
    class Attn(nn.Module):
        def forward(self, h, mask):
            return h * mask[:, None]

    holder = types.SimpleNamespace(training=True, attn=Attn(), drop_prob=0.1)
    return dict(self=holder, x=torch.randn(8, 64), h=torch.randn(8, 64), m=torch.rand(8), nn=nn, mb=mb)  # the README's imports


def compiled_ddp(monkeypatch):
    if torch.__version__ < "2.13":
        pytest.skip("compiled autograd with DDP's Python reducer needs torch >= 2.13 (the guide says so)")
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(8, 8)
            self.choices = mb.MaskedBranch([nn.Linear(8, 8) for _ in range(2)])

        def forward(self, x):
            return self.choices(self.stem(x), 1)

    from torch.nn.parallel import DistributedDataParallel as DDP

    env = dict(net=Net(), DDP=DDP, batch=torch.randn(4, 8), torch=torch)
    env["train_step"] = lambda batch: env["model"](batch).sum().backward()  # the snippet's `model`
    return env


def fsdp2_setup(monkeypatch):
    if torch.__version__ < "2.7":
        pytest.skip("FSDP2 on CPU tensors, and sharding a ModuleList subclass, need torch >= 2.7 (the guide says so)")
    return dict(make_expert=lambda: nn.Linear(256, 256))


SETUPS = {
    # (doc, first code line): (surroundings, contexts to run it in, a check of its result)
    ("README.md", "import torch"): (None, (), lambda env: env["y"].shape == (32, 64)),
    ("README.md", "self.drop_path = mb.DropPath(0.1)                 # for timm.layers.DropPath(0.1): same draws, results, strides, repr"):
        (drop_path_fragment, (), lambda env: env["h"].shape == (8, 64) and repr(env["self"].sd) == "StochasticDepth(p=0.1, mode=batch)"),
    ("README.md", "import timm"): (lambda mp: pytest.importorskip("timm") and {}, (), lambda env: len(env["model"].stages) == 4),
    ("README.md", "from transformers import Wav2Vec2ForCTC"): (tiny_wav2vec2, (), None),
    ("README.md", "from maskedbranch.doctor import Inputs, find_divergent_parameters, find_unused_parameters"): (readme_doctor, (), None),
    ("docs/guides/amp-checkpointing.md", "from torch.utils.checkpoint import checkpoint"):
        (lambda mp: dict(block=mb.ResidualDropPath(nn.Linear(8, 8), 0.5, generator=torch.Generator().manual_seed(0)),
                         x=torch.randn(16, 8, requires_grad=True)), (), lambda env: env["y"].shape == (16, 8)),
    ("docs/guides/compile.md", "torch._dynamo.config.capture_scalar_outputs = True"): (lambda mp: dict(torch=torch), ("dynamo",), None),
    ("docs/guides/compile.md", 'model = torch.compile(model, options={"layout_optimization": False})'):
        (lambda mp: dict(model=nn.Conv2d(3, 4, 3), torch=torch), (), lambda env: callable(env["model"])),
    ("docs/guides/compile.md", 'block = mb.ResidualDropPath(mlp, 0.1, kept="fixed")  # exactly max(1, round(B * 0.9)) rows, scaled by B / kept'):
        (lambda mp: dict(mlp=nn.Linear(8, 8), mb=mb), (), lambda env: env["block"].train()(torch.randn(10, 8)).shape == (10, 8)),
    ("docs/guides/ddp.md", 'torch._dynamo.config.optimize_ddp = "python_reducer"     # read by DDP\'s constructor'):
        (compiled_ddp, ("group", "dynamo"), lambda env: all(p.grad is not None for p in env["net"].stem.parameters())),
    ("docs/guides/ddp.md", "import maskedbranch as mb"): (lambda mp: dict(model=Tagged(), torch=torch), (), lambda env: env["handle"].last_reset is None or env["handle"].last_reset >= 0),
    ("docs/guides/doctor.md", "# check.py"): (None, (), lambda env: env["factory"]()[1](2).args[0].shape == (2, 8)),
    ("docs/guides/doctor.md", "from maskedbranch.doctor import Inputs, find_divergent_parameters, find_unused_parameters"): (guide_doctor, (), None),
    ("docs/guides/fsdp2.md", "from torch import nn"):
        (fsdp2_setup, ("group",), lambda env: env["model"](torch.randn(4, 64), torch.randint(-1, 8, (4,))).shape == (4, 10)),
    ("docs/guides/timm.md", "import timm"): (lambda mp: pytest.importorskip("timm") and {}, (), None),
    ("docs/guides/torchvision.md", "import torchvision"): (lambda mp: pytest.importorskip("torchvision") and {}, (),
                                                         lambda env: len(env["report"].converted) == 18),
    ("docs/guides/transformers.md", "from torch.nn.parallel import DistributedDataParallel as DDP"): (tiny_wav2vec2, ("group",), None),
}

SNIPPETS = snippets()


def test_every_snippet_has_its_surroundings():
    found = {(doc, first) for doc, first, _ in SNIPPETS}
    assert found - set(SETUPS) == set(), "new snippets: give them their surroundings in SETUPS"
    assert set(SETUPS) - found == set(), "snippets that are gone or changed their first line"


@pytest.mark.parametrize("doc, first, code", SNIPPETS, ids=[f"{d}:{f[:40]}" for d, f, _ in SNIPPETS])
def test_snippet_runs_and_prints_what_the_text_says(doc, first, code, monkeypatch):
    setup, contexts, check = SETUPS[(doc, first)]
    env = (setup(monkeypatch) or {}) if setup else {}  # the snippet's globals (setups may close over them)
    env["__name__"] = "snippet"
    want = expected_prints(code)
    with contextlib.ExitStack() as stack:
        if "group" in contexts:
            if not dist.is_available():
                pytest.skip("torch.distributed is not available")
            stack.enter_context(one_rank_group())
        if "dynamo" in contexts:
            stack.enter_context(dynamo_config_restored())
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            torch.manual_seed(0)
            exec(compile(code, f"{doc}:{first[:30]}", "exec"), env)
        if check is not None:
            assert check(env), f"{doc}: the snippet's result is not what the text says"
    if want:
        expected = [line for lines in want.values() for line in lines]
        assert printed.getvalue().rstrip("\n").splitlines() == expected


def test_moe_router_example_equals_the_dense_mixture():
    """examples/moe_router.py (linked from the README): the routed top-2 mixture equals the dense
    sum over experts, gradients included, and its training loop runs."""
    import runpy

    example = runpy.run_path(str(ROOT / "examples" / "moe_router.py"), run_name="example")
    torch.manual_seed(0)
    model = example["MoE"](d=8, hidden=16, experts=4)
    tokens = torch.randn(2, 5, 8)
    got = model(tokens)
    rows = tokens.reshape(10, 8)
    probs = model.router(rows).softmax(-1)
    top, idx = probs.topk(2, dim=-1)
    weights = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
    want = sum(weights[:, e:e + 1] * expert(rows) for e, expert in enumerate(model.experts)).reshape(2, 5, 8)
    torch.testing.assert_close(got, want)
    params = list(model.parameters())
    g_got = torch.autograd.grad(got.square().sum(), params)
    g_want = torch.autograd.grad(want.square().sum(), params)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        example["main"]()
    losses = [float(line.split("loss ")[1].split(",")[0]) for line in printed.getvalue().splitlines()]
    assert len(losses) == 5 and losses[-1] < losses[0]


# A docstring or comment that points to docs/design.md names its section: 'docs/design.md, "Words"',
# possibly followed by a parenthesis and 'and "Another section"'.
_POINTER = re.compile(r'docs/design\.md, "([^"]+)"(?:\s*\([^)]*\))?(?:\s+and\s+"([^"]+)")?')


def _normalized(title):
    return " ".join(title.replace("`", "").split()).rstrip(".:")


def design_titles(text):
    """The titles a pointer may name: the headings (without their numbers) and the bold run-in
    titles of docs/design.md."""
    headings = re.findall(r"^#+\s+(?:\d+\.\s+)?(.+)$", text, flags=re.M)
    return [_normalized(t) for t in headings + re.findall(r"\*\*(.+?)\*\*", text)]


def names_a_section(pointer, titles):
    """A pointer names a section when it is a title or the words a title begins with."""
    return any(t == pointer or (t.startswith(pointer) and not t[len(pointer)].isalnum()) for t in titles)


def design_pointers(source):
    """The section names that ``source``'s pointers to docs/design.md give, with docstring and
    comment lines joined as they read."""
    text = " ".join(re.sub(r"^\s*(#\s?)?", "", line) for line in source.splitlines())
    return [_normalized(t) for m in _POINTER.finditer(text) for t in m.groups() if t]


def test_design_pointers_name_existing_sections():
    """The package's docstrings point to docs/design.md for the reasons behind the code instead of
    restating them; every section they name is one of its headings or bold run-in titles (a
    pointer may give the beginning of a long title)."""
    titles = design_titles((ROOT / "docs" / "design.md").read_text())
    sources = sorted((ROOT / "maskedbranch").rglob("*.py"))
    named = {(str(p.relative_to(ROOT)), t) for p in sources for t in design_pointers(p.read_text())}
    assert len(named) >= 20  # the pointers are found at all
    missing = sorted((where, t) for where, t in named if not names_a_section(t, titles))
    assert not missing, f"pointers to sections docs/design.md does not have: {missing}"


def test_design_pointer_check_sees_a_wrong_title():
    titles = design_titles("## 3. Data flow\n\n- **The compiled draw is an op.** Under ...\n")
    assert design_pointers('"""See docs/design.md, "Data flow" (compile) and\n    "The compiled draw"."""') == [
        "Data flow", "The compiled draw"]
    assert all(names_a_section(t, titles) for t in ["Data flow", "The compiled draw", "The compiled draw is an op"])
    assert not any(names_a_section(t, titles) for t in ["Data flows", "Data f", "The compiled draw i"])
