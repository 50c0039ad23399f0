"""Operators of ours that the compiler treats as opaque: the packed GEMM (linear.py) and the paged attention
(kv_cache.py). They run as Python on the step's real tensors, so they can read what changes from step to
step (a packed weight, the rows' lengths) under one compiled graph.

They are registered straight at the dispatcher's CPU key (torch.library.Library), not through
`torch.library.custom_op`, whose kernel wrapper (a dynamo-disabled call and an aliasing check on every call)
cost about 25 us a call here: a decode step calls these ops 151 times (121 linear layers, 30 attention
layers). The schema says they neither mutate nor alias their inputs; `fake` gives the output's shape while
a graph is traced. They are inference-only and CPU-only: no autograd formula is registered (the runtime
runs under `torch.inference_mode`; with inputs that require grad, torch's autograd fallback runs the forward
and a backward warns and gives no gradient), and no other device has a kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

NAMESPACE = "spyre_serve"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def opaque_op(schema: str, fake: Callable, key: str = "CPU") -> Callable[[Callable], torch._ops.OpOverload]:
    """Decorator: defines `spyre_serve::<schema>` with the decorated function as its kernel for dispatch key
    `key` (CompositeExplicitAutograd: CPU's until a CPU kernel of C++ is registered) and `fake` as its shape
    function; returns the op (`torch.ops.spyre_serve.<name>.default`), callable like the function."""

    def define(fn: Callable) -> torch._ops.OpOverload:
        name = schema.split("(", 1)[0]
        _LIB.define(schema)
        _LIB.impl(name, fn, key)
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
        op = getattr(getattr(torch.ops, NAMESPACE), name).default
        op.__doc__ = fn.__doc__
        return op

    return define
