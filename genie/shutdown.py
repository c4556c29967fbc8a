"""A clean exit after ``backward()`` on ``remote_accelerator``.

Autograd runs the backward of a non-CPU device on that device's worker thread. When a backward
ends, that thread drops the last reference to the finished graph task *after* the caller has
resumed; the task holds the caller's thread-local state, which since torch 2.13 includes a Python
object (``torch.autograd.graph._engine_run_backward`` stashes a ``contextvars`` context there), so
the drop takes the GIL. If the program reaches interpreter shutdown first (``backward()`` then exit,
on a loaded machine), the worker's GIL request ends its thread with ``pthread_exit`` inside C++
code and the process aborts: ``terminate called without an active exception`` (exit status 134)
after the program's own work succeeded.

:func:`drain_device_threads` (registered with ``atexit``, so it runs before shutdown, with the
interpreter intact) sends one empty backward through every device index's worker thread and waits
for it. A worker handles one graph task at a time and drops each before taking the next, so once
the sentinel is done, the drops that were pending have happened. The sentinel goes straight to the
engine (``run_backward``), without the stashed context, so its own drop needs no Python.

Invariant: never raises (it runs at exit); does nothing when no device index can be used.
"""

from __future__ import annotations

from typing import Any

import torch

# the sentinels' leaves stay referenced to the end: their drop must never free a Python object
_keep: list[Any] = []


def drain_device_threads() -> None:
    """Wait until the autograd worker threads of ``remote_accelerator`` have released their
    finished graph tasks (see the module docstring). Idempotent; never raises."""
    try:
        n = torch.remote_accelerator.device_count()
        engine = torch.autograd.Variable._execution_engine
        with torch.enable_grad():
            for i in range(n):
                leaf = torch.zeros((), device=f"remote_accelerator:{i}", requires_grad=True)
                grad = torch.ones((), device=leaf.device)
                _keep.append((leaf, grad))
                engine.run_backward((leaf,), (grad,), False, False, (), True, True)
    except BaseException:  # at exit, a failed drain must not mask the program's own outcome
        pass
