"""Applying a batch's token bitmasks to logits on CPU, every masked row in a few numpy operations.

xgrammar 0.2.8's CPU kernel takes about 0.5 ms a row at a 150K vocabulary, and torch's element-wise
ops on a busy 2-core machine stall on their thread pool, so the masks are applied through a numpy
view of the logits: a row that allows a few tokens (most steps of a call: markup, a name, a key, an
enum) keeps those and is filled with -inf (a memset); a row that allows most tokens (a JSON
string's contents) has its refused entries blended to -inf without branches. Logits numpy cannot
view (bfloat16) go through torch. ``benchmarks/scale_rows.py`` measures it against one write of
the logits, the floor of any mask on CPU. No vLLM imports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


#: below this many logits to mask (a row of a small vocabulary), torch's one masked fill is cheaper
#: than the numpy calls (measured at 2K: 25 against 75 µs a step); kept under torch's grain size
#: (32,768 elements), above which its ops go to its thread pool, which stalls for milliseconds on
#: a busy machine (benchmarks/scale_rows.py saw 30 ms steps at 16 rows of 2K)
SMALL_MASK_ENTRIES = (1 << 15) - 1


def apply_on_cpu(logits: Any, words: Any, rows: Sequence[int], vocab: int, sparse_share: float) -> None:
    """Set ``logits[row, token]`` to -inf for each listed row (sorted) and each token below
    ``vocab`` whose bit in ``words[row]`` (int32 bitmask words, xgrammar's layout) is 0; a row with
    at most ``sparse_share`` of its words non-zero is masked by keeping its allowed tokens."""
    import numpy as np
    if len(rows) * vocab <= SMALL_MASK_ENTRIES:   # a few numpy calls cost more than torch's one
        _apply_with_torch(logits, words, rows, vocab)
        return
    try:
        target = logits.detach().numpy()
    except (TypeError, RuntimeError):
        target = None
    if target is None or target.strides[-1] != target.itemsize:
        _apply_with_torch(logits, words, rows, vocab)
        return
    rows_array = np.asarray(rows, dtype=np.int64)
    chosen = words[rows_array]
    sparse = np.count_nonzero(chosen, axis=1) <= chosen.shape[1] * sparse_share
    if sparse.any():
        _keep_only(target, rows_array[sparse], chosen[sparse], vocab)
    for row, row_words in zip(rows_array[~sparse].tolist(), chosen[~sparse]):
        _refuse(target[row, :vocab], row_words, vocab)


def _apply_with_torch(logits: Any, words: Any, rows: Sequence[int], vocab: int) -> None:
    """The bits unpacked with numpy, one masked fill in torch (dtypes numpy has no view of)."""
    import numpy as np
    import torch
    allowed = np.unpackbits(words[list(rows)].view(np.uint8), axis=-1, bitorder="little", count=vocab)
    refused = torch.from_numpy(allowed) == 0
    first = rows[0]
    if list(rows) == list(range(first, first + len(rows))):
        logits[first:first + len(rows), :vocab].masked_fill_(refused, float("-inf"))
    else:
        index = torch.tensor(list(rows))
        logits[index, :vocab] = logits[index, :vocab].masked_fill(refused, float("-inf"))


def _keep_only(target: Any, rows: Any, words: Any, vocab: int) -> None:
    """Set ``target[row, :vocab]`` to -inf but for the tokens each row's bitmask ``words`` allows:
    the allowed tokens are read from the non-zero words only, kept, the rows filled, put back."""
    import numpy as np
    which, columns = np.nonzero(words)
    bits = np.unpackbits(np.ascontiguousarray(words[which, columns]).view(np.uint8).reshape(-1, 4),
                         axis=1, bitorder="little")
    word, bit = np.nonzero(bits)
    tokens = columns[word] * 32 + bit
    owners = rows[which[word]]
    inside = tokens < vocab
    tokens, owners = tokens[inside], owners[inside]
    kept = target[owners, tokens]
    if rows[-1] - rows[0] + 1 == len(rows):   # contiguous: one slice
        target[rows[0]:rows[-1] + 1, :vocab] = -np.inf
    else:
        target[rows, :vocab] = -np.inf
    target[owners, tokens] = kept


def _refuse(target: Any, words: Any, vocab: int) -> None:
    """Set the entries of one row (``target``, ``vocab`` long) whose bit in ``words`` is 0 to
    -inf, without branches: the bits unpacked to an all-ones/all-zeros mask per entry, the -inf
    bit pattern blended in (a row allowing most tokens, such as a JSON string's contents)."""
    import numpy as np
    integer = np.dtype(f"i{target.itemsize}")
    negative_infinity = np.array(-np.inf, dtype=target.dtype).view(integer)
    refused = np.unpackbits((~words).view(np.uint8), bitorder="little", count=vocab)
    mask = np.negative(refused.view(np.int8)).astype(integer)      # 0 or all ones
    bits = target.view(integer)
    np.bitwise_and(bits, ~mask, out=bits)
    np.bitwise_or(bits, mask & negative_infinity, out=bits)
