"""Exports a tiny split model whose dense network echoes its raw integer
inputs (tests/raw_inputs_e2e.rs checks what arrived, exactly).

The model (`schema.json`, format narsil-split-1, one FP32 table `items` of
1,000 rows, row i = [i, -i, 0.5, 1]):

  item        pooled sum over `items` (one id a row)
  query_time  a raw input per row                       -> raw[:, 0]
  user_time   a raw input, request-level                -> raw[:, 1]
  hist        a request-level sequence of at most 8 positions, keep "last",
              "request_rows": true; channels hist_ts (raw), hist_item
              (looked up in `items`), hist_act (raw)

Its dense network (`dense.pt`, TorchScript) takes Narsil's split signature
with raw inputs (docs/guide/split-models.md):

  forward(dense f32[R, 1], pooled f32[R, 4],
          seq0_values f32[P, 4], seq0_offsets i64[U + 1], seq0_row_unit i64[R],
          seq0_raw i64[P, 2], seq0_unit_rows i64[U], seq0_unit_raw i64[U, 2],
          raw i64[R, 2]) -> f32[20, R]

and returns, per row, values a float32 holds exactly: an int64 x as three
pieces, lo = x & (2^21 - 1), mid = (x >> 21) & (2^21 - 1), hi = x >> 42
(arithmetic; in [-2^21, 2^21)), so the test reassembles any int64 whole:

  qt_*         the row's query_time
  ut_*         the row's user_time
  last_ts_*    the row's unit's last hist_ts (0 for an empty history)
  first_act_*  the row's unit's first hist_act (0 for an empty history)
  seq_sum      sum over the unit's positions p (0-based) of
               (p + 1) * (hist_ts + 3 * hist_act): order and alignment
               (int64 arithmetic; exact in float32 for small values only)
  hist_items   sum of the unit's hist_item lookups' first values (its ids)
  unit_rows    the unit's request rows
  positions    the unit's positions
  item         the pooled item's first value (its id)
  unit_qt_*    the row's unit's query_time in seq0_unit_raw (its whole
               request's last row's)

Usage: models/export_raw_echo.py [--out DIR] [--force]
(scripts/test.sh exports it into models/generated/test-raw-echo.)
"""

import hashlib
import json
import sys
from pathlib import Path
from typing import List

import torch
from torch import nn

from export_common import begin_export, logger, parser, write_manifest

EXPORT_FORMAT = 2
ROWS, DIM, MAX_LEN = 1000, 4, 8
OUTPUTS = ["qt_lo", "qt_mid", "qt_hi", "ut_lo", "ut_mid", "ut_hi", "last_ts_lo", "last_ts_mid", "last_ts_hi",
           "first_act_lo", "first_act_mid", "first_act_hi", "seq_sum", "hist_items", "unit_rows", "positions",
           "item", "unit_qt_lo", "unit_qt_mid", "unit_qt_hi"]
log = logger("export_raw_echo")


class RawEcho(nn.Module):
    """The echo network (module docs)."""

    def pieces(self, x: torch.Tensor) -> List[torch.Tensor]:
        mask = (1 << 21) - 1
        return [torch.bitwise_and(x, mask).float(), torch.bitwise_and(x >> 21, mask).float(), (x >> 42).float()]

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor, seq0_values: torch.Tensor,
                seq0_offsets: torch.Tensor, seq0_row_unit: torch.Tensor, seq0_raw: torch.Tensor,
                seq0_unit_rows: torch.Tensor, seq0_unit_raw: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        positions = seq0_values.shape[0]
        units = seq0_offsets.shape[0] - 1
        lengths = seq0_offsets[1:] - seq0_offsets[:-1]
        unit_of = torch.repeat_interleave(torch.arange(units), lengths)
        local = torch.arange(positions) - seq0_offsets[:-1][unit_of]
        ts, act = seq0_raw[:, 0], seq0_raw[:, 1]
        weighted = (local + 1) * (ts + 3 * act)
        unit_sum = torch.zeros(units, dtype=torch.int64).index_add_(0, unit_of, weighted)
        unit_items = torch.zeros(units, dtype=torch.float32).index_add_(0, unit_of, seq0_values[:, 0])
        u = seq0_row_unit
        start, end = seq0_offsets[u], seq0_offsets[u + 1]
        held = end > start
        padded = torch.cat([seq0_raw, torch.zeros(1, 2, dtype=torch.int64)], 0)
        last = padded[torch.where(held, end - 1, torch.full_like(end, positions)), 0]
        first = padded[torch.where(held, start, torch.full_like(start, positions)), 1]
        columns = self.pieces(raw[:, 0]) + self.pieces(raw[:, 1]) + self.pieces(last) + self.pieces(first)
        columns += [unit_sum[u].float(), unit_items[u], seq0_unit_rows[u].float(), (end - start).float(),
                    pooled[:, 0] + 0.0 * dense[:, 0]]
        columns += self.pieces(seq0_unit_raw[u, 0])
        return torch.stack(columns, 0)


