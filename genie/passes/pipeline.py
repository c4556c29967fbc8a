"""Passes on the real path: a cached plan's tape is rewritten once and replayed on every hit.

Call site: :func:`run` stands in for ``backends.run`` in :func:`genie.executor.run_tape` (the one
place materialization runs a tape). It returns the kept values of the *unoptimized* tape's
slots, so binding values back to nodes (``executor._bind``) is unchanged: passes never rename
or drop a slot the tape keeps (:func:`_lint` refuses a pass that does).

Per plan (:class:`~genie.plan_cache.Plan`), state on ``plan.artifacts["passes"]`` (a
:class:`Script`):

1. First tape of the plan (its miss): the configured passes (``GENIE_PASSES``,
   :func:`set_passes`) run on it, each ``fn(tape) -> (tape, PassReport)``. The result becomes an
   *edit script*: for each optimized instruction, the plan instruction it comes from (its
   *origin*: dropped instructions have none, recomputed ones share one), the slot arguments it
   reads instead, its output slots and frees; plus new inputs (folded constants). Passes see
   instructions tagged with their origin in ``uid`` (an instruction a pass adds takes the tag
   of the one it stands in for) and may rewire, drop, duplicate, and rewrite: another op,
   argument tree, constants or ``rng`` (a substitution, a fusion that drops the instructions it
   absorbs), as long as the instruction still makes its origin's outputs (same count, same
   metadata: eager verification below is what catches a wrong one). A rewritten instruction is
   kept whole in the script and its origin frozen (see 2).
2. Every tape of the plan (hits, that first tape too) is rewritten by applying the script to its
   *own* instructions, so per-step parameters (host tensors, floats, ``(seed, offset)``, the
   ints of a shape-generic hit) flow through. Instructions a hit shares with the plan map to
   shared optimized instructions; only the rebuilt ones are edited again. A decision that
   compared constants (CSE merging two instructions, a folded constant, a rewritten
   instruction's own constants) is checked against
   the step: if a step's constants differ there, that step runs unoptimized.
3. Verification, on the first run: the optimized tape runs (eager interpreter) on copies of the
   inputs while the unoptimized tape runs for real; every kept value and every input after
   the run must agree (eager is the oracle). A mismatch or an error rolls the plan back to
   unoptimized, with one warning naming the pass(es); the program has eager's values anyway.
4. Gate: the next ``GENIE_PASSES_GATE`` (default 3) runs each of both tapes alternate, timed
   (the optimized side with its per-step edit); the optimized plan stays only if its best time
   is not slower than the unoptimized one's: strictly for a plan that only removes
   instructions, allowing 5% + 10 µs of timer noise for one that also lowers the peak. A plan
   that ``recompute`` changed skips the gate (it buys memory with time by design).

Tapes without a plan (``GENIE_PLAN_CACHE=0``, empty slices) run unoptimized: there is nothing
to amortize the pass cost over nor to verify once. So do tapes when another backend than
``eager`` comes first (:func:`_not_eager`): ``compiled`` does its own CSE, DCE and fusion,
``remote`` runs on a server (verification needs local copies there).

Counters (:func:`genie.stats`): ``passes_applied`` (plans given an optimized script),
``passes_verified``, ``passes_rolled_back``, ``passes_rejected_slower``,
``passes_step_unoptimized`` (steps whose constants differ where a pass compared them).
:func:`report` lists each optimized plan: instructions, peak bytes and time before and after.

Example:
    >>> import torch, genie
    >>> from genie import passes
    >>> passes.set_passes(["cse", "dce"])
    >>> x = torch.ones(4, device="remote_accelerator")
    >>> for _ in range(3):
    ...     v = ((x * 2).exp() + (x * 2).exp()).sum().item()
    >>> [r.instrs_before - r.instrs_after for r in passes.report()][-1]
    2
    >>> passes.set_passes(None)  # back to GENIE_PASSES or the default set
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import compress
from operator import is_not, itemgetter
from typing import Any

import optree
import torch

from .. import backends, memory
from ..backends.compiled import _copy_sharing
from ..backends.eager import run_instrs
from ..config import logger
from ..graph import same_const
from ..meta import policy
from ..planner import Instr, MetaArg, PendingSlots, Slot, Tape
from ..remote import QuotaExceededError
from ..stats import bump
from . import PassReport, _close, reading_kept_uploads, written_inputs, written_roots
from .budget import _budget, memory_budget, parse_bytes

Pass = Callable[[Tape], "tuple[Tape, PassReport]"]

_registry: dict[str, Pass] = {}
DEFAULT = ("cse", "dce", "fold", "split_foreach", "recompute")
GATE_SLACK = 1.05  # the optimized plan may be this much slower than unoptimized (timer noise)
GATE_NOISE_S = 10e-6  # and this much (a 50 µs tape's timings vary by more than 5%)
# passes run for the memory budget: a plan they changed skips the speed gate (it may be slower)
MEMORY_PASSES = frozenset({"recompute", "split_foreach"})


def register_pass(name: str, fn: Pass | None = None) -> Any:
    """Register ``fn(tape) -> (tape, PassReport)`` as pass ``name`` (duplicates are refused).

    Usable as a decorator (``@register_pass("mine")``). A registered pass runs only when named
    in :func:`set_passes` or ``GENIE_PASSES``.

    Example:
        >>> from genie.passes import PassReport, register_pass, registered_passes
        >>> @register_pass("identity_doc")
        ... def identity(tape):
        ...     return tape, PassReport("identity_doc", 0)
        >>> "identity_doc" in registered_passes()
        True
    """
    _load_builtin()

    def deco(f: Pass) -> Pass:
        if name in _registry:
            raise ValueError(f"[register_pass] a pass named '{name}' is already registered "
                             f"({getattr(_registry[name], '__qualname__', _registry[name])}); "
                             "pick another name")
        _registry[name] = f
        return f

    return deco(fn) if fn is not None else deco


def registered_passes() -> list[str]:
    _load_builtin()
    return sorted(_registry)


def _parse(names: Sequence[str], where: str) -> tuple[str, ...]:
    _load_builtin()
    out = tuple(n.strip() for n in names if n.strip())
    for n in out:
        if n not in _registry:
            raise ValueError(f"[{where}] unknown pass '{n}'; known passes: "
                             f"{', '.join(sorted(_registry))}")
    return out


_config: dict[str, Any] = {"names": None, "gen": 0}


def set_passes(names: Sequence[str] | None) -> None:
    """The passes applied to each new plan, in order (``None``: the default set; ``[]``: none).

    Plans optimized under another setting are prepared again at their next run.

    Example:
        >>> from genie import passes
        >>> passes.set_passes(["cse", "dce"])
        >>> passes.active_passes()
        ('cse', 'dce')
        >>> passes.set_passes(None)
    """
    _config["names"] = None if names is None else _parse(list(names), "set_passes")
    _config["gen"] += 1


def active_passes() -> tuple[str, ...]:
    """The pass names new plans get (``GENIE_PASSES``, else :func:`set_passes`, else default)."""
    names = _config["names"]
    if names is None:
        env = os.environ.get("GENIE_PASSES")
        if env is None:
            names = DEFAULT
        elif env.strip().lower() in ("", "0", "none"):
            names = ()
        else:
            names = _parse(env.split(","), "GENIE_PASSES")
        _config["names"] = names
    return names


def set_memory_budget(budget: int | str | None) -> None:
    """Set the ``recompute`` budget (bytes, or a string such as ``"512MiB"``; None: off).

    Plans prepared before keep their schedule; :func:`genie.plan_cache.clear` re-plans them.
    """
    _budget[0] = parse_bytes(budget, "set_memory_budget") if isinstance(budget, str) else budget
    _config["gen"] += 1


def _gate_runs() -> int:
    try:
        return int(os.environ.get("GENIE_PASSES_GATE", "3"))
    except ValueError:
        raise ValueError("[GENIE_PASSES_GATE] expected a number of timed runs per side "
                         f"(0 turns the gate off), got {os.environ['GENIE_PASSES_GATE']!r}"
                         ) from None


# --- the edit script ---------------------------------------------------------------------------

class Shadow:
    """The plan an optimized tape names (``tape.plan``): its own backend artifacts (the
    generated replay of the optimized instructions); uses and key from the real plan."""

    __slots__ = ("base", "artifacts")

    def __init__(self, base: Any) -> None:
        self.base = base
        self.artifacts: dict[str, Any] = {}

    @property
    def uses(self) -> int:
        return self.base.uses

    @property
    def key(self) -> str:
        return self.base.key + ":passes"


_STEP_RNG = object()


@dataclass(frozen=True, slots=True)
class Edit:
    """How optimized instruction ``n`` is made from the step's instruction ``origin``."""

    origin: int
    reads: tuple[tuple[int, int], ...]  # (leaf position, slot read instead)
    outs: tuple[int | None, ...] | None  # new output slots (None: the origin's)
    free: tuple[int, ...]
    # a rewritten instruction (another op, other constants): the pass's op, spec and leaves as
    # they are (its origin is frozen: a step whose constants differ runs unoptimized), and its
    # rng: _STEP_RNG takes the step's (seed, offset), as the pass kept the origin's
    rewrite: tuple[Any, Any, tuple[Any, ...], Any] | None = None

    def apply(self, x: Instr) -> Instr:
        w = self.rewrite
        if w is not None:
            op, spec, leaves, rng = w
            return Instr(op, list(leaves), spec, self.outs if self.outs is not None else x.outs,
                         x.rng if rng is _STEP_RNG else rng, self.free, x.uid, x.where,
                         x.device)
        leaves = x.leaves
        if self.reads:
            leaves = list(leaves)
            for p, s in self.reads:
                leaves[p] = Slot(s)
        return Instr(x.op, leaves, x.spec, self.outs if self.outs is not None else x.outs,
                     x.rng, self.free, x.uid, x.where, x.device)


