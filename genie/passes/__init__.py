"""Tape rewrites (seed 004): pure functions ``Tape -> (Tape, PassReport)``, checked against eager.

A pass never mutates its input tape; it returns a new one and a :class:`PassReport` saying what
it did, so every stage can be printed (``genie.format_tape``). Which ops a pass may touch comes
from schemas and tags (:func:`genie.meta.policy`): ops that write an argument, alias one, or are
random are not merged or folded (``recompute`` replays a random op with its ``(seed, offset)``).

:func:`verify` runs the original and the rewritten tape with the eager interpreter on copies of
the same inputs and compares every value the original keeps and every input it mutates: the
oracle for every pass.

On the real path, :mod:`genie.passes.pipeline` applies the configured passes (``GENIE_PASSES``,
:func:`set_passes`; default ``cse``, ``dce``, ``fold``, ``recompute``) once per cached plan and
replays the result on every hit as an edit script, verified and timed (see there).

Example:
    >>> import torch, genie
    >>> from genie.planner import build_tape
    >>> from genie.passes import optimize, verify
    >>> x = torch.ones(4, device="remote_accelerator")
    >>> y = (x * 2).exp() + (x * 2).exp()
    >>> tape = build_tape([(y._node, y._out)])
    >>> new, reports = optimize(tape)
    >>> [(r.name, r.removed) for r in reports]
    [('cse', 2), ('dce', 0)]
    >>> verify(tape, new)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import optree
import torch

from ..backends.compiled import _copy_sharing
from ..backends.eager import run_instrs
from ..device import real_device
from ..meta import policy
from ..planner import Instr, Slot, Tape

Pass = Callable[[Tape], "tuple[Tape, PassReport]"]


@dataclass(frozen=True)
class PassReport:
    """What one pass did: instructions removed, slots renamed (old -> surviving slot), and new
    inputs that are zero-size placeholders (they stand for no value: reading one in place of a
    tape value freezes nothing, unlike a folded constant)."""

    name: str
    removed: int
    renamed: dict[int, int] = field(default_factory=dict)
    placeholders: frozenset[int] = frozenset()

    def __str__(self) -> str:
        return f"{self.name}: removed {self.removed} instruction(s)"


def optimize(tape: Tape, passes: Sequence[Pass] | None = None) -> tuple[Tape, list[PassReport]]:
    """Apply ``passes`` (default: CSE, then DCE) in order; returns the tape and the reports."""
    from .cse import cse
    from .dce import dce

    reports = []
    for p in passes if passes is not None else (cse, dce):
        tape, r = p(tape)
        reports.append(r)
    return tape, reports


def rebuild(tape: Tape, instrs: list[Instr], renamed: dict[int, int]) -> Tape:
    """A new tape with ``instrs``, slot renames applied to outputs/keep/slots, frees recomputed."""
    outputs = [renamed.get(s, s) for s in tape.outputs]
    keep = {renamed.get(s, s) for s in tape.keep}
    last: dict[int, int] = {}
    for i, ins in enumerate(instrs):
        for x in ins.leaves:
            if type(x) is Slot:
                last[x.id] = i
        for s in ins.outs:
            if s is not None:
                last.setdefault(s, i)  # defined and never read: free right after
    frees: dict[int, list[int]] = {}
    for s, i in last.items():
        if s not in keep and s not in tape.inputs:
            frees.setdefault(i, []).append(s)
    instrs = [replace(ins, free=tuple(sorted(frees.get(i, ())))) for i, ins in enumerate(instrs)]
    slots = {k: renamed.get(s, s) for k, s in tape.slots.items()}
    return Tape(instrs, dict(tape.inputs), outputs, keep, list(tape.nodes), slots, tape.index,
                None)


def verify(before: Tape, after: Tape, device: torch.device | None = None,
           rtol: float = 1.3e-6, atol: float = 1e-5) -> None:
    """Raise ``AssertionError`` unless ``after`` computes what ``before`` does (eager, on copies).

    Compared: every slot ``before`` keeps (through renames: ``after.slots`` maps the same nodes)
    and every input value after the run (in-place updates). Both run on ``device``, by default
    the real device of the tape's ``remote_accelerator`` index (where its inputs live).
    """
    dev = device or real_device(before.index or 0)
    rename = {s: after.slots.get(k, s) for k, s in before.slots.items()}
    written = written_inputs((before, after))
    ins = sorted(s for s in before.inputs if written is None or s in written)
    runs = []
    for t in (before, after):
        copies = {s: t.inputs[s] for s in before.inputs if s not in ins and s in t.inputs}
        copies.update(zip(ins, _copy_sharing([t.inputs[s] for s in ins]), strict=True))
        # the rewritten tape's own new inputs (folded constants, placeholders) as they are
        extra = {s: v for s, v in t.inputs.items() if s not in copies}
        kept = run_instrs(replace(t, inputs={**copies, **extra}), dev)
        runs.append((kept, copies))
    (k0, in0), (k1, in1) = runs
    for s in before.keep:
        _close(k1[rename.get(s, s)], k0[s], f"kept value %{s}", rtol, atol)
    for s in ins:
        _close(in1[s], in0[s], f"input %{s} after the run", rtol, atol)


UPLOAD = "genie.upload"


def written_inputs(tapes: Sequence[Tape], roots: set[int] | None | bool = False
                   ) -> set[int] | None:
    """Input slots of ``tapes`` whose memory one of their instructions may write, directly or
    through a view (schema alias annotations, :func:`genie.meta.policy`), and every input that
    shares a storage with one of those; None when an instruction's effect is not known (then
    every input counts). What a verification must copy and compare: an input nothing writes is
    the same before and after both runs (a GPT-2 decode step's first run copied and compared its
    340 MB of weights: 3 s of its 3.4 s)."""
    if roots is False:
        roots = written_roots(tapes)
    if roots is None:
        return None
    out: set[int] = set()
    for tape in tapes:
        keys = {_storage_key(tape.inputs[s]) for s in roots if s in tape.inputs}
        out |= {s for s, v in tape.inputs.items() if _storage_key(v) in keys}
    return out


def written_roots(tapes: Sequence[Tape]) -> set[int] | None:
    """The inputs and upload outputs of ``tapes`` (by slot) that one of their instructions may
    write, directly or through a view; None when an instruction's effect is not known."""
    roots: set[int] = set()
    for tape in tapes:
        root = {s: s for s in tape.inputs}
        for ins in tape.instrs:
            op = ins.op
            if op == UPLOAD:  # a fresh copy of host data: a root of its own
                root.update((o, o) for o in ins.outs if o is not None)
                continue
            if not isinstance(op, torch._ops.OpOverload):
                return None
            p = policy(op)
            rets = [r for r in p.returns if r is not None]
            if not p.writes and not rets:
                continue
            args, kwargs = optree.tree_unflatten(ins.spec, ins.leaves)

            def roots_at(pos: int) -> set[int]:
                return {root[x.id] for x in optree.tree_leaves(p.arg(pos, args, kwargs),
                                                               none_is_leaf=True)
                        if type(x) is Slot and x.id in root}

            for j in p.writes:
                roots |= roots_at(j)
            if rets:
                if len(p.returns) == len(ins.outs):
                    pairs = [(o, r) for o, r in zip(ins.outs, p.returns) if r is not None]
                elif len({r[1] for r in rets}) == 1:  # unbind, split: outputs of one argument
                    pairs = [(o, rets[0]) for o in ins.outs]
                else:
                    return None
                for o, (_, pos) in pairs:
                    src = roots_at(pos)
                    if o is not None and src:
                        if len(src) > 1:
                            return None
                        root[o] = next(iter(src))
    return roots


