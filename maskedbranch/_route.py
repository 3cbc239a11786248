"""The one routing path that every routing module and integration shares (docs/design.md, "Data
flow"): :func:`route`, the compiled whole-batch choice :func:`choose`, the compiled drop path
:func:`drop_rows`, and :func:`tie_unrun` for what did not run. Argument checks name the argument
and leave the caller's module untouched."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _autograd, _choice, _ops
from ._args import check_per_row_devices, route_args
from ._gate import INT_DTYPES, check_output, normalize_gate
from ._signatures import Signatures, _dead_output_signature, check_agreement, learn_signature, traced_signature
from ._structure import Branches, module_of
from ._unit import Tying

# ----------------------------------------------------------------------------------------------
# The routing path.


def _rows_of(t: Tensor, plan: _ops.Plan) -> List[Tensor]:
    """Each branch's rows of ``t`` (x or a per-row argument), each a tensor of its own."""
    if t.dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        return _autograd.gather(t, plan)
    return list(t.index_select(0, plan.rows).split(plan.counts))  # ids, masks: no gradient


def _tied(table: Branches, live_mask: int, zeros: Optional[bool]) -> Tuple[Tensor, ...]:
    """The dead branches' parameters that require grad, which a call ties into its output; none
    when ``zeros`` (the tying's ``call_ties``) is None."""
    if zeros is None or not torch.is_grad_enabled():
        return ()
    tied = table.tied(live_mask)
    if tied is None:  # a parameter or module was replaced since the table was made
        table.refresh()
        tied = table.tied(live_mask)
    return tuple(t for t in tied if t.requires_grad)


_PYTHON_REDUCER_TORCH = "2.13"  # tested on 2.13 and 2.14.1; on 2.6 the compiled backward differs from eager


def _aliases(table: Branches, x: Tensor, tying: Tying, where: str):
    """Under ``Tying.ALIASES`` (DDP's Python reducer; docs/design.md, "The Python-reducer alias
    path"): x and every branch parameter aliased by one ``_autograd.Alias`` node. Returns (x for
    the branches, {id(parameter): alias} or None, the call's own tie: None once aliased). Raises
    for a function branch with parameters, and on torch < 2.13."""
    if tying is not Tying.ALIASES or not torch.is_grad_enabled():
        return x, None, tying.call_ties
    for i, (branch, params) in enumerate(zip(table.branches, table.params)):
        if params and not module_of(branch)[1]:
            raise RuntimeError(
                f"{f'{where}[{i}]' if where == 'branches' else where}: under DDP's Python reducer (compiled autograd) a branch with parameters "
                "must be an nn.Module, so that its parameters can be reached in its forward; got "
                f"{type(branch).__name__} with parameters"
            )
    if torch.__version__ < _PYTHON_REDUCER_TORCH:
        raise RuntimeError(
            f"{where}: DDP's Python reducer (torch._dynamo.config.optimize_ddp = 'python_reducer', used with "
            f"compiled autograd) needs torch >= {_PYTHON_REDUCER_TORCH} with maskedbranch; with torch "
            f"{torch.__version__} compiled autograd through it does not train as eager. Use DDP's default "
            "reducer without compiled autograd, or a newer torch."
        )
    params = _tied(table, 0, True)
    x_in, *views = _autograd.alias(x, params)
    return x_in, {id(p): v for p, v in zip(params, views)}, None


def _run(table: Branches, i: int, aliases: Optional[Dict[int, Tensor]], h: Tensor, args, kwargs,
         carried: Optional[list] = None) -> Any:
    """Branch i on ``h``. ``carried`` (compiled calls): the branch runs on copies of its buffers,
    and (i, [(buffer, new value)]) is appended, to be written back where the branch really ran
    (a padded row must not move a dead branch's BatchNorm statistics)."""
    branch = table.branches[i]
    module, is_module = module_of(branch)
    carry = carried is not None and is_module
    if aliases is None and not carry:
        return branch(h, *args, **kwargs)
    mapping = None
    if aliases is not None:
        mapping = {n: aliases[id(p)] for n, p in module.named_parameters(remove_duplicate=False) if id(p) in aliases}
    if carry:
        y, pairs = _choice.call_carrying(module, h, args, kwargs, mapping)
        if pairs:
            carried.append((i, pairs))
    else:
        y = torch.func.functional_call(module, mapping, (h, *args), kwargs, strict=False)
    return branch.check(y, h) if module is not branch else y