@dataclass(frozen=True, slots=True)
class PlanReport:
    """What the passes did to one plan (:func:`report`)."""

    key: str
    passes: tuple[str, ...]  # the passes that changed it, in order
    instrs_before: int
    instrs_after: int
    peak_before: int  # bytes of fresh values alive at once during a run (memory.tape_high_water)
    peak_after: int
    time_before_ms: float | None  # best gate run, unoptimized / optimized
    time_after_ms: float | None
    cost_ms: float  # running the passes and building the script, once per plan
    state: str  # "verify", "gate", "on", "rolled back", "rejected slower"

    def __str__(self) -> str:
        t = (f", {self.time_before_ms:.3f} -> {self.time_after_ms:.3f} ms"
             if self.time_before_ms is not None and self.time_after_ms is not None else "")
        return (f"plan {self.key[:8]}: {','.join(self.passes)}: {self.instrs_before} -> "
                f"{self.instrs_after} instrs, peak {self.peak_before >> 10} -> "
                f"{self.peak_after >> 10} KiB{t}; passes {self.cost_ms:.2f} ms; {self.state}")


class _Record:
    """What :func:`report` shows of a plan (kept apart from the :class:`Script`, so that the
    report does not keep an evicted plan's instructions and folded constants alive)."""

    __slots__ = ("figures", "state", "times")

    def __init__(self, figures: dict[str, Any]) -> None:
        self.figures = figures
        self.state = "verify"
        self.times: tuple[list[float], list[float]] = ([], [])  # gate: unoptimized, optimized


