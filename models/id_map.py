"""Narsil's id map files, written from Python: how a split model's table
turns raw 64-bit ids (user, item, ad ids, hashes of strings) into its rows.

The format is Narsil's (crates/narsil-embedding/src/id_map.rs, module docs):
an open-addressing hash table with linear probing, little-endian:

  bytes 0..16   magic b"NARSIL-IDMAP-1\\n\\0"
  16..24        home_slots: the smallest power of two >= 2 * entries (>= 1)
  24..32        slots: >= home_slots (runs may spill past the last home
                slot; there is no wrap-around)
  32..40        entries
  40..48        rows of the table (every entry's row is below it)
  48..64        zero
  64..          slots of 16 bytes: raw id (two's complement u64), row (u64);
                an empty slot is raw 0, row u64::MAX

A raw id's home slot is fmix64(raw) & (home_slots - 1) (MurmurHash3's 64-bit
finalizer); entries are placed in (home, raw id) order, entry i at
max(home_i, slot of entry i-1 + 1). One set of (raw id, row) pairs thus
always gives the same bytes, so the file's SHA-256 (in schema.json) is the
map's identity, and Narsil's own writer (`narsil tables map`) gives the same
bytes for the same pairs.

  write_map(path, raw_ids, rows_of_ids, rows) -> sha256 hex
  map_bytes(raw_ids, rows_of_ids, rows) -> bytes
  lookup(raw_ids, ...) -> rows  (a reference lookup, for checks)
  mch_remapping(sorted, mapping, zch_index) -> (raw ids, rows, default
                row): TorchRec's MCHManagedCollisionModule remapping

As a command, writes a map from `RAW ROW` lines (decimal, one pair a line)
on stdin and prints its SHA-256:

  id_map.py OUT --rows N < pairs.txt
"""

import argparse
import hashlib
import sys
from pathlib import Path
from typing import Dict, Tuple

import numpy as np

MAGIC = b"NARSIL-IDMAP-1\n\0"
HEADER_BYTES = 64
SLOT_BYTES = 16
EMPTY = np.uint64(0xFFFF_FFFF_FFFF_FFFF)
I64_MAX = (1 << 63) - 1

_C1 = np.uint64(0xFF51_AFD7_ED55_8CCD)
_C2 = np.uint64(0xC4CE_B9FE_1A85_EC53)
_S33 = np.uint64(33)


