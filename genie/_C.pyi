"""Type stub for ``genie._C``, Genie's native remote_accelerator (PrivateUse1) runtime.

Importing the module installs the device guard, PrivateUse1 hooks, generators and the
storage-refusing allocator. The functions are private: use ``torch.remote_accelerator``.
"""

from collections.abc import Callable
from typing import Any

import torch

_max_devices: int
"""Upper bound accepted by :func:`_set_device_count` (64)."""

def _set_device_count(count: int) -> None:
    """Set how many devices exist; ValueError unless ``1 <= count <= _max_devices``.

    Call it before the first ``backward()``: the autograd engine sizes its device threads once.
    """

def _device_count() -> int:
    """Number of remote_accelerator devices (1 until set)."""

def _current_device() -> int:
    """This thread's current device index (per thread, like CUDA)."""

def _set_device(index: int) -> None:
    """Make ``index`` this thread's current device; IndexError outside ``0 .. count-1``."""

def _exchange_device(index: int) -> int:
    """Make ``index`` current and return the previous index; IndexError when out of range."""

def _default_generator(index: int) -> torch.Generator:
    """The default generator of device ``index`` (-1: current); the same object on every call."""

def _gc_untrack(*objects: object) -> None:
    """Take ``objects`` out of the cyclic garbage collector (no-op where not tracked or not GC).

    Only for objects that cannot be part of a reference cycle (see ``genie.graph.untrack_node``).
    """

def _gc_untrack_of_type(items: list[object], type: type) -> None:
    """:func:`_gc_untrack` the elements of ``items`` whose type is exactly ``type``."""

def _gc_untrack_node(node: object, leaves: object, ref_type: type) -> None:
    """Untrack a recorded node and its containers in one call (``genie.graph.untrack_node``)."""

def _release_nodes(nodes: list[object]) -> None:
    """Drop a run's bound nodes from ``nodes`` (each item becomes None, last first) without the
    frees lowering the collector's young count (``csrc/gccount.h``)."""

def _gc_retrack_below(leaves: object, ref_type: type) -> None:
    """Track again every untracked node reachable from the Refs in ``leaves``, with its
    containers, stopping at tracked nodes (``genie.graph.retrack_below``)."""

def _gc_retrack_writers(nodes: list[object], ref_type: type) -> None:
    """Track again the writer ``nodes``, everything below them (as ``_gc_retrack_below``) and
    the storages they write with their pending-write and reader lists
    (``genie.graph.retrack_writers``)."""

def _default_seq_note(index: int) -> int | None:
    """Note a node recorded in the default graph with process-wide ``index``: None where its
    position (N of its uid ``op*N``) follows from the index (``_default_seq_of``), else the
    position to store on the node (csrc/seq.cpp)."""

def _default_seq_of(index: int) -> int:
    """The position in the default graph of the node with ``index`` whose note returned None."""

def _default_seq_len() -> int:
    """How many nodes were recorded in the default graph (``len(genie.graph.DEFAULT_GRAPH)``)."""

def _gc_track(*objects: object) -> None:
    """Put ``objects`` back under the cyclic garbage collector (no-op where tracked or not GC)."""

def _bind_nodes(nodes: list[object], outs: list[tuple[int | None, ...]], kept: dict[int, object],
                prune_at: int, untrack: bool) -> int:
    """Bind a run's kept values to its nodes as ``genie.executor._bind`` does (node ``i`` takes
    the values of the slots ``outs[i]``, is marked executed, drops its arguments and
    pending-write entries, counts no consumer; storages with ``prune_at`` readers or more are
    pruned; ``untrack``: the new value lists are made off the cyclic GC). Returns how many
    pending-write entries it removed."""

def _wire_same(src: list[object], at: list[int], own: list[object], gets: list[object],
               seen: list[object], starts: list[int], part: list[object]) -> list[int]:
    """``genie.remote.protocol.encode_tape``'s loop over a plan's wire (csrc/wire.cpp): places
    into ``part`` the last call's constants of the entries whose values are the last call's;
    returns the other entries whose source is not the plan's own, in order."""

