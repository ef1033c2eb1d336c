"""The tensors among an operator's arguments or results, found faster than pytree does.

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


__all__ = ["tensors_in"]