class Script:
    """An optimized plan: the edits, the state of its verification and gate, its figures."""

    where: str | None = None  # "remote": prepared for a server (_remote_run)
    budget: int | None = None  # remote: the budget it was prepared for

    def __init__(self, plan: Any, edits: list[Edit], consts: dict[int, torch.Tensor],
                 frozen: dict[int, list[Any]], changed_by: tuple[str, ...], memory_pass: bool,
                 before: Tape, after: Tape, cost: float) -> None:
        self.gen = _config["gen"]
        self.edits = edits
        self.origins = tuple(e.origin for e in edits)
        # nodes and slot lists of a step, in optimized order (a C-level gather per step)
        self.gather = itemgetter(*self.origins) if len(edits) > 1 else \
            (lambda xs, o=self.origins: tuple(xs[i] for i in o))
        self.by_origin: dict[int, list[int]] = {}
        for n, e in enumerate(edits):
            self.by_origin.setdefault(e.origin, []).append(n)
        self.tmpl = [e.apply(plan.instrs[e.origin]) for e in edits]
        self.consts = consts
        self.frozen = frozen  # origin -> its constant leaves as the passes compared them
        self.shadow = Shadow(plan)
        self.changed_by = changed_by
        self.memory_pass = memory_pass
        self.rec = _Record(dict(key=plan.key, passes=changed_by,
                                instrs_before=len(before.instrs), instrs_after=len(after.instrs),
                                peak_before=memory.tape_high_water(before),
                                peak_after=memory.tape_high_water(after), cost_ms=cost * 1e3))

    @property
    def state(self) -> str:
        return self.rec.state

    @state.setter
    def state(self, value: str) -> None:
        self.rec.state = value

    @property
    def times(self) -> tuple[list[float], list[float]]:
        return self.rec.times

    def apply(self, tape: Tape) -> Tape | None:
        """``tape`` (of this script's plan) with the edits applied; None when the step's
        constants differ from those a pass compared (the step then runs unoptimized)."""
        plan_instrs = tape.plan.instrs
        mine = tape.instrs
        # the compared constants first: a shape-generic step usually differs there, and is then
        # told so without editing anything
        for o, leaves in self.frozen.items():
            x = mine[o]
            if x is not plan_instrs[o] and not _same_leaves(x.leaves, leaves):
                return None
        out = list(self.tmpl)
        by = self.by_origin
        for o in compress(range(len(mine)), map(is_not, mine, plan_instrs)):
            x = mine[o]
            for n in by.get(o, ()):
                out[n] = self.edits[n].apply(x)
        inputs = tape.inputs
        if self.consts:
            inputs = {**inputs, **self.consts}
        pend = tape._slots
        gather = self.gather
        slots: Any = pend if type(pend) is dict else \
            PendingSlots(list(gather(pend.outs)), pend.inputs)
        return Tape(out, inputs, tape.outputs, tape.keep, list(gather(tape.nodes)), slots,
                    tape.index, self.shadow, tape.generic)