def _client_reply(parts: list[object], rid: int, into: list[object],
                  limit: int) -> tuple[dict[str, object], int] | None:
    """A steady run's reply read natively (csrc/client_run.cpp, ``Client._receive``): its header
    (less ``o``) and the bytes received, each output set as ``into[k].host``; None (nothing set)
    for anything but the plain case, which the Python path reads."""

def _client_reply_init(dtypes: dict[str, object], copy_max: int) -> None:
    """The wire dtypes by name and ``ZERO_COPY_MIN`` for :func:`_client_reply`."""

def _client_book(rows: list[tuple[int, int, int, int]], nodes: list[object],
                 inputs: dict[int, object], id0: int, client: object,
                 sized: dict[int, tuple[object, bool, int]], live: dict[int, object],
                 pending: list[object], size_of: object) -> dict[int, object] | None:
    """A steady run booked natively (csrc/client_run.cpp, ``Client._book`` of a plan's tape):
    a handle for every kept slot (``rows``: ``_kept_rows``), residency records as
    ``Residency.ran`` makes them; None (nothing changed but the ``sized`` cache) for anything
    but the plain case, which the Python path books."""

def _client_book_init(handle: type, resident: type, sized_memory: int) -> None:
    """The ``Handle`` and ``Resident`` classes and ``SIZED_MEMORY`` for :func:`_client_book`."""

def _const_delta(old: list[object], new: list[object],
                 same_const: object) -> list[object] | None:
    """``genie.remote.protocol.const_delta`` (csrc/wire.cpp): ``[pos, value, ...]`` where
    ``new`` differs from ``old``, or None."""

def _step_targets(targets: list[tuple[object, int]], opts: list[object],
                  index: int) -> list[tuple[object, int]]:
    """``targets`` followed by the pending ``(node, output)`` of each tensor the steps of the
    optimizers ``opts`` write on device ``index``, each once (``genie.executor.with_step``)."""

def _match_init(node: type, ref: type, storage: type, held_after: object,
                same_kind: object) -> None:
    """The classes and Python rules ``_match_core`` uses (genie.plan_cache calls it once)."""

def _match_core(flat: tuple, entries: list[object], klasses: list[object],
                wheres: list[str | None] | None, produced: dict[int, tuple[int, int]],
                want_out: list[int], targets: list[tuple[object, int]], generic: bool,
                pending: bool, pin: dict[int, object], entryless: object) -> object:
    """``genie.plan_cache.match``'s per-node part (``_match_core_py`` is the reference): None
    (not this plan) or ``(nodes, shaped, changed, input slots (a flat ``[node, out, slot,
    ...]`` list), inputs)``. ``flat``: ``Plan.flat``, whose last column is ``Plan.wsite`` (a plan that
    writes: where its updates are found and which pending writes each read must see)."""

def _slice_init(objects: dict[str, object]) -> None:
    """Give the native slice and instantiate the classes they read and make (``genie.planner``:
    Node, Ref, Storage, Alive, TensorMeta, MetaArg, Slot, Instr, Tape, PendingSlots;
    ``genie.plan_cache``: HostMeta). RuntimeError for an Instr whose slots differ."""

def _slice_nodes(targets: list[tuple[object, int]]) -> list[object]:
    """``genie.planner.slice_nodes`` natively: the same nodes in the same order, or
    ``NotImplemented`` for a graph it does not handle (the caller runs the Python loop)."""

def _instantiate(plan: object, targets: list[tuple[object, int]], nodes: list[object],
                 generic: bool) -> object:
    """``genie.plan_cache.instantiate`` natively: the same Tape (its slots as a PendingSlots) or
    None, the same floats added to ``plan.floats``; ``NotImplemented`` for what it does not
    handle (the caller runs the Python function)."""