def _common_dtype(ys: Sequence[Tensor], base: Optional[Tensor]) -> torch.dtype:
    dtype = ys[0].dtype
    for t in list(ys[1:]) + ([base] if base is not None else []):
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


class Call(NamedTuple):
    """A routed call's settings beside its inputs. ``tying``: the calling unit's (its
    ``call_ties`` or ``ALIASES`` apply here); ``base`` and ``scale`` as in :func:`route`;
    ``signatures``: the unit's learned output signatures; ``where``: the name in messages;
    ``reducer``: the unit's, for a forward its wrapper's hooks missed (:func:`_fallback_hook`);
    ``drawn``: the gate is a drop path's own draw (0 or -1 per row), valid by construction, so a
    compiled call pads it without the plan that checks a user's gate (each plan op and
    data-dependent size costs compile time)."""

    tying: Tying = Tying.SKIP
    base: Optional[Tensor] = None
    scale: Any = 1.0
    signatures: Optional[Signatures] = None
    where: str = "branches"
    reducer: Any = None
    drawn: bool = False


_PLAIN_CALL = Call()


def route(table: Branches, x: Tensor, gate: Any, args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None,
          call: Call = _PLAIN_CALL) -> Tuple[Tensor, Any]:
    """``base + scale * sum_i g[:, i] * branch_i(x, ...)`` with each branch fed only its rows, and
    which branches ran: a bit mask (an int) in eager mode, a bool tensor ``[N]`` under
    torch.compile. Compiled or exported, the gate is data: every branch runs on its rows, a
    zero-weighted one where it has none (:func:`_padded_plan`), so nothing needs tying."""
    kwargs = kwargs or {}
    n = len(table.branches)
    kind, gate = normalize_gate(gate, x, n)
    if args or kwargs:
        check_per_row_devices(args, kwargs, x)
    compiling = torch.compiler.is_compiling()
    if kind == "int" and compiling:
        kind, gate = "tensor", torch.full((x.shape[0],), gate, dtype=torch.int64)
    planned = None if kind == "int" else _plan(gate, n, x, call.drawn, compiling)
    k = gate if planned is None else None if compiling else _whole_batch(planned, x.shape[0])
    if k is None:
        out, ran = _routed(table, x, planned, args, kwargs, call, compiling)
    elif k >= 0:  # an int gate returns what its branch returns, as if/else does: nothing learned
        signatures = None if kind == "int" else call.signatures
        out = _one_branch(table, x, k, args, kwargs, call.tying, call.base, call.scale, call.where, signatures)
        ran = 1 << k
    else:
        out, ran = _no_branch(table, x, gate, args, kwargs, call.tying, call.base, call.signatures, call.where), 0
    return (out if compiling else _fallback_hook(out, call.tying, call.reducer)), ran


def _plan(gate: Tensor, n: int, x: Tensor, drawn: bool, compiling: bool) -> tuple:
    """(plan, the gate's weights or None, which branches have rows or None, the plan's offsets
    or None). Eager: the host knows the counts (a device gate reads back once). Compiled: the
    padded plan, whose sizes do not depend on the gate's values."""
    weights = gate if gate.dim() == 2 and gate.is_floating_point() else None
    if compiling and x.shape[0] > 0 and drawn:
        return (*_padded_plan(gate, n, None, weights, x), None)
    plan, offsets = _ops.plan_and_offsets(gate, n, device=x.device)
    if compiling and x.shape[0] > 0:
        return (*_padded_plan(gate, n, offsets, weights, x), offsets)
    return plan, weights, None, offsets


def _whole_batch(planned: tuple, batch: int) -> Optional[int]:
    """The branch that every row goes to, in order, unweighted (it runs on x itself: no gather,
    no copy), -1 when no row reaches any branch, else None."""
    plan, weights = planned[0], planned[1]
    if weights is None and batch > 0 and plan.num_entries == batch and batch in plan.counts:
        return plan.counts.index(batch)
    return -1 if plan.num_entries == 0 else None


def _routed(table: Branches, x: Tensor, planned: tuple, args, kwargs, call: Call, compiling: bool) -> Tuple[Tensor, Any]:
    """Gather each branch's rows, run the branches that have rows, combine: (out, what ran)."""
    plan, weights, ran, offsets = planned
    x_in, aliases, zeros = _aliases(table, x, call.tying, call.where)
    live, carried = _run_on_rows(table, x_in, aliases, plan, args, kwargs, call.where, compiling)
    check_agreement(table, live, x, args, kwargs, None if compiling else call.signatures, call.where)
    if compiling:
        tied: Tuple[Tensor, ...] = ()  # every branch is in the graph
        ran = offsets.diff() > 0 if ran is None else ran
        for i, pairs in carried:
            _choice.write_back(pairs, ran[i])
    else:
        ran = sum(1 << i for i in live)
        tied = _tied(table, ran, zeros)
    return _combine(live, len(table.branches), plan, weights, call, tied, zeros, x), ran


