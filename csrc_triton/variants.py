"""How many variants of each Triton kernel a run needs compiled.

Triton compiles a kernel once per *specialization*: every constexpr by value, every integer
argument by class (1, a multiple of 16, other) and every tensor by whether its address is a
multiple of 16, except the arguments a kernel lists in `do_not_specialize` /
`do_not_specialize_on_alignment`. An argument that changes class from step to step (a batch
size, a block-table width, a view at an offset that depends on the batch) makes a serving
engine compile (or load from the disk cache) new variants in the middle of its run.
`VariantCounter` applies those rules to every launch (a pre-run hook, so it works under
`TRITON_INTERPRET=1` as well as on a GPU) and counts the distinct keys per kernel.
"""

from __future__ import annotations

import inspect
from collections import defaultdict

import torch


class VariantCounter:
    def __init__(self, kernels: dict[str, object]) -> None:
        """kernels: name -> a `@triton.jit` function (compiled or interpreted)."""
        self.keys: dict[str, set[tuple]] = defaultdict(set)
        for name, kernel in kernels.items():
            kernel.add_pre_run_hook(self._hook(name, kernel))

    def counts(self) -> dict[str, int]:
        return {name: len(keys) for name, keys in self.keys.items()}

    def _hook(self, name: str, kernel):
        params = list(inspect.signature(kernel.fn).parameters.values())
        options = getattr(kernel, "kwargs", None) or {}  # the interpreter keeps them here
        skip = _names(
            getattr(kernel, "do_not_specialize", None) or options.get("do_not_specialize"), params
        )
        skip_align = _names(
            getattr(kernel, "do_not_specialize_on_alignment", None)
            or options.get("do_not_specialize_on_alignment"),
            params,
        )

        def hook(*args, **kwargs):
            bound = dict(zip((p.name for p in params), args)) | kwargs
            key = tuple(
                _class(p, bound.get(p.name, p.default), p.name in skip, p.name in skip_align)
                for p in params
            )
            self.keys[name].add(key)

        return hook


def _names(items, params) -> set[str]:
    return {params[i].name if isinstance(i, int) else i for i in (items or [])}


def _class(param, value, no_int: bool, no_align: bool):
    if "constexpr" in str(param.annotation):
        return value
    if isinstance(value, torch.Tensor):
        return (value.dtype, no_align or value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or not isinstance(value, int):
        return type(value).__name__
    if no_int:
        return "int"
    if value == 1:
        return 1
    return "D" if value % 16 == 0 and not no_align else "int"  # (alignment: an int's too)