class _Off:
    """A plan the passes leave alone (nothing changed, or rolled back, or rejected)."""

    __slots__ = ("gen", "state", "where", "budget")

    def __init__(self, state: str = "off") -> None:
        self.gen = _config["gen"]
        self.state = state
        self.where: str | None = None  # "remote": prepared for a server (_remote_run)
        self.budget: int | None = None  # remote: the budget it was prepared for


class _Waiting(_Off):
    """A plan whose passes wait for a run that repeats its first run's shapes (:func:`_waits`)."""

    __slots__ = ()


def _waits(tape: Tape, st: Any) -> bool:
    """Whether the passes of ``tape``'s plan wait (it runs unoptimized): until the plan runs
    again with its first run's shapes (integers, metadata arguments, input shapes: a hit that is
    not shape-generic). Preparing them and verifying the first optimized run cost ~0.1 ms an
    instruction and a second run of the tape; a structure whose shapes move every call (a decode
    step, a ``generate`` with a new prompt length) would pay that for each new plan and then run
    unoptimized anyway (its script's frozen constants move), as it now does from the start. A
    memory budget's passes do not wait: a step over the budget must not run unscheduled.
    ``GENIE_PASSES_WAIT=0`` prepares them at a plan's first run (the earlier behaviour)."""
    if not _wait[0] or memory_budget() is not None:
        return False
    if type(st) is not _Waiting or st.gen != _config["gen"]:
        return True  # the plan's first run
    return tape.generic


_wait = [os.environ.get("GENIE_PASSES_WAIT", "1").strip() != "0"]