def _run_on_rows(table: Branches, x_in: Tensor, aliases, plan: _ops.Plan, args, kwargs, where: str, compiling: bool):
    """({branch: its output on its rows} for the branches that run, the buffers they carried
    out when compiled)."""
    xs = _rows_of(x_in, plan)
    routed_args, routed_kwargs = route_args(args, kwargs, x_in.shape[0], lambda t: _Parts(_rows_of(t, plan)))
    live: Dict[int, Tensor] = {}
    carried: Optional[list] = [] if compiling else None
    for i, c in enumerate(plan.counts):
        if not compiling and c == 0:
            continue
        a = tuple(v.parts[i] if isinstance(v, _Parts) else v for v in routed_args)
        kw = {k: v.parts[i] if isinstance(v, _Parts) else v for k, v in routed_kwargs.items()}
        live[i] = check_output(_run(table, i, aliases, xs[i], a, kw, carried), f"{where}[{i}]", c)
    return live, carried


def _combine(live: Dict[int, Tensor], n: int, plan: _ops.Plan, weights: Optional[Tensor], call: Call,
             tied: Tuple[Tensor, ...], zeros: Any, x: Tensor) -> Tensor:
    """``base + scale * sum_i g[:, i] * y_i`` back in row order, in the outputs' common dtype."""
    base, scale, batch = call.base, call.scale, x.shape[0]
    first = next(iter(live.values()))
    ys = [live[i] if i in live else first.new_empty((0, *first.shape[1:])) for i in range(n)]
    if len({y.dtype for y in ys} | ({base.dtype} if base is not None else set())) > 1:
        dtype = _common_dtype(ys, base)  # autocast: a low-precision branch on a float32 stream
        ys = [y.to(dtype) for y in ys]
        base = None if base is None else base.to(dtype)
    if isinstance(scale, Tensor):  # compiled drop path: the factor as a 0-d tensor
        dtype = torch.float64 if ys[0].dtype == torch.float64 else torch.float32
        scaled = scale.to(device=x.device, dtype=dtype).expand(batch, 1).contiguous()
        weights = scaled if weights is None else weights * scaled
    elif scale != 1.0:
        dtype = torch.float64 if ys[0].dtype == torch.float64 else torch.float32
        weights = torch.full((batch, 1), scale, dtype=dtype, device=x.device) if weights is None else weights * scale
    elif weights is not None and weights.device != x.device:
        weights = weights.to(x.device, non_blocking=True)
    return _autograd.combine(ys, plan, weights=weights, base=base, tied=tied, zeros=bool(zeros))


def _fallback_hook(out: Tensor, tying: Tying, reducer: Any) -> Tensor:
    """A call of a forward whose wrapper got its reducer during it (its forward hook does not run):
    the reduction of that forward starts from the backward (maskedbranch/_reducer.py)."""
    if reducer is not None and tying.call_ties is not None and getattr(reducer, "needs_first", False):
        reducer.first_forward_hook(out)
    return out


# ----------------------------------------------------------------------------------------------
# Compiled whole-batch choices: only the chosen branch computes (maskedbranch/_choice.py).


def whole_batch_gate(gate: Any, x: Tensor, n: int) -> Optional[Tuple[Tensor, Any]]:
    """Under torch.compile: a gate that sends the whole batch to one branch (an int, a 0-d
    integer tensor) as a 0-d int64 tensor checked to lie in -1..n-1, with the int itself (None
    for a tensor); None for other gates."""
    if isinstance(gate, Tensor):
        if gate.dim() != 0 or gate.dtype not in INT_DTYPES:
            return None
        return _choice.check_id(gate, n), None
    kind, k = normalize_gate(gate, x, n)  # an int: checked here (a symbolic one as well)
    return (torch.full((), k, dtype=torch.int64), k) if kind == "int" else None


