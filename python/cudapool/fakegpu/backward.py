"""The tracer's own backward pass: runs autograd's graph node by node from Python.

Why not torch's engine: on fake CUDA tensors without a GPU the C++ engine asks the CUDA runtime
about device 0 before it runs anything, and fails. And under any dispatch mode (the tracer's
included), and always on meta tensors, the engine's two gradient sums take their out-of-place
paths: a parameter's second gradient is added into a new tensor instead of into ``.grad``, and
a gradient that reaches a node from two uses is summed into a new tensor. A GPU run sums in
place. This executor runs each node's backward formula as the engine does (same order, saved
tensors released after the node ran unless the graph is retained) and performs the two sums
itself with the rules the engine applies to ordinary dense CUDA tensors.

What it does not do: tensor and node hooks other than those of leaf tensors
(``register_hook`` / ``register_post_accumulate_grad_hook`` on parameters) are not run,
``retain_grad()`` of non-leaf tensors is not honoured, and ``create_graph=True`` or
``GradientEdge`` inputs go to torch's engine.
"""

from __future__ import annotations

import heapq
import itertools
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["SavedTensors", "run_backward", "Unsupported"]

_ACCUMULATE = "torch::autograd::AccumulateGrad"


class Unsupported(Exception):
    """The call needs a feature this executor does not have (torch's engine must run it)."""