def _same_leaves(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is y:
            continue
        t = type(x)
        if t is not type(y):
            return False
        if t is Slot:
            continue
        if t is MetaArg:
            if x.meta != y.meta:
                return False
        elif isinstance(x, torch.Tensor) or not same_const(x, y):
            return False
    return True


# --- running ----------------------------------------------------------------------------------

_reports: deque[_Record] = deque(maxlen=64)
_warned: set[str] = set()


def run(tape: Tape, device: torch.device) -> tuple[dict[int, Any], Tape]:
    """Run ``tape`` (through :func:`genie.backends.run`), optimized when its plan has passes.

    Returns the values of ``tape.keep`` and the tape that ran (for memory accounting).
    """
    plan = tape.plan
    if plan is None or not active_passes():
        return backends.run(tape, device)[0], tape
    first = _not_eager()
    if first:
        if first != "remote":
            return backends.run(tape, device)[0], tape
        return _remote_run(tape, device)
    st = plan.artifacts.get("passes")
    if st is None or type(st) is _Waiting or st.gen != _config["gen"] or st.where is not None:
        if _waits(tape, st):
            if type(st) is not _Waiting or st.gen != _config["gen"]:
                plan.artifacts["passes"] = _Waiting("waiting")
            bump("passes_waiting")
            return backends.run(tape, device)[0], tape
        try:
            st = _prepare(tape)
        except Exception as e:  # a bug here must not cost the program its step
            logger.warning("genie: passes not applied to plan %s (%s: %s); it runs unoptimized",
                           plan.key[:8], type(e).__name__, e)
            st = _Off("failed")
        plan.artifacts["passes"] = st
    state = st.state
    if type(st) is _Off:
        return backends.run(tape, device)[0], tape
    t0 = time.perf_counter()
    opt = st.apply(tape)
    if opt is None:
        bump("passes_step_unoptimized")
        return backends.run(tape, device)[0], tape
    if state == "on":
        return backends.run(opt, device)[0], opt
    if state == "verify":
        return _verify_run(st, plan, tape, opt, device)
    return _gate_run(st, plan, tape, opt, device, time.perf_counter() - t0)


def settled(plan: Any, generic: bool = False) -> tuple[Any, Script | None, bool] | None:
    """How :func:`run` runs a hit of ``plan`` (the eager backend first; ``generic``: a hit whose
    shapes differ from the plan's) when it neither prepares, verifies nor times the plan's
    passes, nor applies a script that may refuse the step: ``(the plan whose artifacts hold the
    program, the script applied or None, whether the run counts as waiting:
    ``passes_waiting``)``; None when the next run must go through :func:`run`. The executor's
    fused hit path (:func:`genie.executor.run_targets`) runs only settled plans."""
    if not active_passes():
        return plan, None, False
    st = plan.artifacts.get("passes")
    if st is None or st.gen != _config["gen"] or st.where is not None:
        return None
    if type(st) is _Waiting:  # (as _waits: a generic hit keeps waiting, an exact one prepares)
        return (plan, None, True) if generic and _wait[0] and memory_budget() is None else None
    if type(st) is _Off:
        return plan, None, False
    return (st.shadow, st, False) if st.state == "on" and not generic else None


def _not_eager() -> str | None:
    """The backend other than ``eager`` that comes first and is available, if any: ``compiled``
    does its own CSE, DCE and fusion (passes would double its compilations), ``remote`` runs on
    a server (verification needs local copies: only ``recompute`` runs there,
    :func:`_remote_run`)."""
    for name in backends.backend_order():
        if name == "eager":
            return None
        if backends.get_backend(name).is_available():
            return name
    return None


#: the share of a server session's quota a recompute schedule plans for: the server also counts
#: its cached tape skeletons and a fixed cost per resident value against the quota
QUOTA_SHARE = 0.9


def _remote_run(tape: Tape, device: torch.device) -> tuple[dict[int, Any], Tape]:
    """A tape for a server: ``recompute`` alone, when configured, under the smaller of the
    memory budget and the session's quota (:data:`QUOTA_SHARE` of it), so that a step whose
    peak passes the quota recomputes activations instead of failing.

    The client's estimate of a tape's peak is a bound for the tape it holds; the server vets
    the tape it runs (decomposed to its opset: more intermediates). So a refusal of a tape the
    server vetted whole before running anything (no op whose output size depends on data)
    is answered by planning again for :data:`SHRINK` of the budget, a few times, before
    ``genie.QuotaExceededError`` says that even recomputation does not fit. Not verified
    against eager (that needs the values here); ``recompute`` only frees values and runs pure
    instructions again with their own arguments and ``(seed, offset)``, bit-equal by
    construction, as the embedded path verifies (tests/unit/test_step_tape.py,
    tests/integration/test_eviction.py)."""
    plan = tape.plan
    st = plan.artifacts.get("passes")
    if st is None or st.gen != _config["gen"] or getattr(st, "where", None) != "remote":
        st = _remote_prepare(tape, _remote_budget(tape), None)
    tries = 0
    while True:
        opt = st.apply(tape) if type(st) is Script else None
        if opt is None and type(st) is Script:
            bump("passes_step_unoptimized")
        try:
            return (backends.run(tape, device)[0], tape) if opt is None else \
                (backends.run(opt, device)[0], opt)
        except QuotaExceededError as e:
            budget = st.budget
            if budget is not None and tries < len(SHRINK) and _vetted_before_running(tape):
                st = _remote_prepare(tape, int(budget * SHRINK[tries]), st)
                tries += 1
                if type(st) is Script:
                    continue
            if type(st) is Script:
                note = (f"even with activations recomputed: the schedule's values peak at "
                        f"{st.rec.figures['peak_after']} bytes on top of what the session holds")
            elif st.state == "nothing to recompute":
                note = ("even with activations recomputed: the recompute pass found no "
                        "schedule that lowers this tape's peak enough (what the step keeps - "
                        "parameters, gradients, optimizer state - and what it needs at once "
                        "pass the quota)")
            else:
                raise
            e.args = (f"{e.args[0] if e.args else e} ({note})", *e.args[1:])
            raise


#: budgets tried again, as shares of the last one, after a server refused a recomputed tape
SHRINK = (0.8, 0.6, 0.4)


def _remote_budget(tape: Tape) -> int | None:
    quota = memory.session_quota(tape.index)
    budget = memory_budget()
    if quota is not None:
        q = int(quota * QUOTA_SHARE)
        budget = q if budget is None else min(budget, q)
    # host tensors among the inputs are uploaded with this request: resident from its start,
    # though the session does not hold them yet (a first step's weights)
    if budget is not None:
        budget -= sum(v.untyped_storage().nbytes() for v in tape.inputs.values()
                      if isinstance(v, torch.Tensor))
    return budget


def _remote_prepare(tape: Tape, budget: int | None, prev: Any) -> Script | _Off:
    """The plan's remote state for ``budget``; ``prev``: the state a refusal replaces (None:
    the plan's first tape, which is left unoptimized when it fits by the client's estimate)."""
    plan = tape.plan
    st: Script | _Off = _Off()
    if "recompute" in active_passes() and budget is not None and (
            prev is not None or
            memory.memory_allocated(tape.index) + memory.tape_high_water(tape) > budget):
        try:
            st = _prepare(tape, ("recompute",), budget)
        except Exception as e:  # as in run: a bug here must not cost the program its step
            logger.warning("genie: recompute not applied to plan %s (%s: %s)",
                           plan.key[:8], type(e).__name__, e)
        st.state = "on (unverified: remote)" if type(st) is Script else "nothing to recompute"
    st.where = "remote"
    st.budget = budget
    plan.artifacts["passes"] = st
    return st


def _vetted_before_running(tape: Tape) -> bool:
    """Whether the server vets ``tape`` whole before running any of it (no op whose output
    size depends on data), so a quota refusal means nothing ran and it may be sent again."""
    for ins in tape.instrs:
        if isinstance(ins.op, torch._ops.OpOverload) and policy(ins.op).dynamic:
            return False
    return True


def _prepare(tape: Tape, names: Sequence[str] | None = None, budget: int | None = None
             ) -> Script | _Off:
    """Run the passes (``names``, default the active ones; ``budget``: the one ``recompute``
    keeps to, default :func:`memory_budget`) on the first tape of a plan; its
    :class:`Script`, or :class:`_Off`."""
    t0 = time.perf_counter()
    _load_builtin()
    saved = _budget[0]
    if budget is not None:
        _budget[0] = budget
    try:
        return _prepare_with(tape, names if names is not None else active_passes(), t0)
    finally:
        _budget[0] = saved


def _prepare_with(tape: Tape, names: Sequence[str], t0: float) -> Script | _Off:
    n = len(tape.instrs)
    base = Tape([replace(ins, uid=str(i)) for i, ins in enumerate(tape.instrs)],
                dict(tape.inputs), list(tape.outputs), set(tape.keep), list(tape.nodes),
                dict(tape.slots), tape.index)
    cur = base
    changed: list[str] = []
    renamed: dict[int, int] = {}  # merged values (CSE): old slot -> the slot that stays
    placeholders: set[int] = set()  # zero-size new inputs standing for no value (split_foreach)
    for name in names:
        fn = _registry[name]
        try:
            new, rep = fn(cur)
            new = _realign(new, tape.nodes, n)
            _lint(base, new)
        except Exception as e:  # a pass that fails or breaks the contract: skip it, say so
            if name not in _warned:
                _warned.add(name)
                logger.warning("genie: pass '%s' skipped on a plan: %s: %s", name,
                               type(e).__name__, e)
            continue
        if not _same_program(cur, new):
            changed.append(name)
            cur = new
            renamed.update(getattr(rep, "renamed", None) or {})
            placeholders.update(getattr(rep, "placeholders", None) or ())
    if not changed:
        return _Off()
    edits, frozen = _diff(base, cur, renamed, placeholders)
    consts = {s: v for s, v in cur.inputs.items() if s not in base.inputs}
    for o in frozen:
        frozen[o] = list(tape.instrs[o].leaves)
    st = Script(tape.plan, edits, consts, frozen, tuple(changed),
                not MEMORY_PASSES.isdisjoint(changed),
                base, cur, time.perf_counter() - t0)
    bump("passes_applied")
    _reports.append(st.rec)
    return st


def _realign(t: Tape, nodes: list[Any], n: int) -> Tape:
    """``t`` with ``nodes`` aligned with its instructions (through the origin tags in ``uid``)."""
    try:
        origins = [int(ins.uid) for ins in t.instrs]
    except ValueError:
        raise ValueError("an instruction lost its origin tag (Instr.uid): a pass must derive "
                         "instructions from the tape's own (dataclasses.replace)") from None
    if any(not 0 <= o < n for o in origins):
        raise ValueError("an instruction's origin tag (Instr.uid) is out of range")
    return replace(t, nodes=[nodes[o] for o in origins], _slots=dict(t.slots))


def _lint(base: Tape, t: Tape) -> None:
    """Refuse a rewritten tape an edit script cannot express or the executor cannot bind."""
    if list(t.outputs) != list(base.outputs) or set(t.keep) != set(base.keep):
        raise ValueError("it changed the tape's outputs or kept slots (values the program "
                         "holds must come back under their slots)")
    for s, v in base.inputs.items():
        if t.inputs.get(s) is not v:
            raise ValueError(f"it changed or dropped input %{s}")
    defined = set(t.inputs)
    for ins in t.instrs:
        o = base.instrs[int(ins.uid)]
        if ins.device != o.device or len(ins.outs) != len(o.outs):
            raise ValueError(f"instruction {ins.uid} ({o.op}) now has {len(ins.outs)} outputs "
                             f"on device {ins.device}, its origin {len(o.outs)} on device "
                             f"{o.device}: an instruction stands for its origin's values (a "
                             "rewrite may change the op and its arguments, not what it makes)")
        if rewritten(ins, o):
            if not isinstance(ins.op, torch._ops.OpOverload):
                raise ValueError(f"instruction {ins.uid} ({o.op}) was rewritten to {ins.op!r}, "
                                 "which is not an ATen overload (torch.ops.<ns>.<op>.<overload>)")
            try:
                optree.tree_unflatten(ins.spec, ins.leaves)
            except Exception as e:
                raise ValueError(f"instruction {ins.uid} rewritten to {ins.op}: its spec and "
                                 f"leaves do not fit ({e}); build both with optree.tree_flatten("
                                 "(args, kwargs), none_is_leaf=True)") from None
        for x, y in zip(ins.leaves, o.leaves, strict=True) if not rewritten(ins, o) else ():
            if type(y) is Slot and type(x) is not Slot:
                raise ValueError(f"it replaced a slot argument of {o.op} by a constant")
        for x in ins.leaves:
            if type(x) is Slot and x.id not in defined:
                raise ValueError(f"{ins.op} reads %{x.id} before any instruction makes it")
        defined.update(s for s in ins.outs if s is not None)
    missing = set(t.keep) - defined
    if missing:
        raise ValueError(f"kept slots {sorted(missing)} are no longer produced")


def rewritten(ins: Instr, o: Instr) -> bool:
    """Whether ``ins`` changed its origin ``o`` beyond the slots it reads: another op, spec,
    rng or constant argument (an op rewrite, which the edit script keeps whole)."""
    if ins.op is not o.op or ins.spec != o.spec or ins.rng != o.rng or \
            len(ins.leaves) != len(o.leaves):
        return True
    for x, y in zip(ins.leaves, o.leaves, strict=True):
        if x is not y and (type(x) is not Slot or type(y) is not Slot):
            return True
    return False


def _same_program(a: Tape, b: Tape) -> bool:
    if len(a.instrs) != len(b.instrs) or a.inputs.keys() != b.inputs.keys():
        return False
    for x, y in zip(a.instrs, b.instrs, strict=True):
        if x.uid != y.uid or x.outs != y.outs or x.op is not y.op or x.spec != y.spec or \
                x.rng != y.rng or len(x.leaves) != len(y.leaves) or \
                any(p is not q and (type(p) is not Slot or type(q) is not Slot or p.id != q.id)
                    for p, q in zip(x.leaves, y.leaves, strict=True)):
            return False
    return True


def _diff(base: Tape, opt: Tape, renamed: dict[int, int],
          placeholders: set[int] | frozenset[int] = frozenset()
          ) -> tuple[list[Edit], dict[int, list[Any]]]:
    """The edits that make ``opt`` from ``base``, and the origins whose constants a decision
    compared: both producers of each merged pair (``renamed`` of the passes' reports, and any
    reader rewired to another instruction's value), and what fold folded."""
    produced = {s: i for i, ins in enumerate(base.instrs) for s in ins.outs if s is not None}
    edits = []
    frozen: dict[int, list[Any]] = {}
    for a, b in renamed.items():
        for s in (a, b):
            if s in produced:
                frozen[produced[s]] = []
    new_slots: dict[int, int] = {}  # slot of a duplicate -> its origin
    for ins in opt.instrs:
        o = int(ins.uid)
        src = base.instrs[o]
        if rewritten(ins, src):  # kept whole, for steps whose constants are the plan's
            frozen[o] = []
            outs = None if ins.outs == src.outs else ins.outs
            if outs is not None:
                for s, s0 in zip(ins.outs, src.outs, strict=True):
                    if s is not None and s != s0:
                        new_slots[s] = o
            rng = _STEP_RNG if ins.rng == src.rng else ins.rng
            edits.append(Edit(o, (), outs, tuple(ins.free),
                              (ins.op, ins.spec, tuple(ins.leaves), rng)))
            continue
        reads = []
        for p, (x, y) in enumerate(zip(ins.leaves, src.leaves, strict=True)):
            if type(y) is Slot and x.id != y.id:
                reads.append((p, x.id))
                a, b = produced.get(y.id), produced.get(x.id, new_slots.get(x.id))
                if b is None and x.id not in base.inputs:  # a new input: a folded constant
                    if a is not None and x.id not in placeholders:
                        frozen[a] = []
                elif a is not None and b is not None and a != b:
                    frozen[a] = []
                    frozen[b] = []
        outs = None if ins.outs == src.outs else ins.outs
        if outs is not None:
            for s, s0 in zip(ins.outs, src.outs, strict=True):
                if s is not None and s != s0:
                    new_slots[s] = o
        edits.append(Edit(o, tuple(reads), outs, tuple(ins.free)))
    # fold: the instructions a new input (a folded constant) was computed by are frozen
    # (walked through instructions frozen already: a CSE pair that fold then folded is frozen
    # by the merge, and the constants it was computed from, expand's sizes, by this walk)
    kept_origins = {int(ins.uid) for ins in opt.instrs}
    stack = [produced[s] for s in opt.inputs if s not in base.inputs and s in produced]
    walked: set[int] = set()
    while stack:
        i = stack.pop()
        if i in walked or i in kept_origins:
            continue
        walked.add(i)
        frozen.setdefault(i, [])
        stack.extend(produced[x.id] for x in base.instrs[i].leaves
                     if type(x) is Slot and x.id in produced)
    return edits, frozen


def _verify_run(st: Script, plan: Any, tape: Tape, opt: Tape, device: torch.device
                ) -> tuple[dict[int, Any], Tape]:
    """First run: eager's values are the program's; the optimized tape runs on copies of the
    inputs either tape may write (:func:`genie.passes.written_inputs`; the others are shared:
    neither run changes them), after the program's run, reading the uploads that run kept
    (:func:`genie.passes.reading_kept_uploads`)."""
    roots = written_roots((tape, opt))
    written = written_inputs((tape, opt), roots)
    order = sorted(s for s in opt.inputs if written is None or s in written)
    copies = dict(opt.inputs)
    copies.update(zip(order, _copy_sharing([opt.inputs[s] for s in order]), strict=True))
    kept = backends.run(tape, device)[0]
    reason = None
    try:
        got = run_instrs(reading_kept_uploads(replace(opt, inputs=copies), kept, roots), device)
    except Exception as e:
        reason = f"the optimized tape raised {type(e).__name__}: {e}"
    if reason is None:
        try:
            for s in sorted(tape.keep):
                _close(got[s], kept[s], f"kept value %{s}", 1.3e-6, 1e-5)
            for s in sorted(tape.inputs):
                if written is None or s in written:
                    _close(copies[s], tape.inputs[s], f"input %{s} after the run", 1.3e-6,
                           1e-5)
        except AssertionError as e:
            reason = str(e).removeprefix("[passes.verify] ")
    if reason is not None:
        names = ", ".join(f"'{n}'" for n in st.changed_by)
        logger.warning("genie: passes rolled back on plan %s: after pass%s %s %s; the plan runs "
                       "unoptimized (genie.passes.set_passes to change the passes)",
                       plan.key[:8], "es" if len(st.changed_by) > 1 else "", names,
                       reason[:500])
        bump("passes_rolled_back")
        st.state = "rolled back"
        plan.artifacts["passes"] = _Off("rolled back")
        return kept, tape
    bump("passes_verified")
    st.state = "on" if st.memory_pass or _gate_runs() <= 0 else "gate"
    return kept, tape


def _gate_run(st: Script, plan: Any, tape: Tape, opt: Tape, device: torch.device,
              edit_s: float = 0.0) -> tuple[dict[int, Any], Tape]:
    """Runs 2..: the optimized and the unoptimized tape alternate, timed, then one stays.

    The optimized side's time includes ``edit_s``, what applying the edit script to the step
    cost: every later hit pays it. An optimized plan that lowers the tape's peak stays unless it
    is slower beyond timer noise (``GATE_SLACK``, ``GATE_NOISE_S``); one that only removes
    instructions stays only if it is measured no slower: a fold of one instruction in a
    57-instruction training step saved ~1 µs of replay and cost ~20 µs of editing per step."""
    base_t, opt_t = st.times
    which = opt if len(opt_t) <= len(base_t) else tape
    sync = device.type == "cuda"
    if sync:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    kept = backends.run(which, device)[0]
    if sync:
        torch.cuda.synchronize(device)
    took = time.perf_counter() - t0
    if which is opt:
        opt_t.append(took + edit_s)
    else:
        base_t.append(took)
    k = _gate_runs()
    if len(opt_t) >= k and len(base_t) >= k:
        # the best of each: the first sample of each side may pay code generation
        fig = st.rec.figures
        slack = (GATE_SLACK, GATE_NOISE_S) if fig["peak_after"] < fig["peak_before"] else (1, 0)
        if min(opt_t) <= min(base_t) * slack[0] + slack[1]:
            st.state = "on"
        else:
            bump("passes_rejected_slower")
            logger.info("genie: optimized plan %s rejected: %.3f ms against %.3f ms unoptimized",
                        plan.key[:8], min(opt_t) * 1e3, min(base_t) * 1e3)
            st.state = "rejected slower"
            plan.artifacts["passes"] = _Off("rejected slower")
    return kept, which


def report() -> list[PlanReport]:
    """Per optimized plan (the 64 most recent): what the passes did and what it bought.

    Example:
        >>> from genie import passes
        >>> isinstance(passes.report(), list)
        True
    """
    out = []
    for rec in _reports:
        bt, ot = rec.times
        out.append(PlanReport(**rec.figures, time_before_ms=min(bt) * 1e3 if bt else None,
                              time_after_ms=min(ot) * 1e3 if ot else None, state=rec.state))
    return out


def format_report() -> str:
    """:func:`report` as text, one plan a line."""
    return "\n".join(str(r) for r in report()) or "no plan optimized"


def clear_reports() -> None:
    _reports.clear()


def _load_builtin() -> None:
    if "cse" in _registry:
        return
    from .cse import cse
    from .dce import dce
    from .fold import fold
    from .recompute import recompute
    from .split_foreach import split_foreach

    for name, fn in (("cse", cse), ("dce", dce), ("fold", fold), ("split_foreach", split_foreach),
                     ("recompute", recompute)):
        _registry.setdefault(name, fn)
