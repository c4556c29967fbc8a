"""``torch.compile`` on the device: Dynamo traces ``remote_accelerator`` tensors whole, with fake
tensors, and a call of a compiled graph records one node.

How it fits PyTorch's integration points for an out-of-tree device:

- **Dynamo sees device tensors as tensors.** A LazyTensor is a ``__torch_dispatch__`` subclass,
  which Dynamo would treat as an opaque object (falling back to eager for the whole frame). Genie
  registers the LazyTensor type with Dynamo's ``VariableBuilder`` as a plain tensor: Dynamo
  fakeifies it (a ``FakeTensor`` on ``remote_accelerator:N``, metadata only), traces the frame
  with meta kernels, and installs the same guards as for a CUDA tensor (dtype, device, shape,
  strides, ``requires_grad``): a new shape recompiles (then marks the dimension dynamic), graph
  breaks split the frame as on CUDA.
- **A Dynamo device interface** for ``remote_accelerator`` (``torch._dynamo.device_interface``).
- **A backend**: ``backend="genie"``, and the default (Inductor) when a graph's inputs are on
  the device. AOTAutograd lowers the graph to Core ATen (forward and backward graphs), each becomes
  content-addressed data (:mod:`genie.graphs`), and a call records ``genie::graph`` once: a call
  costs a guard check and one record whatever the op count. The graph is compiled where the
  device is, once per shape class (Inductor for the real device), its first run checked against
  the op-by-op run. ``mode``/``options`` given to ``torch.compile`` go to that compilation.

Genie's own entry points (the dispatch hook, the factory and copy kernels, the materialization
triggers) are marked for Dynamo's frame evaluator as "skip, recursively": when a graph breaks and
an op runs eagerly, Dynamo runs them as plain Python instead of compiling Genie's internals.

Invariant: ``import genie`` does not import ``torch._dynamo`` (seconds). The hooks are installed
when ``torch._dynamo`` is already loaded, else as it is imported (:class:`_OnDynamoImport`) or by
the first ``torch.compile`` call; they act only on
LazyTensors and graphs whose inputs are on the device, so a program that never touches the device
compiles exactly as without Genie.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any

import torch

from . import context, graphs
from . import device as _device
from . import lazy_tensor as _lazy_tensor
from ._C import _graph_entry as graph_entry
from ._C import _graph_refs as graph_refs
from ._C import _record_graph as record_graph
from .config import logger
from .device import DEVICE_TYPE
from .graph import Ref, tuple_getter
from .lazy_tensor import LazyTensor
from .stats import bump

_done = False
_hooked = False


def install() -> None:
    """Mark Genie's entry points as skipped (recursively) by Dynamo's frame evaluator."""
    global _done
    if _done:
        return
    try:
        from torch._C._dynamo import eval_frame as ef
    except ImportError:  # a torch without Dynamo: nothing to steer
        return
    from . import factories, lazy_tensor

    skip = ef._FrameExecStrategy(ef._FrameAction.SKIP, ef._FrameAction.SKIP)
    lt = lazy_tensor.LazyTensor
    # __torch_dispatch__ is native (csrc/record.cpp) where the build has it: its Python code
    # starts at lazy_tensor._dispatch.
    dispatch = getattr(lt.__torch_dispatch__, "__func__", lt.__torch_dispatch__)
    fns: list[Any] = [lazy_tensor._dispatch, lt.__repr__, lt.__format__, lt.numpy,
                      lt.tolist, lt.__reduce_ex__, lt.backward, lt.data.fget, lt.data.fset,
                      lazy_tensor.record_factory, lazy_tensor.copy_from, lazy_tensor.materialize]
    if hasattr(dispatch, "__code__"):
        fns.append(dispatch)
    for fn in fns:
        ef.set_code_exec_strategy(fn.__code__, skip)
    _done = True
    if "torch._dynamo" in sys.modules:
        install_hooks()
    else:
        _hook_torch_compile()
        _hook_dynamo_import()


def _hook_torch_compile() -> None:
    """Install the Dynamo hooks at the first ``torch.compile`` call (then put it back)."""
    original = torch.compile
    if getattr(original, "_genie_hook", False):
        return

    @functools.wraps(original)
    def compile(*args: Any, **kwargs: Any) -> Any:  # noqa: A001 (torch.compile's name)
        if torch.compile is compile:
            torch.compile = original
        install_hooks()
        return original(*args, **kwargs)

    compile._genie_hook = True  # type: ignore[attr-defined]
    torch.compile = compile


class _OnDynamoImport(importlib.abc.MetaPathFinder):
    """An import hook until the Dynamo hooks are installed, as ``torch._dynamo`` is imported by
    anything other than ``torch.compile`` (``torch._dynamo.explain``, ``torch.export``,
    ``torch.compiler``'s functions). Before, ``torch._dynamo.explain(model)(x)`` on the device
    without a ``torch.compile`` call first reported no graph (``Graph Count: 0, Graph Break
    Count: -1``): Dynamo took a LazyTensor for an opaque object."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "torch._dynamo":
            return None
        # (it stays until the hooks are installed: importlib.util.find_spec("torch._dynamo")
        # finds without importing)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec  # (torch.compile's hook still installs them)
        exec_module = loader.exec_module

        def exec_then_hook(module: Any) -> None:
            exec_module(module)
            try:
                install_hooks()
            except Exception as e:  # noqa: BLE001 - the import itself succeeded
                logger.warning("genie: torch.compile on the device is not set up (%s: %s); "
                               "device tensors trace as opaque objects", type(e).__name__, e)

        loader.exec_module = exec_then_hook
        return spec


def _hook_dynamo_import() -> None:
    if not any(type(f) is _OnDynamoImport for f in sys.meta_path):
        sys.meta_path.insert(0, _OnDynamoImport())


def _unhook_dynamo_import() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if type(f) is not _OnDynamoImport]


