"""Counters users read in one call: ``genie.stats()``.

Counters are plain integers in one dict, bumped on the hot path without locks (the GIL makes a
single ``+=`` on a dict entry effectively atomic for our purposes; counts are diagnostics).
Native code counts in C and adds its counts to the dict when they are read (:func:`sync`): a
reader of ``_counts`` itself calls :func:`sync` first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

_counts: Counter[str] = Counter()

#: Adders of counts kept in native code (the record path, csrc/record.cpp): each adds what it
#: counted since its last call to ``_counts``.
_syncs: list[Callable[[], None]] = []


def sync() -> None:
    """Bring ``_counts`` up to date with the counts kept in native code."""
    for f in _syncs:
        f()


def bump(name: str, n: int = 1) -> None:
    _counts[name] += n


def stats() -> dict[str, int]:
    """Return a snapshot of Genie's counters.

    Keys (a counter that never moved is absent):

    - recording: ``ops_recorded``, ``factories_recorded``, ``uploads``, ``meta_cache_hits``,
      ``meta_cache_misses``;
    - materialization: ``materializations`` and ``materializations.<trigger>`` (``item``, ``cpu``,
      ``repr``, ``explicit``, ``data_dependent``, ...), ``forced_materializations`` (ops that had to
      run at once because their output shape or value depends on data), ``nodes_executed``,
      ``values_freed``;
    - engine: ``plan_cache_hits``, ``plan_cache_misses``, ``plan_cache_generic_hits`` (hits of
      a plan whose shapes differ: shapes as parameters), ``fused_hits`` (hits run from the
      column match on the executor's fused path: no tape made), ``codegen_plans`` (plans given a
      generated replay function), ``compiled_plans``, ``compiled_runs``, ``compiled_verified``,
      ``native_slices`` and ``native_instantiates`` (slices and plan matches done by
      csrc/slice.cpp; ``GENIE_NATIVE_SLICE=0`` runs the Python references);
    - passes (:mod:`genie.passes.pipeline`): ``passes_applied`` (plans given an optimized tape),
      ``passes_verified``, ``passes_rolled_back``, ``passes_rejected_slower``,
      ``passes_step_unoptimized``;
    - meaning (:mod:`genie.context`): ``phase.prefill.calls``, ``phase.decode.calls``,
      ``phase.prefill.nodes``, ``phase.decode.nodes`` (phases found on the default path);
    - remote: ``round_trips``, ``host_reads`` (scalar reads of small exact values the host
      computed from constants, no round trip: :func:`genie.executor.host_read`),
      ``bytes_sent``, ``bytes_received``, ``skeletons_sent``,
      ``frees_sent``, ``resident_tensors``, ``resident_bytes``, ``uploads_sent_now`` (large
      uploads sent at ``.to()``, from the host tensor's own memory),
      ``ops_decomposed_for_server`` (instructions outside the server's opset, sent as their
      decomposition), how the server vetted each run (:mod:`genie.remote.shape_class`):
      ``server_guarded_runs`` (interpreted under the guard), ``server_vets`` (vetted on meta,
      then replayed natively), ``server_shape_class_hits`` (admitted by a shape class's guards),
      ``server_vet_hits`` (shapes vetted before), ``server_early_replies`` (runs answered
      as soon as their values were final, while the rest of the tape ran: a training step's
      loss before its backward and update; ``GENIE_SERVER_EARLY_REPLY``),
      ``syncs_answered_here`` (``synchronize()`` calls that sent nothing: no answer since the
      last sync was early); recovery: ``replays``,
      ``replayed_requests``, ``checkpoints``, ``last_recovery_ms``; memory pressure
      (:mod:`genie.remote.residency`): ``pressure_events``, ``evictions``,
      ``evictions.<role>`` (``evictions.activation``, ...), ``evict_bytes``,
      ``evictions.spilled``, ``evictions.dropped``, ``spill_bytes``, ``restores.recompute``,
      ``restores.upload``, ``restore_bytes``;
    - index checks (:mod:`genie.index_check`): in process (``GENIE_INDEX_CHECK``)
      ``index_checks`` (index tensors reduced), ``index_check_syncs``,
      ``index_check_refusals``; through a server, the server's counts for this client's runs:
      ``server_index_checks``, ``server_index_check_syncs``, ``server_index_check_refusals``;
    - a pool of servers (:mod:`genie.remote.placement`, :mod:`genie.remote.peer`):
      ``peer_transfers`` and ``peer_bytes`` (values sent server to server, never through this
      process), ``placement.tapes``, ``placement.moved`` (tapes run off their device's server),
      ``placement.replicas`` (values copied to another server), ``placement.migrated``.

    Example:
        >>> import torch, genie
        >>> genie.reset_stats()
        >>> x = torch.ones(2, device="remote_accelerator")
        >>> genie.stats()["factories_recorded"]
        1
    """
    sync()
    return dict(sorted(_counts.items()))


def reset_stats() -> None:
    """Zero every counter."""
    sync()
    _counts.clear()