def check(network: torch.jit.ScriptModule) -> None:
    """One forward over a hand-made batch, every output as expected: two
    rows of one unit of 3 positions, one row of its own empty unit."""
    big = [-(2**63), -1, 2**63 - 1]
    offsets = torch.tensor([0, 3, 3])
    raw_seq = torch.tensor([[big[0], 5], [7, big[1]], [big[2], 2]])
    values = torch.tensor([[float(i), -float(i), 0.5, 1.0] for i in (4, 9, 11)])
    raw = torch.tensor([[big[0], big[2]], [big[1], 3], [12, big[0]]])
    out = network(torch.zeros(3, 1), torch.tensor([[6.0, 0, 0, 0]] * 3), values, offsets, torch.tensor([0, 0, 1]),
                  raw_seq, torch.tensor([5, 1]), torch.tensor([[13, 0], [12, 0]]), raw)

    def whole(lo: float, mid: float, hi: float) -> int:
        return (int(hi) << 42) + (int(mid) << 21) + int(lo)

    for row in range(3):
        got = [whole(*out[k:k + 3, row].tolist()) for k in (0, 3, 6, 9)]
        want = [raw[row, 0].item(), raw[row, 1].item(), big[2] if row < 2 else 0, 5 if row < 2 else 0]
        if got != want:
            raise SystemExit(f"the echo network's row {row} gave {got}, not {want}")
    if [whole(*out[17:20, row].tolist()) for row in range(3)] != [13, 13, 12]:
        raise SystemExit(f"the echo network's unit query times are wrong: {out[17:].tolist()}")
    if out[12:17, 2].tolist() != [0.0, 0.0, 1.0, 0.0, 6.0] or out[13:17, 0].tolist() != [24.0, 5.0, 3.0, 6.0]:
        raise SystemExit(f"the echo network's sums are wrong: {out[12:].tolist()}")


def main() -> int:
    p = parser(__doc__, "test-raw-echo", name="raw-echo")
    args = p.parse_args()
    out: Path = args.out
    started = begin_export(args, log, "schema.json", "dense.pt")
    if started is None:
        return 0
    network = torch.jit.script(RawEcho().eval())
    check(network)
    network.save(str(out / "dense.pt"))
    rows = torch.tensor([[float(i), -float(i), 0.5, 1.0] for i in range(ROWS)], dtype=torch.float32)
    (out / "tables").mkdir(exist_ok=True)
    table_bytes = rows.numpy().astype("<f4").tobytes()
    (out / "tables/items.bin").write_bytes(table_bytes)

    def feature(name: str, pooling: str, table: str = "") -> dict:
        spec = {"name": name, "pooling": pooling, "weighted": False}
        if table:
            spec["table"] = table
        return spec

    schema = {
        "format": "narsil-split-1", "name": args.name, "version": args.version, "num_dense": 1,
        "tables": [{"name": "items", "rows": ROWS, "dim": DIM, "storage": "fp32", "row_bytes": 4 * DIM,
                    "file": "tables/items.bin", "sha256": hashlib.sha256(table_bytes).hexdigest()}],
        "features": [feature("item", "sum", "items"), feature("query_time", "raw"), feature("user_time", "raw"),
                     feature("hist_ts", "raw"), feature("hist_item", "none", "items"), feature("hist_act", "raw")],
        "outputs": OUTPUTS,
        "dense_network": "dense.pt",
        "request_level": ["user_time", "hist_ts", "hist_item", "hist_act"],
        "sequences": [{"name": "hist", "features": ["hist_ts", "hist_item", "hist_act"], "max_len": MAX_LEN,
                       "keep": "last", "request_rows": True}],
    }
    (out / "schema.json").write_text(json.dumps(schema, indent=2) + "\n")
    fields = {"kind": "raw_echo", "name": args.name, "version": args.version}
    write_manifest(out, EXPORT_FORMAT, fields, ["schema.json", "dense.pt", "tables/items.bin"], started, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
