"""The tensors in things: among an operator's arguments or results (:func:`tensors_in`), and
of the modules and optimizers a tracer is asked to watch (:func:`tensors_of`).

An ATen operator takes and returns tensors, scalars, and tuples, lists and dicts of them (a
``Tensor[]`` argument, ``kwargs``, a tuple of results): a walk of those three containers finds
every tensor that ``torch.utils._pytree.tree_flatten`` would, without its registry lookups,
which cost a tracer more than its own bookkeeping on every operation.
"""

from __future__ import annotations

from typing import Any, List

import torch

_Tensor = torch.Tensor


def tensors_in(obj: Any) -> List[torch.Tensor]:
    """The tensors in ``obj``, a tensor or nested tuples, lists and dicts of anything, in
    pytree's order."""
    if isinstance(obj, _Tensor):
        return [obj]
    out: List[torch.Tensor] = []
    _walk(obj, out)
    return out


def _walk(obj: Any, out: List[torch.Tensor]) -> None:
    if isinstance(obj, _Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            if isinstance(item, _Tensor):
                out.append(item)
            elif isinstance(item, (tuple, list, dict)):
                _walk(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _walk(item, out)


def tensors_of(obj: Any) -> List[torch.Tensor]:
    """The tensors of ``obj``: a tensor and its gradient; a module's parameters (with their
    gradients) and buffers; an optimizer's parameters and state; dicts, lists, tuples and sets
    of these. TypeError for anything else."""
    out: List[torch.Tensor] = []
    _collect(obj, out)
    return out


def _collect(obj: Any, into: List[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        into.append(obj)
        if obj.grad is not None:
            into.append(obj.grad)
    elif isinstance(obj, torch.nn.Module):
        for t in obj.parameters():
            _collect(t, into)
        into.extend(obj.buffers())
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            for p in group["params"]:
                _collect(p, into)
        for state in obj.state.values():
            into.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect(v, into)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            _collect(v, into)
    else:
        raise TypeError(f"watch() takes tensors, modules, optimizers and collections, not {type(obj).__name__}")


__all__ = ["tensors_in", "tensors_of"]