class _Held:
    """A tensor saved for backward (packed by :class:`SavedTensors`)."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t: Optional[torch.Tensor] = t


class SavedTensors:
    """``saved_tensors_hooks`` that keep each saved tensor in a holder the executor can empty
    once the node that saved it has run: torch's engine drops a node's saved tensors after the
    node ran, and Python has no other way to do it.

    The holder keeps a detached alias (same storage): a saved output keeping itself (and its
    graph) alive through its own node would never be freed."""

    def __init__(self) -> None:
        self._unpacked: Optional[List[_Held]] = None
        #: Called with True before a node's formula runs and with False after it (the tracer
        #: uses it to know which tensors the running formula made).
        self.node_hook: Optional[Callable[[bool], None]] = None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> _Held:
        return _Held(t.detach())

    def _unpack(self, held: _Held) -> torch.Tensor:
        if held.t is None:
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access saved tensors after they have "
                "already been freed). Specify retain_graph=True if you need to backward through the graph a second time."
            )
        if self._unpacked is not None:
            self._unpacked.append(held)
        return held.t

    def __enter__(self) -> "SavedTensors":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def _num_inputs(node: Any) -> int:
    meta = getattr(node, "_input_metadata", None)
    return len(meta) if meta is not None else 1


def _is_dense(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and not t.is_nested


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _obeys_layout_contract(grad: torch.Tensor, var: torch.Tensor) -> bool:
    """torch's gradient layout contract: ``.grad`` has its parameter's strides where the
    parameter is dense and non-overlapping, else it is contiguous."""
    if not (_is_dense(grad) and _is_dense(var)):
        return False
    if _non_overlapping_and_dense(var):
        return all(size == 1 or gs == vs for size, gs, vs in zip(grad.shape, grad.stride(), var.stride()))
    return grad.is_contiguous()


def _clone_obeying_contract(grad: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    if _non_overlapping_and_dense(var):
        return grad.new_empty_strided(var.shape, var.stride()).copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


def _storage_refs(t: torch.Tensor) -> int:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return 2
    # The Python storage object made just now holds one reference of its own.
    return int(torch._C._storage_Use_Count(storage._cdata)) - 1


class _Run:
    """One backward call: the graph from the roots, the dependencies, the ready queue."""

    def __init__(
        self, saved: Optional[SavedTensors], keep_graph: bool, accumulate_grad: bool, inputs: Sequence[torch.Tensor]
    ) -> None:
        self.saved = saved
        self.keep_graph = keep_graph
        self.accumulate_grad = accumulate_grad
        self.inputs = list(inputs)
        self.deps: Dict[Any, int] = {}
        self.buffers: Dict[Any, List[Optional[torch.Tensor]]] = {}
        self.ready: List[Tuple[int, int, Any]] = []
        self.order = itertools.count()
        # With inputs: the nodes whose gradients are wanted (capture) and those to run.
        self.capture: Dict[Any, List[Tuple[int, int]]] = {}  # node -> [(input_nr, index in inputs)]
        self.needed: Optional[set] = None
        self.captured: List[Optional[torch.Tensor]] = [None] * len(self.inputs)

    # ---- the graph ------------------------------------------------------------------------

    def edge_of(self, t: torch.Tensor) -> Tuple[Any, int]:
        if t.grad_fn is not None:
            return t.grad_fn, t.output_nr
        if not t.requires_grad:
            raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
        # A leaf: its gradient accumulator, reached through a view's graph.
        with torch.enable_grad():
            acc = t.view_as(t).grad_fn.next_functions[0][0]
        return acc, 0

    def build(self, roots: List[Tuple[Any, int]]) -> None:
        seen = set()
        stack = [fn for fn, _ in roots]
        for fn in stack:
            seen.add(fn)
        children: Dict[Any, List[Any]] = {}
        while stack:
            fn = stack.pop()
            kids = []
            for nxt, _ in getattr(fn, "next_functions", ()):
                if nxt is None:
                    continue
                kids.append(nxt)
                self.deps[nxt] = self.deps.get(nxt, 0) + 1
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
            children[fn] = kids
        if self.inputs:
            for i, t in enumerate(self.inputs):
                fn, nr = self.edge_of(t)
                self.capture.setdefault(fn, []).append((nr, i))
            # A node runs when it leads to a wanted edge (and, with accumulation, a wanted
            # accumulator runs itself).
            targets = set(self.capture)
            memo: Dict[Any, bool] = {}
            for fn in seen:
                self._reaches(fn, targets, children, memo)
            needed = {fn for fn, hit in memo.items() if hit}
            if not self.accumulate_grad:
                needed -= {fn for fn in targets if fn.name() == _ACCUMULATE}
            else:
                # backward(inputs=...): only the inputs' own accumulators accumulate.
                needed -= {fn for fn in seen if fn.name() == _ACCUMULATE and fn not in targets}
            self.needed = needed

    def _reaches(self, fn: Any, targets: set, children: Dict[Any, List[Any]], memo: Dict[Any, bool]) -> bool:
        # Iterative post-order: a node reaches a target if it is one or a child reaches one.
        stack = [(fn, False)]
        while stack:
            node, expanded = stack.pop()
            if node in memo:
                continue
            if not expanded:
                stack.append((node, True))
                for kid in children.get(node, ()):
                    if kid not in memo:
                        stack.append((kid, False))
            else:
                memo[node] = node in targets or any(memo.get(k, False) for k in children.get(node, ()))
        return memo[fn]

    # ---- the work ---------------------------------------------------------------------------

    def push(self, fn: Any) -> None:
        # torch's ready queue: accumulators first (their sequence number is the largest), then
        # the most recently created node.
        seq = fn._sequence_nr()
        heapq.heappush(self.ready, (-seq, next(self.order), fn))

    def add(self, fn: Any, nr: int, grad: Optional[torch.Tensor]) -> None:
        buf = self.buffers.get(fn)
        if buf is None:
            buf = self.buffers[fn] = [None] * _num_inputs(fn)
        if grad is None:
            return
        old = buf[nr]
        if old is None:
            buf[nr] = grad
            return
        buf[nr] = None
        buf[nr] = _sum(old, grad)

    def run(self, roots: List[Tuple[Any, int]], grads: List[Optional[torch.Tensor]]) -> None:
        self.build(roots)
        for (fn, nr), g in zip(roots, grads):
            self.add(fn, nr, _validated(fn, nr, g))
        grads.clear()
        for fn, _ in roots:
            if self.deps.get(fn, 0) == 0 and fn not in {f for _, _, f in self.ready}:
                self.push(fn)
        while self.ready:
            _, _, fn = heapq.heappop(self.ready)
            buf = self.buffers.pop(fn, None) or [None] * _num_inputs(fn)
            for nr, i in self.capture.get(fn, ()):
                grad = buf[nr]
                if grad is not None and fn.name() == _ACCUMULATE:
                    grad = _leaf_hooks(fn.variable, grad)  # torch runs a leaf's hooks for grad() too
                self.captured[i] = grad
                del grad
            outs: List[Optional[torch.Tensor]] = []
            if self.needed is not None and fn not in self.needed:
                pass
            elif fn.name() == _ACCUMULATE:
                grad = buf[0]
                del buf
                if grad is not None:
                    _accumulate(fn.variable, grad)
                del grad
            else:
                outs = self.call(fn, buf)
                del buf
            self.forward_outputs(fn, outs)

    def call(self, fn: Any, buf: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
        """Runs one node's backward formula; the gradients it returns, in a list the caller
        empties as it hands them on (no other reference is left to them)."""
        if all(g is None for g in buf):
            return [None] * len(getattr(fn, "next_functions", ()))
        unpacked: List[_Held] = []
        hook = self.saved.node_hook if self.saved is not None else None
        outer = self.saved._unpacked if self.saved is not None else None  # a reentrant backward's
        if self.saved is not None:
            self.saved._unpacked = unpacked
        if hook is not None:
            hook(True)
        try:
            with torch.no_grad():
                if callable(fn):
                    out = fn(*buf)
                else:  # a torch.autograd.Function's backward node
                    out = _python_function(fn, buf)
        finally:
            if hook is not None:
                hook(False)
            if self.saved is not None:
                self.saved._unpacked = outer
        outs = [out] if isinstance(out, torch.Tensor) or out is None else list(out)
        del out
        # As torch's engine: the gradients are checked against (summed to, cast to) the inputs
        # they flow to, then the node's incoming gradients go, then its saved tensors.
        for i, (nxt, nr) in enumerate(getattr(fn, "next_functions", ())):
            if i < len(outs) and nxt is not None:
                outs[i] = _validated(nxt, nr, outs[i])
        buf.clear()
        if not self.keep_graph:
            for held in unpacked:
                held.t = None
        return outs

    def forward_outputs(self, fn: Any, outs: List[Optional[torch.Tensor]]) -> None:
        for i, (nxt, nr) in enumerate(getattr(fn, "next_functions", ())):
            if nxt is None:
                continue
            grad = None
            if i < len(outs):
                grad, outs[i] = outs[i], None
            self.deps[nxt] -= 1
            if self.needed is None or nxt in self.needed or nxt in self.capture:
                self.add(nxt, nr, grad)
            del grad
            if self.deps[nxt] == 0:
                del self.deps[nxt]
                if nxt in self.buffers or (self.needed is not None and nxt in self.capture):
                    self.push(nxt)
                else:
                    self.buffers.pop(nxt, None)


def _python_function(fn: Any, buf: List[Optional[torch.Tensor]]) -> List[Optional[torch.Tensor]]:
    """A torch.autograd.Function's backward, called as torch calls it: missing gradients made
    zeros first (unless the function turned that off), and one result per forward input cut
    down to the graph's edges (tensors that require grad)."""
    if getattr(fn, "materialize_grads", True):
        for i, meta in enumerate(getattr(fn, "_input_metadata", ())):
            if i < len(buf) and buf[i] is None:
                buf[i] = torch.zeros(tuple(meta.shape), dtype=meta.dtype, device=meta.device)
    out = fn.apply(*buf)
    outs = [out] if isinstance(out, torch.Tensor) or out is None else list(out)
    del out
    nexts = getattr(fn, "next_functions", ())
    needs = list(getattr(fn, "needs_input_grad", ()))
    if len(outs) == len(nexts) or len(outs) != len(needs):
        return outs
    # One result per forward input, non-tensors included: keep those of the inputs that need a
    # gradient, in order, for the edges that lead somewhere.
    wanted = [g for g, need in zip(outs, needs) if need]
    aligned: List[Optional[torch.Tensor]] = [None] * len(nexts)
    slots = [i for i, (nxt, _) in enumerate(nexts) if nxt is not None]
    for i, g in zip(slots, wanted):
        aligned[i] = g
    outs.clear()
    return aligned