def reading_kept_uploads(tape: Tape, kept: dict[int, Any], roots: set[int] | None) -> Tape:
    """``tape`` with each upload whose value ``kept`` holds (the program's own run of the same
    plan) and that no instruction writes (``roots``: :func:`written_roots`) read from that value
    instead of copied from the host again: a model's first run uploads its weights, and its
    verification ran the uploads twice (340 MB more for a 12x768 GPT-2)."""
    if roots is None:
        return tape
    instrs: list[Instr] = []
    inputs: dict[int, Any] | None = None
    for ins in tape.instrs:
        o = ins.outs[0] if len(ins.outs) == 1 else None
        if ins.op == UPLOAD and o is not None and not ins.free and o in kept and \
                o not in roots:
            if inputs is None:
                inputs = dict(tape.inputs)
            inputs[o] = kept[o]
            continue
        instrs.append(ins)
    # no plan: a backend must not keep what it builds for this shorter tape as the plan's (the
    # native replay's program of a plan has the plan's length)
    return tape if inputs is None else replace(tape, instrs=instrs, inputs=inputs, plan=None)


def _storage_key(v: Any) -> Any:
    if not isinstance(v, torch.Tensor):
        return ("object", id(v))
    return (str(v.device), v.untyped_storage().data_ptr())


def _close(got: Any, want: Any, what: str, rtol: float, atol: float) -> None:
    if got is want:
        return
    if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and \
            got.dtype == want.dtype and got.shape == want.shape and \
            got.stride() == want.stride() and torch.equal(got, want):
        return  # the common case, at memory speed (assert_close's isclose: ~30 ns an element)
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    except AssertionError as e:
        raise AssertionError(f"[passes.verify] the rewritten tape differs in {what}: {e}") from None


from .pipeline import (PlanReport, active_passes, clear_reports, format_report,  # noqa: E402
                       memory_budget, register_pass, registered_passes, report,
                       set_memory_budget, set_passes)

__all__ = ["Pass", "PassReport", "PlanReport", "active_passes", "clear_reports", "format_report",
           "memory_budget", "optimize", "rebuild", "register_pass", "registered_passes",
           "report", "set_memory_budget", "set_passes", "verify"]
