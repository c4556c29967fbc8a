"""The ``eager`` backend: runs each tape instruction as the ATen op it records (the reference).

It is always available and takes every tape, so it closes every fallback chain. Instructions run
in tape order under ``no_grad`` with dispatch modes disabled (a ``genie.capture()`` block must not
re-record the execution); each value is dropped at its last use.

Random ops carry a ``(seed, offset)`` fixed at record time; each runs with the real device's
generator seeded from that pair (then restored), so values are reproducible under
``torch.manual_seed`` and independent of which values are materialized first.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from .._C import _grad_swap, _state_apply, _state_word
from ..device import real_device
from ..config import config
from ..errors import ExecutionError
from ..index_check import IndexCheck, IndexOutOfRange
from ..index_check import enabled as index_check_enabled
from ..meta import disable_modes, policy
from ..planner import MetaArg, Slot, Tape
from ..stats import bump
from . import codegen, native_replay, register_backend
from .rng import generator_for, seed_from

UPLOAD = "genie.upload"


def run_instrs(tape: Tape, dev: torch.device, states: list[int | None] | None = None
               ) -> dict[int, Any]:
    """Interpret ``tape`` on ``dev``; returns the values of the slots in ``tape.keep``.

    ``states``: per instruction, the global state word to run it under (``genie._C._state_word``;
    None: the current one), for a tape whose ops were recorded under several (genie.executor);
    the state before is restored after.
    """
    ix = IndexCheck(tape) if index_checked(dev) else None
    grad = _grad_swap(False)  # torch.no_grad(), inline: once per materialization
    before = _state_word() if states is not None else None
    try:
        with disable_modes():
            return _run_instrs(tape, dev, ix, states)
    finally:
        _grad_swap(grad)
        if before is not None:
            _state_apply(before)


def _run_instrs(tape: Tape, dev: torch.device, ix: IndexCheck | None,
                states: list[int | None] | None = None) -> dict[int, Any]:
    if ix is None and states is None:  # the replays below do not check indices nor switch states
        prog = native_replay.for_tape(tape)
        if prog is not None:  # a repeated plan: its native program (csrc/replay.cpp)
            return prog(tape, dev)
        gen = codegen.for_tape(tape)
        if gen is not None:  # a repeated plan: its generated replay function
            return gen(tape, dev)
    env: dict[int, Any] = dict(tape.inputs)
    for i, ins in enumerate(tape.instrs):
        try:
            if ix is not None:
                ix.step(i, ins, env)
            if states is not None and states[i] is not None:
                _state_apply(states[i])
            outs = run_instr(ins, env, dev if ins.device == tape.index else
                             real_device(ins.device))
        except Exception as e:
            if isinstance(e, IndexOutOfRange):
                e = e.args[0]  # eager's own exception, raised before the kernel ran
            err = ExecutionError(ins.op, ins.where, e, i)
            err.partial = (tape, i, env)  # instructions [0, i) ran (see executor.run_tape)
            raise err from e
        for s, v in zip(ins.outs, outs):
            if s is not None:
                env[s] = v
        for s in ins.free:
            del env[s]
        if ins.free:
            bump("values_freed", len(ins.free))
    return {s: env[s] for s in tape.keep}


def index_checked(dev: torch.device) -> bool:
    """Whether the interpreter checks index arguments on ``dev`` (``GENIE_INDEX_CHECK``:
    ``0``, the default, as eager does not; ``1``; ``auto``: on CUDA)."""
    s = config.index_check
    return s != "0" and index_check_enabled(s, dev)


def run_instr(ins: Any, env: dict[int, Any], dev: torch.device) -> list[Any]:
    if ins.op == UPLOAD:
        return [ins.leaves[0].to(dev, copy=dev.type == "cpu")]
    leaves = [arg(x, env, dev) for x in ins.leaves]
    if policy(ins.op).inplace_view:
        # x.t_() recorded as a new view: apply it to a fresh alias so that no other value's
        # real tensor changes its metadata.
        leaves[0] = torch.ops.aten.alias.default(leaves[0])
    args, kwargs = optree.tree_unflatten(ins.spec, leaves)
    if ins.rng is not None:
        gen = generator_for(dev)
        saved = gen.get_state()
        gen.manual_seed(seed_from(*ins.rng))
        try:
            out = ins.op(*args, **kwargs)
        finally:
            gen.set_state(saved)
    else:
        out = ins.op(*args, **kwargs)
    return optree.tree_leaves(out, none_is_leaf=True)


def arg(x: Any, env: dict[int, Any], dev: torch.device) -> Any:
    t = type(x)
    if t is Slot:
        return env[x.id]
    if t is torch.device:
        return dev if x.type == "remote_accelerator" else x
    if t is MetaArg:
        m = x.meta
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=dev)
    return x


@register_backend("eager")
class EagerBackend:
    """Runs the tape op by op on the real device: the reference every other backend matches."""

    name = "eager"
    shape_generic = True  # it runs any tape as given: shapes need not be the plan's

    def is_available(self) -> bool:
        return True

    def check(self, tape: Tape) -> str | None:
        return None

    def run(self, tape: Tape, device: torch.device) -> dict[int, Any]:
        return run_instrs(tape, device)
