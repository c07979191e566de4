"""COCO run-length encoding of binary masks, as pycocotools writes it.

A mask [H, W] is read column by column (Fortran order); counts alternate runs of 0s and 1s,
starting with 0s (a mask starting with a 1 has a first count of 0). `encode` returns the
compressed form `{"size": [H, W], "counts": str}` (pycocotools' `mask.encode` with the counts
decoded as ASCII): each count, from the third on as the difference to the count two before,
in 5-bit groups, low first, 0x20 = more follows, + 48. `decode` reads both that and the
uncompressed form (counts as a list of ints).
"""

from __future__ import annotations

import numpy as np


def runs(mask: np.ndarray) -> list[int]:
    flat = np.asarray(mask, dtype=bool).ravel(order="F")
    if flat.size == 0:
        return [0]
    change = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    edges = np.concatenate([[0], change, [flat.size]])
    counts = np.diff(edges).tolist()
    return ([0] + counts) if flat[0] else counts


def counts_to_string(counts: list[int]) -> str:
    out = []
    for i, x in enumerate(counts):
        if i > 2:
            x -= counts[i - 2]
        more = True
        while more:
            c = x & 0x1F
            x >>= 5
            more = (x != -1) if (c & 0x10) else (x != 0)
            if more:
                c |= 0x20
            out.append(chr(c + 48))
    return "".join(out)


def string_to_counts(s: str) -> list[int]:
    counts: list[int] = []
    p = 0
    while p < len(s):
        x, k, more = 0, 0, True
        while more:
            c = ord(s[p]) - 48
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and (c & 0x10):
                x |= -1 << (5 * k)
        if len(counts) > 2:
            x += counts[-2]
        counts.append(x)
    return counts


def encode(mask: np.ndarray) -> dict:
    h, w = mask.shape
    return {"size": [int(h), int(w)], "counts": counts_to_string(runs(mask))}


def decode(rle: dict) -> np.ndarray:
    h, w = rle["size"]
    counts = rle["counts"]
    if isinstance(counts, str):
        counts = string_to_counts(counts)
    flat = np.zeros(h * w, dtype=bool)
    pos, val = 0, False
    for c in counts:
        if val:
            flat[pos:pos + c] = True
        pos += c
        val = not val
    if pos != h * w:
        raise ValueError(f"RLE counts sum to {pos}, not {h} x {w} = {h * w}")
    return flat.reshape((w, h)).T
