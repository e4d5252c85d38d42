"""The batch-invariance check the exact numerics mode's kernel tests share: a kernel's result for a row must be the
same bits whatever batch it ran in."""
from __future__ import annotations

from typing import Callable

import torch

ROWS = 17  # the reference batch; compositions reuse its rows alone, among 3, or among 17


def compositions(rows: int = ROWS) -> list[list[int]]:
    """Batches of pool rows: 0..rows-1 are the rows under test, rows..2*rows-1 other rows (new neighbours). Each
    row under test appears alone, in a batch of 3 at every position with new neighbours, and among 17 at another
    position than in the reference."""
    other = [rows + i for i in range(rows)]
    batches = [[i] for i in range(rows)]
    for i in range(rows):
        triple = [other[i], other[(i + 1) % rows]]
        triple.insert(i % 3, i)
        batches.append(triple)
    batches.append(list(reversed(range(rows))))
    mixed = [j for pair in zip(other[:9], range(8, rows)) for j in pair]  # rows 8.. among new neighbours
    batches.append(mixed)
    return batches


def assert_rows_invariant(run: Callable[[list[int]], torch.Tensor], rows: int = ROWS) -> torch.Tensor:
    """run(pool indices) -> one result row per index. Asserts every composition's row equals the reference batch's
    row bitwise and returns the reference [rows, ...]."""
    reference = run(list(range(rows)))
    for batch in compositions(rows):
        out = run(batch)
        for at, index in enumerate(batch):
            if index < rows:
                assert torch.equal(out[at], reference[index]), (f"row {index} at position {at} of a batch of "
                                                                f"{len(batch)} differs from the reference batch's")
    return reference