def _rebuild_instrs(instrs: list[object], found: list[object], tmpl: list[object],
                    indices: list[int], shaped: bool) -> object:
    """``instrs[i]`` rebuilt from node ``found[i]`` and template ``tmpl[i]`` for each ``i`` of
    ``indices`` (``genie.plan_cache._rebuild``), in place: None, or ``NotImplemented`` with
    nothing written where a type is not the expected one."""

_record_native: bool
_native_detach: bool  # csrc/python_key.cpp: C++ detaches of LazyTensors recorded natively
"""Whether this build has the native record path (every build since it records on torch 2.11 too)."""

_record_wrap: str
"""How the native record path makes output wrappers: ``"native"`` (``THPVariable_Wrap`` with the
LazyTensor type, torch 2.13 or newer) or ``"python"`` (``torch.Tensor._make_wrapper_subclass``:
older torch, or a build with ``GENIE_WRAP_VIA_PYTHON=1``)."""

def _find_torch_dispatch_rule(op: object, torch_dispatch_class: type) -> object | None:
    """``torch._library.simple_registry.find_torch_dispatch_rule``, natively (the same lookups in
    the dict given to :func:`_set_dispatch_rule_data`; adds no empty registry entry)."""


def _set_dispatch_rule_data(data: dict[str, object]) -> None:
    """The registry dict (``simple_registry.singleton._data``) :func:`_find_torch_dispatch_rule`
    reads."""


def _record_dispatch(func: object, types: object, args: tuple = (), kwargs: dict | None = None,
                     ) -> object:
    """``LazyTensor.__torch_dispatch__`` (a staticmethod): records the common case natively
    and calls ``genie.lazy_tensor._dispatch`` for every other call."""

def _record_factory(func: object, args: tuple, kwargs: dict | None) -> object:
    """The PrivateUse1 factory kernels' body: the call recorded natively where the common case
    allows (a remote_accelerator ``device=`` with its index, a meta-cache entry), else by
    ``genie.lazy_tensor.record_factory``."""

def _record_init(objects: dict[str, object]) -> bool:
    """Give the native record path the Python classes and objects it works with
    (``genie.lazy_tensor._install_native_record``); RuntimeError for classes whose slots differ
    from the ones it writes. Returns whether this build has the path."""

def _record_config(config: object) -> None:
    """Mirror ``genie.config.config``'s ``native_record``, ``native_record_miss``,
    ``meta_cache``, ``record_source`` and ``gc_untrack`` (called on every change)."""

def _record_sync_counts() -> None:
    """Add the ops recorded natively since the last call to ``genie.stats``'s ``ops_recorded``
    and ``meta_cache_hits`` (``genie.stats.sync``)."""

def _context_init(objects: dict[str, object]) -> bool:
    """Give _ctx_push/_ctx_pop genie.context's thread-local stack (``tls``) and its ``Context``
    and ``Call`` classes; returns whether the native record path is initialized."""
def _lazy_walk(obj: object, kinds: dict[type, int], kind: object,
               atoms: frozenset[type]) -> list[object]:
    """``genie.context._lazy_tensors`` natively (csrc/walk.cpp): the tensors with a recorded
    node in ``obj``'s lists, tuples, dicts and objects' ``__dict__``, to depth 6; ``kinds``:
    what to do with each type (filled by ``kind(x)`` for a type not seen yet); values whose
    type is in ``atoms`` are not visited."""
def _ctx_push(module: object) -> tuple[object, object, object] | None:
    """genie.context._module_call's inline path: push ``module``'s context inside a module
    call and return the stack entry, or None where the Python code decides."""
def _ctx_pop(entry: object) -> None:
    """Pop the entry :func:`_ctx_push` returned if it is still on top (the outer context back)."""
def _whole_ops() -> list[str]:
    """The composite aten operators (default overloads, ``"aten::matmul"``) recorded as one node
    when autograd does not need their decomposition (csrc/whole.cpp)."""