def fmix64(keys: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer over a uint64 array (wrapping
    multiplication, as Narsil's `id_map::fmix64`)."""
    k = keys.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        k ^= k >> _S33
        k *= _C1
        k ^= k >> _S33
        k *= _C2
        k ^= k >> _S33
    return k


def home_slots_for(entries: int) -> int:
    """The home slots of a map of `entries` ids: the smallest power of two at
    least twice as many, at least 1."""
    n = max(1, 2 * entries)
    return 1 << (n - 1).bit_length()


def homes(raw_ids: np.ndarray, home_slots: int) -> np.ndarray:
    """Each raw id's home slot (int64)."""
    as_u64 = np.asarray(raw_ids, dtype=np.int64).view(np.uint64)
    return (fmix64(as_u64) & np.uint64(home_slots - 1)).astype(np.int64)


def map_bytes(raw_ids, rows_of_ids, rows: int) -> bytes:
    """The bytes of a map holding `raw_ids[i] -> rows_of_ids[i]` (any order)
    for a table of `rows` rows. Refuses a raw id given twice and rows past
    the table, naming them."""
    raw = np.asarray(raw_ids, dtype=np.int64).reshape(-1)
    row = np.asarray(rows_of_ids, dtype=np.int64).reshape(-1)
    if raw.shape != row.shape:
        raise ValueError(f"{raw.size} raw ids but {row.size} rows")
    bad = np.flatnonzero((row < 0) | (row >= rows))
    if bad.size:
        raise ValueError(f"raw id {raw[bad[0]]} maps to row {row[bad[0]]}, past the table's {rows} rows")
    home_slots = home_slots_for(raw.size)
    home = homes(raw, home_slots)
    order = np.lexsort((raw, home))  # by home slot, then raw id
    raw, row, home = raw[order], row[order], home[order]
    twice = np.flatnonzero((raw[1:] == raw[:-1]))
    if twice.size:
        raise ValueError(f"raw id {raw[twice[0]]} is given twice")
    # Entry i sits at max(home_i, slot_{i-1} + 1): slot_i = i + max over
    # j <= i of (home_j - j).
    index = np.arange(raw.size, dtype=np.int64)
    slot = np.maximum.accumulate(home - index) + index if raw.size else index
    slots = max(home_slots, int(slot[-1]) + 1 if raw.size else 0)
    body = np.zeros((slots, 2), dtype=np.uint64)
    body[:, 1] = EMPTY
    body[slot, 0] = raw.view(np.uint64)
    body[slot, 1] = row.astype(np.uint64)
    header = np.zeros(6, dtype="<u8")
    header[:4] = [home_slots, slots, raw.size, rows]
    return MAGIC + header.tobytes() + body.astype("<u8").tobytes()


def write_map(path: Path, raw_ids, rows_of_ids, rows: int) -> str:
    """Writes the map (map_bytes) to `path` (a fresh file: published maps
    are never rewritten in place) and returns its SHA-256, hex."""
    data = map_bytes(raw_ids, rows_of_ids, rows)
    path = Path(path)
    if path.exists():
        path.unlink()
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def read_map(data: bytes) -> Tuple[Dict[int, int], int]:
    """A map's pairs (raw id -> row) and its table's rows, read back (a
    reference reader for checks; Narsil checks every byte when it loads)."""
    if data[:16] != MAGIC:
        raise ValueError("not a Narsil id map")
    home_slots, slots, entries, rows = np.frombuffer(data[16:48], dtype="<u8").tolist()
    body = np.frombuffer(data[HEADER_BYTES:], dtype="<u8").reshape(slots, 2)
    held = body[:, 1] != EMPTY
    pairs = dict(zip(body[held, 0].view(np.int64).tolist(), body[held, 1].tolist()))
    if len(pairs) != entries:
        raise ValueError(f"header counts {entries} entries, slots hold {len(pairs)}")
    return pairs, rows


def lookup(data: bytes, raw_ids, default_row: int) -> np.ndarray:
    """Rows of `raw_ids` through the map in `data` (linear probing from each
    home slot, as Narsil looks them up), `default_row` for the ids it does
    not hold."""
    home_slots, slots = np.frombuffer(data[16:32], dtype="<u8").tolist()
    body = np.frombuffer(data[HEADER_BYTES:], dtype="<u8").reshape(slots, 2)
    raw = np.asarray(raw_ids, dtype=np.int64).reshape(-1)
    out = np.full(raw.size, default_row, dtype=np.int64)
    for i, (r, at) in enumerate(zip(raw.view(np.uint64).tolist(), homes(raw, home_slots).tolist())):
        while at < slots and body[at, 1] != EMPTY:
            if int(body[at, 0]) == r:
                out[i] = int(body[at, 1])
                break
            at += 1
    return out


def mch_remapping(sorted_raw_ids, remapped_ids_mapping, zch_index: int) -> Tuple[np.ndarray, np.ndarray, int]:
    """TorchRec's MCHManagedCollisionModule remapping (`_mch_remap` in
    torchrec/modules/mc_modules.py) as a map and a default row.

    TorchRec looks a raw id v up with `i = searchsorted(sorted[:-1], v)`
    (leftmost); v is a match when `sorted[i] == v`, and goes to
    `mapping[i]`; every other id goes to `zch_index` (the module's
    `output_global_offset + zch_size - 1`: its last row, which eviction
    never hands to an id). So:
      * every raw id the buffer holds (not the empty-slot filler
        INT64_MAX) maps to its row;
      * INT64_MAX itself always matches (the buffer's last entry is the
        filler): it goes to `mapping[searchsorted(sorted[:-1], INT64_MAX)]`,
        the row of the first empty slot (the default row once the table is
        full); held as an entry when that is not the default row;
      * the default row is `zch_index`: evicted and never-seen ids alike.
    Returns (raw ids, their rows, default row)."""
    raw = np.asarray(sorted_raw_ids, dtype=np.int64).reshape(-1)
    mapping = np.asarray(remapped_ids_mapping, dtype=np.int64).reshape(-1)
    if raw.size != mapping.size or raw.size == 0:
        raise ValueError(f"_mch_sorted_raw_ids ({raw.size}) and _mch_remapped_ids_mapping ({mapping.size}) differ")
    if np.any(raw[1:] < raw[:-1]):
        raise ValueError("_mch_sorted_raw_ids is not sorted")
    held = raw != I64_MAX
    keys, rows = raw[held], mapping[held]
    first = int(np.searchsorted(raw[:-1], I64_MAX, side="left"))
    max_row = int(mapping[first])
    if max_row != zch_index:
        keys, rows = np.append(keys, I64_MAX), np.append(rows, max_row)
    return keys, rows, int(zch_index)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the map file to write")
    p.add_argument("--rows", type=int, required=True, help="rows of the map's table")
    args = p.parse_args()
    pairs = [line.split() for line in sys.stdin if line.strip()]
    bad = next((i for i, pair in enumerate(pairs) if len(pair) != 2), None)
    if bad is not None:
        p.error(f"stdin line {bad + 1}: want RAW ROW, got {' '.join(pairs[bad])!r}")
    raws = np.array([int(raw) for raw, _ in pairs], dtype=np.int64)
    rows = np.array([int(row) for _, row in pairs], dtype=np.int64)
    try:
        print(write_map(args.out, raws, rows, args.rows))
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