def choose(owner: Any, branches: Sequence[Any], x: Tensor, gate: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any],
           tying: Tying) -> Optional[Tuple[Tensor, Tensor]]:
    """A compiled whole-batch choice of ``owner``'s ``branches`` (MaskedBranch): (output, which
    branches ran as a bool tensor [N]), or None where the routed rows run instead (other gates,
    extra arguments, DDP's Python reducer, torch.export, a form that does not apply). It takes the
    branches, not a branch table, whose construction Dynamo would trace (docs/design.md,
    "Compiled whole-batch choices run one branch, stacked or through `torch.cond`")."""
    if args or kwargs or tying is Tying.ALIASES or _exporting() or not hasattr(torch.compiler, "is_exporting"):
        return None  # (torch 2.6 cannot tell an export from a compile: the routed rows, right in both)
    n = len(branches)
    found = whole_batch_gate(gate, x, n)
    if found is None:
        return None
    g, k = found
    form = _choice.form_while_tracing(id(owner))
    if form == _choice.STACKED:
        # An int >= 0 needs no zeros for -1 (a symbolic one guards on its sign: -1 is a graph of its own).
        out = _choice.stacked(owner, branches, x, g, args, kwargs, nonnegative=k is not None and bool(k >= 0))
    elif form == _choice.CONDS:
        sig = traced_signature(owner, x)
        if sig is None:
            return None
        out = _choice.conds(branches, x, g, args, kwargs, sig[:2], sig[2])
    else:
        return None
    return out, torch.arange(n, dtype=torch.int64) == g.to("cpu")


# ----------------------------------------------------------------------------------------------
# Compiled routing: no branch ever sees zero rows.


def _as_mask(gate: Tensor, n: int) -> Tensor:
    if gate.dim() == 1:
        return gate.unsqueeze(1) == torch.arange(n, device=gate.device)  # -1 matches nothing
    return gate if gate.dtype == torch.bool else gate != 0


def _padded_plan(gate: Tensor, n: int, offsets: Optional[Tensor], weights: Optional[Tensor], x: Tensor):
    """The plan of ``gate`` plus, for each branch that got no row, one entry of weight zero on
    row 0, and the weights that go with it; and which branches really ran (a bool tensor).
    ``offsets``: those of the gate's own plan, or None (a drawn gate: the rows are counted here).
    Why no compiled branch may see zero rows: docs/design.md, "Compiled per-row routing is data,
    and every branch sees a row"."""
    live = _as_mask(gate, n)
    dead = ~live.any(0) if offsets is None else offsets.diff() == 0
    first = torch.arange(live.shape[0], device=live.device) == 0
    dummy = first.unsqueeze(1) & dead.to(live.device)  # row 0 of each dead branch (out of place: no mutation to trace)
    opmath = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = live.to(opmath) if weights is None else weights
    w = torch.where(dummy, torch.zeros((), dtype=w.dtype, device=w.device), w)
    plan, _ = _ops.plan_and_offsets(live | dummy, n, device=x.device, at_least_one=True)
    return plan, w, ~dead


def drop_rows(branch: Callable, module: Optional[Any], x: Tensor, keep: Tensor, scale: Any, args: Tuple[Any, ...],
              kwargs: Dict[str, Any], base: Optional[Tensor], where: str) -> Tuple[Tensor, Tensor]:
    """A compiled per-row drop path: what :func:`route` computes for one branch and the draw
    ``keep`` (``[B]``, 1 kept, 0 dropped), in the fewest traced steps (docs/design.md, "Data flow",
    torch.compile). ``module``: the module ``branch`` runs, if any (its buffers are carried, as in
    :func:`_run`; ``branch`` then has the residual's output check). Returns the output and whether
    the branch ran (a bool tensor ``[1]``). Not for ``Tying.ALIASES``, which takes :func:`route`."""
    batch = x.shape[0]
    live = keep != 0
    ran = live.any()
    rows = live | ((torch.arange(batch, device=live.device) == 0) & ~ran)
    plan = _ops.kept_plan(rows, x.device)
    count = plan.counts[0]
    opmath = torch.float64 if x.dtype == torch.float64 else torch.float32
    weights = keep.to(device=x.device, dtype=opmath)  # 0 for a padded row
    if isinstance(scale, Tensor):
        weights = weights * scale.to(device=x.device, dtype=opmath)
    elif scale != 1.0:
        weights = weights * scale
    h = _rows_of(x, plan)[0]
    if args or kwargs:
        args, kwargs = route_args(args, kwargs, batch, lambda t: _rows_of(t, plan)[0])
    if module is not None:
        y, pairs = _choice.call_carrying(module, h, args, kwargs)
        y = branch.check(y, h) if branch is not module else y
        _choice.write_back(pairs, ran)  # a padded row must not move a dead branch's statistics
    else:
        y = branch(h, *args, **kwargs)
    y = check_output(y, where, count)
    if base is not None and y.dtype != base.dtype:  # autocast: a low-precision branch on a float32 stream
        dtype = torch.promote_types(y.dtype, base.dtype)
        y, base = y.to(dtype), base.to(dtype)
    return _autograd.combine([y], plan, weights=weights.unsqueeze(1), base=base), ran.reshape(1)