def _whole_ops_enable(on: bool) -> None:
    """Record the whole ops as one node (True) or always as their decomposition (False)."""
def _set_sdp_runs_on_cpu(fn: Callable[[int], bool] | None) -> None:
    """fn(index): whether remote_accelerator:index's ops run on a CPU (SDPA's fused choice)."""
def _shape_rules_init(tensor_meta: type) -> None:
    """The TensorMeta class the ``_rule_*`` functions read and make (csrc/shape_rules.cpp)."""
def _rule_view(args: tuple, index: int) -> Any: ...
def _rule_expand(args: tuple, index: int) -> Any: ...
def _rule_unsqueeze(args: tuple, index: int) -> Any: ...
def _rule_transpose(args: tuple, index: int) -> Any: ...
def _rule_slice(args: tuple, index: int) -> Any: ...
def _rule_arith(args: tuple, index: int) -> Any: ...
def _rule_compare(args: tuple, index: int) -> Any: ...
def _rule_true_divide(args: tuple, index: int) -> Any: ...
def _rule_mul_scalar(args: tuple, index: int) -> Any: ...
def _rule_where(args: tuple, index: int) -> Any: ...
def _rule_unary(args: tuple, index: int) -> Any: ...
def _rule_pow_scalar(args: tuple, index: int) -> Any: ...
def _rule_softmax(args: tuple, index: int) -> Any: ...
def _rule_safe_softmax(args: tuple, index: int) -> Any: ...
def _rule_any_dim(args: tuple, index: int) -> Any: ...
def _rule_cat(args: tuple, index: int) -> Any: ...
def _rule_mm(args: tuple, index: int) -> Any: ...
def _rule_addmm(args: tuple, index: int) -> Any: ...
def _rule_bmm(args: tuple, index: int) -> Any: ...
def _rule_matmul(args: tuple, index: int) -> Any: ...
def _rule_linear(args: tuple, index: int) -> Any: ...
def _rule_clone(args: tuple, kwargs: dict, index: int) -> Any: ...
def _rule_isin(args: tuple, kwargs: dict, index: int) -> Any: ...
def _rule_flash_attention_for_cpu(args: tuple, kwargs: dict, index: int) -> Any: ...
def _rule_arange(args: tuple, kwargs: dict, index: int) -> Any:
    """The native shape rules (genie.shape_rules registers them): a TensorMeta, or None where
    the meta kernel decides; TypeError only for a call of another signature."""
def _set_storage(t: torch.Tensor, base: torch.Tensor | None = None) -> None:
    """Give the wrapper ``t`` the storage of ``base`` (an alias of its value), or a fresh storage
    of its own size at a fake address (csrc/storage.cpp)."""
def _new_storage(nbytes: int, index: int) -> torch.UntypedStorage:
    """A storage of ``nbytes`` bytes on ``remote_accelerator:index`` at a fresh fake address,
    holding no memory."""
def _grow_storage(t: torch.Tensor, nbytes: int) -> None:
    """Grow ``t``'s storage (shared with its views) to ``nbytes`` at a fresh fake address, as a
    ``resize_`` that reallocates."""
def _record_clear() -> None:
    """Forget every learned meta-cache entry (``genie.meta.MetaCache.clear``)."""

def _record_stats() -> dict[str, int]:
    """Calls by outcome: ``handled`` natively with a learned entry, ``miss_native`` natively
    with an entry new to it (from ``genie.lazy_tensor.entry_for``), ``learned`` (an entry
    learned from the Python path), and why the others took the Python path (``off``,
    ``profiler``, ``kwargs``, ``op_policy``, ``arguments``, ``devices``, ``capture``, ``unseen``,
    ``entry``); and ``entries``, the entries held, ``generic_classes``, the shape classes
    whose misses call their shape rule natively, and ``generic_made``, the entries made so
    (cumulative)."""

