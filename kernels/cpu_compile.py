"""An inductor backend for decode steps on CPU: matrix products with a few rows become fused
multiply-reduce loops.

A decode step multiplies one token (a few query rows) by every weight matrix of the model: a
matrix-vector product, bound by the weights' bytes. On this project's CPU (AMD EPYC, one
thread) oneDNN's and MKL's `mm` reach 10-15 GB/s on those shapes, where the fused reduction
inductor generates for `(a[:, :, None] * b[None]).sum(1)` reaches 16-21 GB/s against the 29
GB/s a plain read gets (`benchmarks/decode_latency.py` prints the step against this floor).
Inductor decomposes such products itself only for tiny sizes on CPU (`torch._inductor.
decomposition.mm`); `backend` extends its decomposition table for `mm`, `addmm` and `bmm` whose
first operand has at most `SMALL_ROWS` rows, and leaves every other product to the library.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

SMALL_ROWS = 4
"""The most rows (tokens x query heads per KV head, in attention) a product may have to be
lowered as a reduction: beyond it the BLAS kernels amortise their weight reads better."""

aten = torch.ops.aten


def _small(a: torch.Tensor) -> bool:
    return a.device.type == "cpu" and a.shape[-2] <= SMALL_ROWS


def _mm(a: torch.Tensor, b: torch.Tensor):
    """`a @ b` for `a` `[M, K]`, `b` `[K, N]`, as `sum_k a[m, k] * b[k, n]`."""
    if not _small(a):
        return NotImplemented
    return (a[:, :, None] * b[None]).sum(dim=1)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta=1, alpha=1):
    """`beta * bias + alpha * (a @ b)`, the product as in `_mm`."""
    if not _small(a):
        return NotImplemented
    return beta * bias + alpha * (a[:, :, None] * b[None]).sum(dim=1)


def _bmm(a: torch.Tensor, b: torch.Tensor):
    """`a @ b` for `a` `[B, M, K]`, `b` `[B, K, N]`, as in `_mm` per batch entry."""
    if not _small(a):
        return NotImplemented
    return (a[:, :, :, None] * b[:, None]).sum(dim=2)


def backend(graph: torch.fx.GraphModule, example_inputs: list):
    """The `torch.compile` backend: inductor with the decompositions above added to its own.
    AOTAutograd's cache is off while it compiles: its key does not cover a decomposition
    table, so it could hand back a graph compiled without these (inductor's own cache keys the
    decomposed graph, and the table as `_Table` pickles: it stays on)."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    with functorch_config.patch(enable_autograd_cache=False):
        return compile_fx(graph, example_inputs, decompositions=_table())


class _Table(dict):
    """The decomposition table `backend` passes, pickled (for inductor's FX graph cache key) as
    `_table_for(digest of this file)`: torch's own entries do not all pickle (612 of 1101 in
    torch 2.13), and an entry that does not makes inductor bypass its cache on every graph;
    torch's version, in the key too, fixes them."""

    def __reduce__(self):
        return _table_for, (_SOURCE_DIGEST,)


_SOURCE_DIGEST = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
"""The digest of this file: a change to the decompositions above changes inductor's keys."""


def _table_for(digest: str) -> _Table:
    """`_table()`, as a pickled `_Table` is read back; `digest` names its source in keys."""
    return _table()


@functools.cache
def _table() -> _Table:
    from torch._inductor.decomposition import select_decomp_table

    return _Table(
        {
            **select_decomp_table(),
            aten.mm.default: _mm,
            aten.addmm.default: _addmm,
            aten.bmm.default: _bmm,
        }
    )
