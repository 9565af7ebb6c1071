"""Matrix multiplications in a lower precision while weights, optimizer state and logprobs stay in float32.

``matmul_precision(model, "bfloat16")`` runs the model's forward under autocast, so its linear layers (and the
backward through them) compute in bfloat16: about twice the matmul throughput on CPUs with AVX-512 BF16 and on
GPUs. The LM head is the exception: it runs in float32 on float32 inputs, because the policy-gradient ratio and
the KL terms are differences of logprobs, which bf16 logits (about three significant digits) would blur.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # by config name


def resolve_matmul_dtype(name: str | torch.dtype | None, field: str = "matmul_dtype") -> torch.dtype | None:
    """A dtype from its config name (None stays None: the weights' own dtype)."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"{field} = {name!r}: expected one of {sorted(DTYPES)}")
    return DTYPES[name]


@contextmanager
def matmul_precision(model: Any, dtype: str | torch.dtype | None) -> Iterator[None]:
    """Forward passes inside run their matmuls in ``dtype`` (a no-op when it is the weights' dtype or None)."""
    dtype = resolve_matmul_dtype(dtype)
    weights = next(model.parameters())
    if dtype is None or dtype == weights.dtype:
        yield
        return
    device_type = weights.device.type
    head = model.get_output_embeddings()

    def head_in_full_precision(_module: Any, args: tuple) -> tuple:
        torch.set_autocast_enabled(device_type, False)  # the outer autocast context restores the state on exit
        return tuple(a.to(head.weight.dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    def autocast_again(_module: Any, _args: tuple, output: Any) -> Any:
        torch.set_autocast_enabled(device_type, True)
        return output

    hooks = [head.register_forward_pre_hook(head_in_full_precision), head.register_forward_hook(autocast_again)]
    try:
        with torch.autocast(device_type, dtype=dtype):
            yield
    finally:
        for hook in hooks:
            hook.remove()
