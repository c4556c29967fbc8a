"""Typed errors raised by Genie.

Every error names its subject (the op, the device, the backend), says what was expected and what
came, and how to fix it. Errors that eager PyTorch would raise keep eager's exception type (a shape
mismatch stays a ``RuntimeError``); the classes here are for failures that only Genie can have.
"""

from __future__ import annotations


class GenieError(RuntimeError):
    """Base class of Genie's own errors (a ``RuntimeError``, as PyTorch's device errors are)."""


class UnsupportedOpError(GenieError, NotImplementedError):
    """An operator Genie cannot record (no meta kernel, or an unsupported argument kind)."""

    def __init__(self, op: object, reason: str) -> None:
        self.op = op
        super().__init__(f"[genie] cannot record {op}: {reason}")


class DeviceError(GenieError):
    """A bad ``remote_accelerator`` device index or an unusable target device."""


class ExecutionError(GenieError):
    """An op failed while the real device ran a recorded graph.

    It is also an instance of the failing op's own builtin exception class (an index out of range
    is an ``IndexError`` here too), so ``except IndexError`` catches it where the program would
    have caught eager's; the cause is chained (``__cause__``).

    Carries the failing op and, when it was recorded, the user's source line that created the node,
    so that an error only the data can reveal (an index out of range inside ``gather``) still points
    at the line that caused it. ``index`` is the failing instruction's position in its tape, when
    one instruction failed (a server reports it back to the client, which names the op).

    ``partial`` is set by an in-process backend (the interpreter, generated code, native
    replay) that knows how far it got: ``(tape, index, values)``, the tape object that failed,
    its failing instruction (those before it ran) and the values computed so far that were
    still live, by slot. The executor binds the nodes that ran from it (an in-place write that
    ran is not run again), then clears it (so that the raised error holds no tensors).
    """

    partial: tuple | None = None

    def __new__(cls, op: object, where: str | None, cause: BaseException,
                index: int | None = None) -> ExecutionError:
        if cls is ExecutionError:
            cls = _with_cause_type(cause)
        return super().__new__(cls, op, where, cause, index)

    def __init__(self, op: object, where: str | None, cause: BaseException,
                 index: int | None = None) -> None:
        self.op = op
        self.where = where
        self.index = index
        self.__cause__ = cause  # also where it is made, not raised, from a cause (a server's reply)
        at = f" (recorded at {where})" if where else ""
        hint = "" if where else (
            " (the line that recorded it is named with GENIE_RECORD_SOURCE=1, at a cost per "
            "recorded op; docs/env.md)")
        super().__init__(f"[genie] {op}{at} failed on the device: {type(cause).__name__}: "
                         f"{cause}{hint}")


_WITH_CAUSE: dict[type, type] = {}
# The builtin classes ATen ops raise besides RuntimeError (c10's IndexError, ValueError,
# TypeError, NotImplementedError, LinAlgError is a RuntimeError). Only these are combined: a
# server's reply names its cause's class, and StopIteration or the like must not come of it.
_EAGER_TYPES = frozenset({IndexError, ValueError, TypeError, NotImplementedError, KeyError,
                          ZeroDivisionError, OverflowError, MemoryError})


def _with_cause_type(cause: BaseException) -> type:
    """The ExecutionError class that is also ``type(cause)`` when that is one of the builtin
    classes eager ops raise besides RuntimeError (``_EAGER_TYPES``), one per class; else
    ExecutionError itself (its own base is RuntimeError, which c10 errors are)."""
    base = type(cause)
    if base not in _EAGER_TYPES:
        return ExecutionError
    k = _WITH_CAUSE.get(base)
    if k is None:
        try:
            k = type("ExecutionError", (ExecutionError, base),
                     {"__module__": __name__, "__doc__": ExecutionError.__doc__})
        except TypeError:  # a base with another instance layout (OSError, ...): not combined
            k = ExecutionError
        _WITH_CAUSE[base] = k
    return k