def _exporting() -> bool:
    check = getattr(torch.compiler, "is_exporting", None)
    return bool(check is not None and check())


def record(unit: Any, ran: Any, inlined: bool = False) -> None:
    """Note in a unit's record (maskedbranch/_unit.py) which branches a call ran; ``inlined``: a
    compiled call whose graph holds the chosen branch only."""
    if _exporting():
        return  # an exported program keeps no record (a mutation it would carry)
    if isinstance(ran, Tensor):
        if torch.is_grad_enabled():
            unit.record_live(ran)
    elif torch.compiler.is_compiling():
        if torch.is_grad_enabled():
            unit.record_traced_mask(ran, inlined)  # a Python attribute written in a graph would be a guard
    else:
        unit.bits |= ran
        unit.called = True


class _Parts:
    """A per-row argument split like x, one part per branch."""

    __slots__ = ("parts",)

    def __init__(self, parts: List[Tensor]):
        self.parts = parts


def _one_branch(table, x, k, args, kwargs, tying: Tying, base, scale, where, signatures=None) -> Tensor:
    """The whole batch through branch k, on x itself, then the call's tie (a copy, when
    ``tying`` ties dead parameters per call)."""
    label = f"{where}[{k}]" if where == "branches" else where
    x_in, aliases, zeros = _aliases(table, x, tying, where)
    y = _run(table, k, aliases, x_in, args, kwargs)
    tied = _tied(table, 1 << k, zeros)
    if signatures is not None or base is not None or scale != 1.0 or tied:
        y = check_output(y, label, x.shape[0])
        if signatures is not None:
            learn_signature(table, (k,), k, y, x, args, kwargs, signatures, where)
    if base is not None:
        if y.dtype != base.dtype:
            dtype = torch.promote_types(y.dtype, base.dtype)
            base, y = base.to(dtype), y.to(dtype)
        y = torch.add(base, y, alpha=scale) if scale != 1.0 else base + y
    elif scale != 1.0:
        y = y * scale
    return _autograd.tie(y, tied, bool(zeros)) if tied else y


def _no_branch(table, x, gate, args, kwargs, tying: Tying, base, signatures, where) -> Tensor:
    """No row reaches any branch: ``base`` (or zeros shaped like the branches' output), with what
    did not run tied in (:func:`tie_unrun`): x, the gate's weights and the tensor arguments, and
    every parameter when ``tying`` ties per call."""
    if base is not None:
        out = base
    else:
        trailing, dtype = _dead_output_signature(table, signatures, x, args, kwargs, where)
        out = torch.zeros((x.shape[0], *trailing), dtype=dtype, device=x.device)
    inputs = ((x,) if base is None else ()) + (gate, *args, *kwargs.values())
    out = tie_unrun(out, tying, _tied(table, 0, tying.call_ties), inputs)
    return base.clone() if out is base else out


def tie_unrun(out: Tensor, tying: Tying, params: Sequence[Tensor] = (), inputs: Sequence[Any] = ()) -> Tensor:
    """``out`` with what a skipped computation would have used tied in, as ``tying`` says:

    * ``params``, the parameters of what did not run, by the call's own tie (``tying.call_ties``);
    * ``inputs``, the tensors it would have read (x, a gate's weights, an encoder's output),
      whenever ``tying`` ties at all (``tying.ties_inputs``): with no gradient unless zeros are
      asked for, and zeros (exact: ``out`` does not depend on them) while compiled autograd
      traces, which cannot add an undefined gradient to a tensor's other ones."""
    if not torch.is_grad_enabled() or not tying.ties_inputs:
        return out
    zeros = tying.call_ties
    params = [p for p in params if p.requires_grad] if zeros is not None else []
    inputs = [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
    input_zeros = True if zeros or tying is Tying.AT_WRAPPER_ZEROS else _autograd.ZEROS_WHEN_COMPILED
    if inputs and params and input_zeros is zeros:
        return _autograd.tie(out, params + inputs, zeros)
    if inputs:
        out = _autograd.tie(out, inputs, input_zeros)
    if params:
        out = _autograd.tie(out, params, bool(zeros))
    return out