def _record_reset_stats() -> None:
    """Zero the counts of :func:`_record_stats`."""

def _stack_record_stats() -> tuple[int, int]:
    """(calls the Python-key kernel recorded from the IValue stack, calls it declined to the
    Python arguments' path): ``csrc/record.cpp``'s ``record_stack`` (cumulative)."""


def _install_wrapper_fields(cls: type) -> bool:
    """Give ``cls`` (``LazyTensor``) the ``_node`` and ``_out`` descriptors that read a wrapper's
    record from its impl (``csrc/wrapper.cpp``) or its instance dict, and the finalizer that
    releases an impl-held record (its node's output count down) when the wrapper goes."""

def _wrapper_counts(tensor: object) -> bool:
    """Whether ``tensor`` is one of the live holders its node's output counts: its impl's record,
    or a liveness token :class:`Alive` of its record's output in its instance dict."""

def _wrapper_in_impl(tensor: object) -> bool:
    """Whether the tensor's record is held by its impl (a wrapper of the native record path)."""

def _wrapper_release() -> None:
    """Release the records of impls destroyed without the GIL (queued by their destructor)."""

def _wrapper_drop_without_gil(tensor: object) -> int:
    """Tests only: an impl holding ``tensor``'s record destroyed with the GIL released; returns
    the records it queued for :func:`_wrapper_release`."""


class Alive:
    """The liveness token of a LazyTensor whose record is in its instance dict (``_alive``):
    output ``out`` of ``node`` counts it among its live holders while it lives
    (``csrc/wrapper.cpp``)."""

    node: object
    out: int

    def __init__(self, node: object, out: int) -> None: ...


class _ReplayProgram:
    """A tape's structure compiled for native replay (``csrc/replay.cpp``; built and run by
    ``genie.backends.native_replay``)."""

    freed: int  # values freed per run (the tape's free lists)

    def __init__(self, registers: int, keep: list[int]) -> None: ...
    def add_upload(self, out: int, device: int, frees: list[int]) -> None:
        """An upload: the step's host tensor ``leaves[0]`` copied to ``devices[device]``."""
    def add_op(self, name: str, overload: str, args: tuple, kwargs: dict, margs: tuple,
               mkwargs: dict, patches: list[tuple], outs: list[int], frees: list[int],
               device: int, rng: bool, source: object = None) -> None:
        """An op call: its argument stack built from ``args``/``kwargs`` against the schema;
        ``margs``/``mkwargs`` mark, per leaf, -1 (a constant) or its entry in ``patches``
        (``(2, leaf, True)``: a leaf whose value the template holds, not patched when a step's
        instruction is ``source``, the Instr the template was built from, kept by the program).
        ValueError/RuntimeError when it cannot be mapped."""
    def run(self, inputs: dict[int, object], instrs: list, devices: list[object]) -> object:
        """Run with the step's inputs and instructions on ``devices`` (0: the run's device).
        Returns ``{slot: value}`` of the kept slots, or ``(index, exception, live)`` of the
        instruction that raised, ``live`` the values computed before it still alive
        (``{slot: value}``). With a graph hook set, a plain run is the hook's
        (``genie.backends.cuda_graphs``)."""
    def run_plain(self, inputs: dict[int, object], instrs: list, devices: list[object]) -> object:
        """``run`` without the graph hook."""
    def set_graph_hook(self, hook: object) -> None:
        """``hook(program, inputs, instrs, devices)`` runs every plain run from now on (None:
        removed)."""
    def __len__(self) -> int: ...

