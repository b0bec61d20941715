"""The Triton interpreter made to compute a tile's dot as a GPU does, for the batch-invariance tests."""

from __future__ import annotations

import os


def use_row_invariant_dot() -> None:
    """Under TRITON_INTERPRET=1 a kernel's tl.dot is numpy's matmul, and its BLAS sums a row of the
    tile in another order by the row's place in the tile (seen on an AMD EPYC with numpy 2.4's
    OpenBLAS: row 63 of a 64-row tile differs from the same row at row 0); the batch-invariance
    tests of our kernels would then test numpy, and pass or fail with the CPU. Here each output
    element is one float64 sum in k order, as a tensor-core tile computes a row whatever its place.
    ~10x slower than matmul, so only the invariance tests' modules take it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter

    matmul = interpreter.InterpreterBuilder.create_dot
    if getattr(matmul, "row_invariant", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # float8: the interpreter's path
            return matmul(self, a, b, d, input_precision, max_num_imprecise_acc)
        products = a.data.astype("float64")[..., :, :, None] * b.data.astype("float64")[..., None, :, :]
        summed = products.sum(axis=-2) + d.data
        return interpreter.TensorHandle(summed.astype(d.data.dtype), d.dtype.scalar)

    create_dot.row_invariant = True
    interpreter.InterpreterBuilder.create_dot = create_dot