def _validated(fn: Any, nr: int, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """torch's validate_outputs: a gradient of another shape or dtype than the input it flows
    to is summed to its shape and cast."""
    metas = getattr(fn, "_input_metadata", None)
    if grad is None or metas is None or nr >= len(metas):
        return grad
    meta = metas[nr]
    shape = tuple(meta.shape)
    if tuple(grad.shape) != shape:
        grad = grad.sum_to_size(shape)
    if grad.dtype != meta.dtype and _is_dense(grad):
        grad = grad.to(meta.dtype)
    return grad


def _sole_owner(t: torch.Tensor, python_refs: int) -> bool:
    return sys.getrefcount(t) <= python_refs and _storage_refs(t) <= 1


def _sum(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """InputBuffer's accumulation on ordinary dense tensors: in place into whichever of the
    two the buffer owns alone (storage included), else a new tensor."""
    # Python references in _sole_owner when the buffer owns the tensor alone: ``old`` is held
    # by _Run.add's local, this frame, _sole_owner's argument and getrefcount's; ``new`` also
    # by _Run.forward_outputs' local.
    if _is_dense(old) and _non_overlapping_and_dense(old) and _sole_owner(old, 4):
        return old.add_(new)
    if _is_dense(new) and _non_overlapping_and_dense(new) and _sole_owner(new, 5):
        return new.add_(old)
    return old + new


def _leaf_hooks(var: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The hooks registered on a leaf with ``register_hook``, in order; each may replace the
    gradient."""
    for hook in list((getattr(var, "_backward_hooks", None) or {}).values()):
        result = hook(grad)
        if result is not None:
            grad = result
    return grad


def _accumulate(var: torch.Tensor, grad: torch.Tensor) -> None:
    """AccumulateGrad with grad mode off, on dense tensors: steal the gradient when the buffer
    owned it and it has the parameter's layout, else copy it into the parameter's layout; a
    second gradient is added into ``.grad`` in place."""
    with torch.no_grad():
        grad = _leaf_hooks(var, grad)
        old = var.grad
        if old is None:
            # References: the caller's name, this frame, getrefcount's argument.
            if _is_dense(grad) and sys.getrefcount(grad) <= 3 and _obeys_layout_contract(grad, var):
                var.grad = grad.detach()
            elif _is_dense(grad):
                var.grad = _clone_obeying_contract(grad, var)
            else:
                var.grad = grad.clone()
        elif _is_dense(old) and _is_dense(grad):
            old.add_(grad)
        else:
            var.grad = old + grad
        del old
        for hook in list((getattr(var, "_post_accumulate_grad_hooks", None) or {}).values()):
            hook(var)


def run_backward(
    saved: Optional[SavedTensors],
    t_outputs: Sequence[Any],
    grad_tensors: Sequence[Optional[torch.Tensor]],
    keep_graph: bool,
    create_graph: bool,
    inputs: Sequence[Any] = (),
    allow_unreachable: bool = True,
    accumulate_grad: bool = True,
) -> Tuple[Optional[torch.Tensor], ...]:
    """What ``torch.autograd.graph._engine_run_backward`` does, run from Python."""
    if create_graph:
        raise Unsupported("create_graph=True")
    if any(not isinstance(t, torch.Tensor) for t in list(t_outputs) + list(inputs or ())):
        raise Unsupported("GradientEdge roots or inputs")
    run = _Run(saved, keep_graph, accumulate_grad, list(inputs or ()))
    roots = []
    grads = []
    for t, g in zip(t_outputs, grad_tensors):
        roots.append(run.edge_of(t))
        grads.append(g)
    del grad_tensors
    run.run(roots, grads)
    if accumulate_grad:
        return ()
    result = tuple(run.captured)
    if not allow_unreachable:
        for i, g in enumerate(result):
            if g is None:
                raise RuntimeError(
                    f"One of the differentiated Tensors (input {i}) appears to not have been used in the graph. "
                    "Set allow_unused=True if this is the desired behavior."
                )
    return result
