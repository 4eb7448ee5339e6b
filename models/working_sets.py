"""The working sets the exporters declare for their dense networks
(`schema.json`'s and `narsil_schema()`'s `sequences[].working_set`): what
one forward allocates per request beyond its inputs, which Narsil's memory
bound charges before the request is queued (crates/narsil-core's
`working_set`; measured against these by benchmarks/working_set_peak.py).
"""

from typing import List


def hstu_working_set(block: int, heads: int, head_dim: int, contexts: int, model_dim: int) -> dict:
    """`HstuDenseNetwork`'s: block attention over each unit's tokens
    (`[pairs, heads, block, block]` scores, `[pairs, block, heads,
    head_dim]` gathers), FP32."""
    return {"kind": "block_attention", "block": block, "heads": heads, "head_dim": head_dim, "contexts": contexts,
            "model_dim": model_dim, "bytes_per_value": 4}


def din_working_set(dim: int, attention_arch: List[int], factored: bool) -> dict:
    """`DinDenseNetwork`'s (and `Din`'s, `factored` false): each row's
    history gathered, `[rows, longest, width]`. `width`: the values per
    (row, position) alive at once: the gathered history (2D) and, factored,
    the first layer's three partial sums and the product (2D); exact, the
    candidate broadcast, its difference or product with the history and
    their concatenation (at most 5 x 2D alive) and the first layer's output;
    the later layers' outputs, twice each (a layer and its activation).
    `position_width`: once per position, its values (2D) and, factored,
    their projection by the first layer."""
    history, first, rest = 2 * dim, attention_arch[0], sum(attention_arch[1:])
    if factored:
        width, position_width = 2 * history + 3 * first + 2 * rest + 1, history + first
    else:
        width, position_width = 5 * history + 2 * first + 2 * rest + 1, history
    return {"kind": "gather", "width": width, "position_width": position_width, "bytes_per_value": 4}
