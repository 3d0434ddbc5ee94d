"""The sum of squares of many CPU tensors in one pass (kernels/cpu/grad_norm_cpu.cc), for the global
gradient norm.

Layers: the launcher ``bmt_cpu_sum_squares`` (C ABI: one OpenMP region over chunks of all the tensors,
accumulated in double, no squared copy) <- the Paddle operator ``bmt_sum_squares`` (kernels/paddle/
grad_norm_op.cc: CPU place, one dtype, contiguity) <- :func:`sum_squares` here, which takes the tensors the
kernel can (CPU, float32/float64) and leaves the rest to the caller. train/optimizer/adamw.grad_norm_tensor uses it.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import paddle

from bmtrain_cli.ops.build import KernelBuildError, load_extension
from bmtrain_cli.ops.custom import contiguous

_KERNEL_DTYPES = (paddle.float32, paddle.float64)


def kernel_available() -> bool:
    """Whether the C++ extension with ``bmt_sum_squares`` is built and loaded (cached by load_extension)."""
    try:
        load_extension()
    except KernelBuildError:
        return False
    return True


def sum_squares(tensors: Sequence[paddle.Tensor]) -> Tuple[Optional[paddle.Tensor], List[paddle.Tensor]]:
    """(0-d fp32 tensor with the sum of the squares of the CPU float32/float64 tensors, or None when there
    are none; the tensors left over: on another device or of another dtype)."""
    groups: Dict[paddle.dtype, List[paddle.Tensor]] = {dt: [] for dt in _KERNEL_DTYPES}
    rest: List[paddle.Tensor] = []
    for t in tensors:
        if t.place.is_cpu_place() and t.dtype in groups:
            groups[t.dtype].append(contiguous(t))
        else:
            rest.append(t)
    ext = load_extension()
    parts = [ext.bmt_sum_squares(g).reshape([]) for g in groups.values() if g]
    if not parts:
        return None, rest
    return (parts[0] if len(parts) == 1 else paddle.add_n(parts)), rest