def _hit_run(program: _ReplayProgram, inputs: dict[int, object], consts: dict[int, object] | None,
             tmpl: list, at: dict[int, list[int]] | None, found: list[object], stale: list[int],
             devices: list[object], outs: list[tuple[int | None, ...]], prune_at: int,
             untrack: bool, hold: int, want: list[int]) -> tuple:
    """A fused plan-cache hit (``genie.executor._run_hit``) in one call: ``program`` run on the
    step's replay source (``tmpl`` with ``found[i]`` for each ``i`` of ``stale``, at ``at[i]``
    with an edit script) and ``inputs`` (with ``consts``), math-bit keys on, grad mode off; its
    kept values bound to ``found`` as :func:`_bind_nodes` (releasing it) and, with ``hold`` >= 0,
    held as :func:`_mem_hold`. Returns ``(values of want, pending writes bound, bytes held or
    -1, kept)``, or the program's ``(index, exception, live)`` for a failing instruction
    (nothing bound)."""

def _read(targets: list[tuple[object, int]], n: int, index: int, ctx: tuple) -> list | tuple:
    """``genie.executor.run_targets``' steady read in one call (csrc/read.cpp; ``ctx``:
    ``genie.executor._READ_CTX``): the values of the first ``n`` targets, or where the Python
    path goes on: ``(0, targets, (span, key[, False]))`` no column-match hit, ``(1, targets,
    found)`` a hit not run fused, ``(2, targets, found, failure)`` a failing kernel, ``(3,
    targets, found, hit_run's answer)`` a run ``memory.after_run`` accounts."""

def _read_sync_counts(stats: object) -> None:
    """Add the counts csrc/read.cpp kept since the last call (``plan_cache_hits``,
    ``fused_hits``, ``materializations.item``, ...) to ``stats._counts`` (one of
    ``genie.stats._syncs``)."""

def _read_item_init(op: object, to_copy: object, lazy: type, tensor: type, ctx: tuple,
                    module: object) -> None:
    """Set up the steady reads of ``.item()`` and ``.cpu()`` (csrc/read.cpp's
    ``read_op_steady``, taken from the record path): ``aten._local_scalar_dense.default``,
    ``aten._to_copy.default``, ``LazyTensor``, ``torch.Tensor``, ``genie.executor._READ_CTX``
    and ``genie.lazy_tensor`` (its ``_item_of``)."""

def _state_word() -> int:
    """The global state an op's result depends on, as one int (csrc/state.cpp): part of every
    meta-cache key."""

def _state_apply(word: int) -> int:
    """Make ``word`` (a :func:`_state_word` value) the global state; returns the word before."""

def _math_bits_on() -> int:
    """Re-enable the math-bit dispatch keys (Conjugate, Negative, ZeroTensor) this thread
    excludes; returns a mask of those it re-enabled, for :func:`_math_bits_restore`."""

def _math_bits_restore(mask: int) -> None:
    """Exclude again the math-bit keys named by ``mask`` (a :func:`_math_bits_on` result)."""

def _grad_swap(enabled: bool) -> bool:
    """Set grad mode to ``enabled``; returns the mode before."""

def _state_mask(precision: bool) -> None:
    """Whether the word holds the fp32-precision and cuDNN flags (default: where CUDA is)."""

def _state_describe(word: int) -> dict[str, object]:
    """A state word's fields by name (for messages and tests)."""

def _input_key(inputs: dict[int, torch.Tensor]) -> tuple[bytes, tuple[int, ...]]:
    """A tape's inputs keyed for its shape class in one pass (csrc/session.cpp,
    ``genie.remote.shape_class.shape_params``): per input its slot, rank, dtype, conj/neg bits,
    density and aliasing as fixed-width bytes, and its sizes (plus strides, offset and storage
    bytes unless dense) as integers. TypeError for a value that is not a strided tensor."""

def _storages_grown(values: object, storages: dict[int, list[int]]) -> int:
    """Recount the storages of the tensors among ``values`` that have an entry
    ``[count, bytes]`` in ``storages`` (keyed by ``UntypedStorage._cdata``) to the bytes they
    hold now; returns the change (``genie.remote.worker.Session.refresh``)."""