def install_hooks() -> None:
    """Dynamo treats LazyTensors as tensors; backend ``genie``; Inductor hands graphs on the
    device to it; the device interface. Idempotent."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    _unhook_dynamo_import()
    import torch._dynamo
    from torch._dynamo.backends.registry import _BACKENDS, register_backend
    from torch._dynamo.device_interface import register_interface_for_device
    from torch._dynamo.variables.builder import VariableBuilder

    for trace_numpy in (False, True):  # the table is cached per value of config.trace_numpy
        VariableBuilder._type_dispatch_impl(trace_numpy)[LazyTensor] = _wrap_lazy
    _guards_as_on_the_cpu()
    _module_calls_as_torch()
    register_interface_for_device(DEVICE_TYPE, _device_interface())
    if "genie" not in _BACKENDS:
        register_backend(_then_reinstall(backend), "genie")
    wrapper = torch._TorchCompileInductorWrapper
    inductor_call = wrapper.__call__

    def __call__(self: Any, model_: Any, inputs_: Any, **kw: Any) -> Any:  # noqa: N807
        try:
            if on_device(inputs_):
                return backend(model_, inputs_, options=dict(self.config))
            return inductor_call(self, model_, inputs_, **kw)
        finally:
            context.reinstall()  # fx tracing put torch's Module.__call__ back

    wrapper.__call__ = __call__


def _wrap_lazy(self: Any, value: LazyTensor) -> Any:
    """``VariableBuilder.wrap_tensor`` for a LazyTensor, without the ``TYPE_MATCH`` guard Dynamo
    adds for a tensor subclass where the ``TENSOR_MATCH`` guard it installs too starts with the
    same exact-type test (see :func:`_guards_as_on_the_cpu`)."""
    from torch._dynamo.source import GradSource, is_from_optimizer_source

    src = self.get_source()
    # an optimizer's grad is guarded NOT_NONE_MATCH instead of TENSOR_MATCH: its type guard stays
    self._genie_no_type_match = not (isinstance(src, GradSource)
                                     and is_from_optimizer_source(src))
    try:
        return type(self).wrap_tensor(self, value)
    finally:
        self._genie_no_type_match = False


def _guards_as_on_the_cpu() -> None:
    """A device tensor guarded as Dynamo guards the same tensor on the CPU or CUDA.

    Two guards Dynamo adds only because a LazyTensor is a tensor subclass, and a parameter on
    the device a LazyTensor flagged ``_is_param`` (``nn.Parameter`` of a subclass), not an exact
    ``nn.Parameter``:

    - ``TYPE_MATCH`` on every device tensor, besides ``TENSOR_MATCH``, whose check starts with
      the same exact-type test (``TensorCheck``'s Python type): dropped where
      :func:`_wrap_lazy` wraps a LazyTensor (not an optimizer's grad, guarded ``NOT_NONE_MATCH``);
    - each parameter among the tensors of the ``NO_TENSOR_ALIASING`` guard: Dynamo leaves an
      exact ``nn.Parameter`` out of it (``config.skip_no_tensor_aliasing_guards_on_parameters``),
      so for GPT-2's compiled forward (transformers' ``Conv1D`` weights, not a builtin module's)
      the guard checked 47 tensors a call on the device against none on the CPU; a parameter
      is now left out as on the CPU.

    Every other value's guards are Dynamo's own."""
    from torch._dynamo import config as dynamo_config
    from torch._dynamo.guards import GuardBuilder
    from torch._dynamo.variables.builder import VariableBuilder

    install = VariableBuilder.install_guards
    if getattr(install, "_genie", False):
        return

    @functools.wraps(install)
    def install_guards(self: Any, *guards: Any) -> Any:
        if getattr(self, "_genie_no_type_match", False):
            guards = tuple(g for g in guards if g is not GuardBuilder.TYPE_MATCH)
        return install(self, *guards)

    tensor_match = GuardBuilder.TENSOR_MATCH

    @functools.wraps(tensor_match)
    def TENSOR_MATCH(self: Any, guard: Any, value: Any = None) -> None:  # noqa: N802 (Dynamo's)
        names = getattr(self, "no_tensor_aliasing_names", None)
        n = len(names) if type(names) is list else -1
        tensor_match(self, guard, value)
        if n < 0 or len(names) != n + 1 or not dynamo_config.skip_no_tensor_aliasing_guards_on_parameters:
            return
        v = value() if callable(value) else value  # (a TensorWeakRef)
        if v is None:
            v = self.get(guard)
        if type(v) is LazyTensor and getattr(v, "_is_param", False):
            del names[n:]
            del self.no_tensor_aliasing_guard_managers[n:]

    install_guards._genie = True  # type: ignore[attr-defined]
    VariableBuilder.install_guards = install_guards
    GuardBuilder.TENSOR_MATCH = TENSOR_MATCH


def _module_calls_as_torch() -> None:
    """Dynamo traces a submodule call under Genie's module wrapper as it does under torch's own
    ``nn.Module.__call__``: straight to ``forward`` where the module has no hooks.

    Dynamo takes that short cut only where ``mod.__call__.__func__`` is the ``nn.Module.__call__``
    it saw at import; with ``genie.context`` active it is Genie's wrapper
    (:data:`genie.context._installed`), so Dynamo inlined torch's ``_wrapped_call_impl`` and
    ``_call_impl`` for every submodule instead (the wrapper's class attribute reads as torch's
    function, so the graph is the same), and guarded every call on each module's and class's
    dict not holding ``__call__``, ``_call_impl``, ``_compiled_call_impl`` and on
    ``torch._C._get_tracing_state`` and the global hook dicts: GPT-2's compiled forward had 174
    more guards than on the CPU, the 6-layer MLP 57 more, and traced slower. Here the name
    Dynamo compares with is, while it traces a module call, Genie's wrapper where that is what
    ``nn.Module`` holds (torch's function otherwise: any other patch of ``nn.Module.__call__``
    is traced through, as without Genie)."""
    try:
        from torch._dynamo.variables import nn_module
        cls = nn_module.UnspecializedNNModuleVariable
        torch_call = nn_module.unpatched_nn_module_call
    except (ImportError, AttributeError):  # another torch: Dynamo's own path
        return
    call_function = cls.call_function
    if getattr(call_function, "_genie_module_call", False):
        return

    @functools.wraps(call_function)
    def traced_call(self: Any, tx: Any, args: Any, kwargs: Any) -> Any:
        cur = torch.nn.Module.__dict__.get("__call__")
        nn_module.unpatched_nn_module_call = \
            cur if cur is not None and cur is context._installed else torch_call
        return call_function(self, tx, args, kwargs)

    traced_call._genie_module_call = True  # type: ignore[attr-defined]
    cls.call_function = traced_call


def _then_reinstall(fn: Any) -> Any:
    """``fn`` (a Dynamo backend), then Genie's module call put back (fx tracing inside the
    backend restores torch's ``nn.Module.__call__``: :func:`genie.context.reinstall`)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            context.reinstall()

    return run


def on_device(inputs: Any) -> bool:
    """Whether a graph's example inputs include a tensor on ``remote_accelerator``."""
    return any(isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE for x in inputs)


def _device_interface() -> type:
    from torch._dynamo.device_interface import DeviceInterface

    class RemoteAcceleratorInterface(DeviceInterface):
        """``torch.remote_accelerator`` for Dynamo and Inductor (as ``CudaInterface``)."""

        class device:  # noqa: N801
            def __new__(cls, device: Any) -> Any:
                return _device.device(device)

        class Worker:
            @staticmethod
            def set_device(device: int) -> None:
                _device.set_device(device)

            @staticmethod
            def current_device() -> int:
                return _device.current_device()

            @staticmethod
            def get_device_properties(device: Any = None) -> Any:
                return None

        current_device = staticmethod(_device.current_device)
        set_device = staticmethod(_device.set_device)
        device_count = staticmethod(_device.device_count)
        is_available = staticmethod(_device.is_available)
        synchronize = staticmethod(_device.synchronize)

        @staticmethod
        def maybe_exchange_device(device: int) -> int:
            prev = _device.current_device()
            if device != prev:
                _device.set_device(device)
            return prev

        exchange_device = maybe_exchange_device

        @staticmethod
        def is_bf16_supported(including_emulation: bool = False) -> bool:
            return True

        @staticmethod
        def is_triton_capable(device: Any = None) -> bool:
            return False

    return RemoteAcceleratorInterface


# --- the backend ----------------------------------------------------------------------------

def backend(gm: torch.fx.GraphModule, example_inputs: list[Any],
            options: dict[str, Any] | None = None) -> Any:
    """``torch.compile(..., backend="genie")``: AOTAutograd to Core ATen, each graph a
    ``genie::graph`` node (see the module doc). ``options`` (Inductor's) apply where the graph
    is compiled."""
    from torch._decomp import core_aten_decompositions
    from torch._dynamo.backends.common import aot_autograd

    bump("dynamo_graphs")
    compiler = functools.partial(_graph_compiler, options=options or {})
    found: list[Any] = []  # the inference graph's caller, where it needs no runtime wrapper
    inference = functools.partial(_graph_compiler, options=options or {}, direct=found)
    decomps = core_aten_decompositions()
    # F.scaled_dot_product_attention reaches the trace as the kernel the device's SDPA choice
    # names (csrc/whole.cpp): where the graph replays on a CPU, the CPU's own choice, so as
    # eager's CPU and torch.compile on the CPU run it, the CPU's flash attention and its
    # derivative where flash is eager's kernel (masks and grouped queries included), not the
    # fake device's math path (the T x T attention matrix, forward and backward). That op stays
    # one op, as Inductor keeps it: the table's decomposition (for export) computes the math
    # path and returns the attention weights (B, H, L, S) where the op returns its logsumexp
    # (B, H, L), while the backward graph keeps the op's derivative,
    # _scaled_dot_product_flash_attention_for_cpu_backward, which read those weights as the
    # logsumexp: a training step's forward agreed with eager's and its gradients did not
    decomps.pop(_FLASH, None)
    # an inference graph writes the inputs it mutates in place (genie::graph_mut: an
    # optimizer's step, a static KV cache), embedded or through a server: else AOTAutograd's
    # graph returns each one's new value (a copy: an index_copy_ into a KV cache copies the
    # whole cache) and its runtime wrapper copies it back (one recorded copy_ each)
    fn = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, inference_compiler=inference,
                      decompositions=decomps, keep_inference_input_mutations=True)(
                          gm, example_inputs)
    if found and len(found[0][1]) == len(example_inputs) and \
            all(isinstance(x, (torch.Tensor, int, torch.SymInt)) for x in example_inputs):
        return found[0][0]
    return fn


def _no_runtime_wrapper(n_inputs: int) -> bool:
    """Whether AOTAutograd's runtime wrapper around the inference graph being compiled (of
    ``n_inputs`` inputs) has nothing to do: no input mutated, no output aliasing an input or an
    intermediate, no effect tokens, no tensor subclass, no input deduplicated or merged, no
    autocast to turn off around it. Then Dynamo can call the graph's caller itself: ~6 µs less a
    call (the wrapper, its ``torch._dynamo.disable`` and the boxed call)."""
    try:
        from torch._functorch._aot_autograd.schemas import OutputType, SubclassCreationMeta
        from torch._guards import TracingContext
    except ImportError:  # another torch: keep the wrapper
        return False
    ctx = TracingContext.try_get()
    m = ctx.fw_metadata if ctx is not None else None
    return m is not None and len(m.input_info) == n_inputs and \
        not m.num_mutated_inp_runtime_indices and not m.num_intermediate_bases and \
        not m.tokens and m.grad_enabled_mutation is None and \
        not torch._C._is_any_autocast_enabled() and \
        all(o.output_type == OutputType.non_alias for o in m.output_info) and \
        not any(isinstance(s, SubclassCreationMeta)
                for s in (*m.subclass_inp_meta, *m.subclass_fw_graph_out_meta))


def _graph_compiler(gm: torch.fx.GraphModule, example_inputs: list[Any],
                    options: dict[str, Any], direct: list[Any] | None = None) -> Any:
    """An AOTAutograd graph as a callable that records one ``genie::graph`` node per call.
    With ``direct`` (an inference graph), the caller and the example inputs are appended to it
    where Dynamo may call the caller without AOTAutograd's runtime wrapper
    (:func:`_no_runtime_wrapper`)."""
    from torch._functorch.aot_autograd import make_boxed_func

    if any(n.target is _FLASH for n in gm.graph.nodes):
        bump("flash_attention_calls")
    n_inputs = len(example_inputs)
    # torch.tensor(data, device=...) in the graph: its value an input of its own, passed by
    # the caller on every call (uploaded once, here)
    consts = graphs.constants_as_inputs(gm)
    if consts:
        example_inputs = [*example_inputs, *consts]
    reason = _refusal(gm, example_inputs)
    if reason is None:
        try:
            writes = graphs.host_writes(gm)
            data, kinds = graphs.encode(gm, example_inputs, {n for _, n in writes})
            g = graphs.register(data, kinds)
        except graphs.GraphError as e:
            reason = str(e)
    if reason is not None:
        if reason not in _warned:
            _warned.add(reason)
            logger.warning("genie: a compiled graph runs op by op on %s (%s)", DEVICE_TYPE,
                           reason)
        bump("graphs_op_by_op")
        return make_boxed_func(_with_constants(gm.forward, consts))
    g.options = options
    call = _with_constants(_caller(gm, g, writes), consts)
    if direct is not None and _no_runtime_wrapper(n_inputs):
        direct.append((call, example_inputs[:n_inputs]))
    return make_boxed_func(call)


def _with_constants(fn: Any, consts: list[torch.Tensor]) -> Any:
    """``fn`` called with the graph's constants (:func:`genie.graphs.constants_as_inputs`)
    after the caller's inputs."""
    if not consts:
        return fn
    return lambda *args: fn(*args, *consts)


_warned: set[str] = set()


def _refusal(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> str | None:
    """Why a graph cannot be one node (None when it can)."""
    # 0-dim CPU tensors mix with device tensors as in eager (an optimizer's step counts)
    devs = {x.device for x in example_inputs if isinstance(x, torch.Tensor)
            and not (x.device.type == "cpu" and x.dim() == 0)}
    if not devs:
        return "it has no tensor inputs on the device"
    if len(devs) > 1 or next(iter(devs)).type != DEVICE_TYPE:
        return "its inputs are on several devices: " + ", ".join(sorted(map(str, devs)))
    for n in gm.graph.nodes:
        t = n.target
        if n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and \
                torch.Tag.nondeterministic_seeded in t.tags and not _no_dropout(n):
            return (f"it draws random numbers ({t}); op by op, their values follow Genie's "
                    "(seed, offset) contract as in eager mode")
    host = graphs.host_nodes(gm)
    for o in graphs.graph_outputs(gm):
        if isinstance(o, torch.fx.Node) and o.op != "placeholder" and o not in host and \
                not (isinstance(o.meta.get("val"), torch.Tensor)
                     and o.meta["val"].device.type == DEVICE_TYPE):
            return (f"it returns a value computed from device tensors on the host ({o.name}: "
                    f"{type(o.meta.get('val')).__name__})")
    return None


_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


def _no_dropout(n: torch.fx.Node) -> bool:
    """A call of the CPU's flash attention (seeded only for its dropout) with ``dropout_p ==
    0``: it draws nothing (see :func:`backend`)."""
    if n.target is not _FLASH:
        return False
    p = n.kwargs.get("dropout_p", n.args[3] if len(n.args) > 3 else 0.0)
    return p == 0.0


def _writer(t: LazyTensor) -> Any:
    """The node recorded last that writes ``t``'s storage (pending), or None."""
    w = t._node.storages[t._out].pending_writes
    return w[-1] if w else None


def _caller(gm: torch.fx.GraphModule, g: Any,
            writes: list[tuple[int, torch.fx.Node]]) -> Any:
    """``args -> outputs`` recording one ``genie::graph`` node; outputs that are inputs are
    passed through, host values and views of inputs computed here (views recorded on the inputs:
    :func:`genie.graphs.caller_nodes`), the other tensor outputs come from the node. ``writes``:
    the host inputs the graph writes (:func:`genie.graphs.host_writes`), written here after the
    node is recorded (which snapshots them as it reads them)."""
    record_known = _lazy_tensor.record_known  # as the graph compiles (a test counts its calls)
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    pos = {n: i for i, n in enumerate(ph)}
    node_outs = graphs.node_outputs(gm)
    host = graphs.caller_nodes(gm)
    host_outs = [o for o in graphs.graph_outputs(gm) if isinstance(o, torch.fx.Node)
                 and o.op != "placeholder" and o in host]
    # the values of the host writes after the host outputs
    host_w = [(i, len(host_outs) + j) for j, (i, _) in enumerate(writes)]
    host_fn = graphs.host_module(gm, host_outs + [n.args[1] for _, n in writes]) \
        if host_outs or writes else None
    # per output: ("in", i) the i-th input, ("out", k) the node's k-th tensor, ("host", k) the
    # k-th value computed here (a host value or a view of an input), ("const", v)
    plan: list[tuple[str, Any]] = []
    k = h = 0
    for o in graphs.graph_outputs(gm):
        if isinstance(o, torch.fx.Node) and o.op == "placeholder":
            plan.append(("in", pos[o]))
        elif isinstance(o, torch.fx.Node) and o in host:
            plan.append(("host", h))
            h += 1
        elif isinstance(o, torch.fx.Node):
            plan.append(("out", k))
            k += 1
        else:
            plan.append(("const", o))
    assert k == len(node_outs)
    key = g.key
    t_idx = [i for i, kd in enumerate(g.kinds) if kd == "t"]
    i_idx = [i for i, kd in enumerate(g.kinds) if kd == "i"]
    w_idx = [i for i, kd in enumerate(g.kinds) if kd == "m"]  # inputs the graph writes
    op = graphs.GRAPH_MUT_OP if w_idx else graphs.GRAPH_OP
    all_tensors = not i_idx and not w_idx
    # per ints (sizes of a dynamic graph): the node's meta-cache entry. Dynamo's guards fix the
    # inputs' metadata given the sizes, so later calls record without the key over all inputs
    # and its native form for _C._record_graph (None where that path cannot take it)
    entries: dict[tuple[int, ...], tuple[Any, Any]] = {}
    no_entry = (None, None)
    LT = LazyTensor
    only_lt = {LT}
    with_host = {LT, torch.Tensor}
    dispatch_modes = torch._C._len_torch_dispatch_stack
    # the outputs are the node's, in order (an inference graph's usual plan): returned as the
    # node's list itself
    as_node = host_fn is None and plan == [("out", i) for i in range(k)]

    # the call's arguments of each kind, as tuples, in one C call each (a list comprehension
    # over a decode step's 67 inputs cost ~2 µs a call of cold bytecode)
    pick_t = tuple_getter(t_idx)
    pick_i = tuple_getter(i_idx)
    pick_w = tuple_getter(w_idx)

    def call(*args: Any) -> list[Any]:
        tensors = args if all_tensors else pick_t(args)
        ints = pick_i(args)
        written = pick_w(args)
        if not k and not written:
            res: Any = []
        else:
            sizes = ints
            entry, native = entries.get(sizes, no_entry)
            res = NotImplemented
            if native is not None and not dispatch_modes():
                # the node recorded natively with its entry (each input checked a LazyTensor)
                res = record_graph(native, op, (key, written, tensors, ints) if w_idx
                                   else (key, tensors, ints))
            kinds = set(map(type, tensors)) if res is NotImplemented else only_lt
            # host: 0-dim CPU tensors among the inputs (a static KV cache's per-layer counters
            # in transformers' prefill), which Dynamo's guards fix as they fix the others
            host = kinds == with_host and all(
                type(t) is LT or (t.device.type == "cpu" and not t.dim()) for t in tensors)
            plain = res is NotImplemented and (kinds == only_lt or host) and \
                not dispatch_modes() and all(type(t) is LT for t in written)
            if res is not NotImplemented:
                pass
            elif entry is not None and plain:
                # the recorded leaves of (key, [written,] tensors, ints), as record would
                # flatten them; the Refs made natively (one per input every call: 97 inputs
                # 8.7 -> 3.7 µs, no Ref.__init__ each); a host input snapshotted, as
                # lazy_tensor._record snapshots it (eager reads it at the call)
                rec = [key]
                if host:
                    rec += [Ref(t._node, t._out) if type(t) is LT else t.detach().clone()
                            for t in (*written, *tensors)]
                elif not graph_refs(rec, written, tensors):
                    rec += [Ref(t._node, t._out) for t in (*written, *tensors)]
                rec += ints
                res = record_known(op, (key, list(written), list(tensors), list(ints)) if w_idx
                                   else (key, list(tensors), list(ints)), rec, entry)
            else:
                a = (key, list(written), list(tensors), list(ints)) if w_idx else \
                    (key, list(tensors), list(ints))
                res = op(*a)
                made = res[0]._node if plain and res and type(res[0]) is LT else \
                    _writer(written[0]) if plain and not res and written else None
                if made is not None and made.op is op and made.entry is not None:
                    # (a graph with no output, an optimizer's step: the node is the last
                    # writer of what it writes)
                    e = made.entry
                    entries[sizes] = (e, graph_entry(op, a, e))
        bump("graph_calls")
        if w_idx:
            bump("graph_mut_calls")
        if as_node and type(res) is list:
            return res
        hv = host_fn(*args) if host_fn is not None else []
        for i, j in host_w:
            args[i].copy_(hv[j])
        return [args[v] if w == "in" else res[v] if w == "out" else hv[v] if w == "host" else v
                for w, v in plan]

    return call