def _drop_handles(store: dict[int, torch.Tensor], storages: dict[int, list[int]],
                  roles: dict[int, int], used_at: dict[int, int], ids: list[object]) -> int:
    """Drop every exact int of ``ids`` that ``store`` holds from the session's four dicts
    (an id listed twice once; other items skipped), its storage counted once less in
    ``storages``; returns the change of the bytes counted
    (``genie.remote.worker.Session.drop_many``)."""

def _held_inputs(store: dict[int, torch.Tensor], used_at: dict[int, int], ids: list[object],
                 slots: list[int], tick: int) -> dict[int, torch.Tensor] | int | None:
    """``{slot: value}`` of a run's input slots from the first ``len(slots)`` items of ``ids``
    (handle ids), each marked used at ``tick``; None when one of them is not an int (or
    ``ids`` is shorter), else the first id ``store`` does not hold; nothing is marked unless a
    dict is returned (``genie.remote.worker.Worker._held_inputs``)."""

def _put_handles(store: dict[int, torch.Tensor], storages: dict[int, list[int]],
                 used_at: dict[int, int], ids: object, values: object, tick: int,
                 max_handles: int) -> int | None:
    """Store a run's kept values under new handle ids, all or nothing, each marked used at
    ``tick`` and its storage counted once more; returns the change of the bytes counted, or
    None (nothing stored) unless ids and values are lists of one length, every id an int not
    held and not repeated, every value a strided tensor with a storage, within
    ``max_handles`` (``genie.remote.worker.Session.put_many``)."""

class _ShapeAdmit:
    """A shape class's admission held natively (csrc/worker_replay.cpp;
    ``genie.remote.shape_class.ShapeClass.native``): fixed positions, positions that share a
    symbol, the symbols' positions and signs, and the guard and bound as node lists
    (``genie.remote.shape_class.native_expr``)."""

    def __init__(self, n: int, fixed: list[int], fixed_vals: list[int], same_a: list[int],
                 same_b: list[int], reps: list[int], signs: list[int], guard: list[tuple],
                 bound: list[tuple]) -> None: ...
    def admit(self, ints: list[int] | tuple[int, ...]) -> int | None | bool:
        """The bound of a call in the class, None when it is not in it (as
        ``ShapeClass.admit``), False when the native evaluator cannot tell (an int64 overflow,
        a division by zero)."""

class _WorkerLane:
    """A session worker's steady request of one skeleton in one native call
    (csrc/worker_replay.cpp; ``genie.remote.worker.Worker._run_lane``)."""

    def __init__(self, program: _ReplayProgram, devices: list[object], instrs: list[object],
                 copy: object, consts: list[object], input_slots: list[int],
                 kinds: list[tuple[int, int, int, int]], static: bytes, instr_ints: list[int],
                 exact: list[list[object]], admit: _ShapeAdmit | None) -> None: ...
    def step(self, store: dict[int, torch.Tensor], used_at: dict[int, int], delta: object,
             tick: int, budget: int, split: int = -1, early: object = None
             ) -> dict[int, object] | tuple | int:
        """An int (> 0) when the request is not the lane's (nothing changed); else the
        program's kept values, or (instruction, exception, live values) when one failed."""
    def serve(self, sess: object, h: dict[str, object], freed: list[object], made: list[int],
              outputs: list[int], writes: bool, split: int, early: object, fd: int, t0: float,
              names: dict[object, str], limits: list[int]) -> tuple[int, object] | int | None:
        """A steady run request whole, from its header to its reply (worker.Worker._serve):
        None when it is not the lane's (nothing changed); an int when the lane passed it (its
        frees dropped); else (stage, result): 0 the Python path's after a step, 1 the kept
        values put and the reply Python's, 2 the reply written to ``fd``."""
    def remember(self, ints: list[int], peak: int) -> None: ...
    @property
    def how(self) -> int: ...
    @property
    def runs(self) -> int: ...
    @property
    def instrs(self) -> list[object]: ...
    @property
    def inputs(self) -> dict[int, torch.Tensor]: ...
    @property
    def consts(self) -> list[object]: ...
    @property
    def exact_size(self) -> int: ...

class _TensorBytes:
    """A tensor's elements as a read-only byte buffer (buffer protocol) that holds the tensor."""

    def __len__(self) -> int: ...

def _send_early(fd: int, used: int, res: list[int], pb: list[int], rid: object, st: float,
                vt: str, values: list[torch.Tensor], names: dict[torch.dtype, str]
                ) -> bool | None:
    """A run's early answer (``genie.remote.worker.Worker._answer_early``) written whole to the
    worker's channel ``fd`` as the Python path writes it: the EARLY status (``used``, ``res``,
    ``pb``), the header ``{"t": "ok", "o": metas, "vt": vt, "er": 1, "rid": rid, "st": st}``
    and each value's elements. True; None, having written nothing, when a value is not what
    :func:`_frames_of` frames or is over 1 MiB, or an argument is not of its type (``rid`` an
    exact int of int64): the caller answers by the Python path. OSError as ``sendmsg``'s."""
    ...


def _send_reply(fd: int, used: int, res: list[int], pb: list[int], rid: object, st: float,
                vt: str, values: list[torch.Tensor], names: dict[torch.dtype, str]
                ) -> bool | None:
    """A run's reply (a lane's, ``genie.remote.worker.Worker._run_lane``) written whole to the
    worker's channel ``fd`` as ``serve_session``'s Python path writes it: the REPLY status
    (``used``, ``res``, ``pb``), the header ``{"t": "ok", "o": metas, "res": res, "vt": vt,
    "rid": rid, "st": st}`` and each value's elements. True; None, having written nothing, for
    what ``_send_early`` leaves to the Python path."""
    ...


def _channel_write(fd: int, parts: list[object], block: bool) -> tuple[int, int] | None:
    """One ``genie.remote.wire.Channel`` message of ``parts`` written to ``fd`` with one
    ``sendmsg`` from the parts' own buffers: ``(bytes written, bytes of the message)``;
    ``block``: until all is written (else what the socket takes now). None, having written
    nothing, when ``parts`` is not a list of 1 to 511 flat buffers. OSError as ``sendmsg``'s."""
    ...


def _frames_of(values: object, names: dict[torch.dtype, str]
               ) -> tuple[list[list[object]], list[_TensorBytes]] | None:
    """A reply's tensors as wire frames in one pass (``genie.remote.worker._outputs``): per
    value ``[names[dtype], shape, None]`` and a buffer of its elements; None when a value is
    not a contiguous CPU tensor with elements, without conj/neg bits, of a dtype in ``names``
    (framed one by one by ``genie.remote.protocol.tensor_frame``)."""

class Node:
    """A recorded op's fields as a native struct (csrc/node.cpp): ``genie.graph.Node`` subclasses
    it with methods and properties only. An unset field raises AttributeError, as a slot did.
    Freeing a pending node (a graph dropped unread) leaves the cyclic collector's young count
    where it was, its outputs' liveness tokens given back."""

    op: Any
    # The arguments are inline (a lazy input is its producer node and output number): ``leaves``
    # makes a new list of fresh Refs on each read (None once the node ran; assign None to
    # release), ``leaf``/``n_leaves``/``refs`` read them without the list.
    leaves: list[Any] | None
    @property
    def n_leaves(self) -> int: ...
    def leaf(self, p: int, /) -> Any: ...
    def refs(self) -> list[tuple[Node, int]]: ...
    spec: Any
    metas: Any
    out_spec: Any
    _st: Any
    writes: Any
    _out: Any
    values: Any
    executed: bool
    index: int
    rng: tuple[int, int] | None
    graph: Any
    _seq: int | None
    where: str | None
    n_consumers: int
    tags: dict[str, Any] | None
    entry: Any
    ctx: Any
    _wref: Any
