"""The files a split model's `schema.json` names, and a copy of them: what
every script that writes a model from another one (the benchmarks'
enlarged-table models, the GPU check's default-size model) copies, so that
what it writes loads as the source does. Also a file's hard link or copy
(`export_dlrm.py --publish`).

A split model names its files in these places (`SplitSchema` in
crates/narsil-embedding/src/schema/mod.rs reads them):

  * the dense network and its other forms: `dense_network`, the AOTInductor
    packages (`dense_package`, `dense_package_bf16`, `dense_package_int8`),
    the Burn backend's `dense_weights`;
  * the dense network's cut for ranking requests: `dense_bottom`,
    `dense_top` and its packages, `dense_user_once` (`network`, `package`,
    `package_bf16`);
  * per table: its `file`, its `layout`'s `slots` index, its id map
    (`ids.map.file`).

A schema string that names a file in the model's directory but is none of
these is refused by `copy_named_files`: a file the export learns to write
is then added here, not left behind by every copy. Standard library only
(the GPU check runs it with a bare python3).
"""

import json
import os
import shutil
from typing import Dict, Iterable, Iterator, List, Tuple

# Top-level keys whose value is a file, relative to the model directory.
FILE_KEYS = ("dense_network", "dense_package", "dense_package_bf16", "dense_package_int8", "dense_weights",
             "dense_bottom", "dense_top", "dense_top_package", "dense_top_package_bf16")
# `dense_user_once`'s keys whose value is a file.
USER_ONCE_FILE_KEYS = ("network", "package", "package_bf16")


def read_schema(model: str) -> dict:
    """`model/schema.json`, parsed."""
    with open(os.path.join(model, "schema.json")) as f:
        return json.load(f)


def _named(schema: dict) -> Iterator[Tuple[str, str]]:
    """(where in the schema, file) for every file the schema names."""
    for key in FILE_KEYS:
        if schema.get(key):
            yield key, schema[key]
    user_once = schema.get("dense_user_once") or {}
    for key in USER_ONCE_FILE_KEYS:
        if user_once.get(key):
            yield f"dense_user_once.{key}", user_once[key]
    for table in schema.get("tables", []):
        where = f"tables[{table.get('name')!r}]"
        if table.get("file"):
            yield f"{where}.file", table["file"]
        layout = table.get("layout") or {}
        if layout.get("slots"):
            yield f"{where}.layout.slots", layout["slots"]
        ids = table.get("ids")
        if isinstance(ids, dict) and isinstance(ids.get("map"), dict) and ids["map"].get("file"):
            yield f"{where}.ids.map.file", ids["map"]["file"]


def named_files(schema: dict, tables: bool = True) -> List[str]:
    """Every file `schema` names, relative to the model directory, once
    each, in schema order; without `tables`, all but the tables' own row
    files (their slot indexes and id maps stay)."""
    files: Dict[str, None] = {}
    for where, file in _named(schema):
        if tables or not (where.startswith("tables[") and where.endswith("].file")):
            files[file] = None
    return list(files)


def _strings(value, where: str = "") -> Iterator[Tuple[str, str]]:
    """(where, string) for every string anywhere in a JSON value."""
    if isinstance(value, str):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _strings(item, f"{where}[{i}]")


def unknown_files(schema: dict, model: str) -> List[Tuple[str, str]]:
    """(where, file) for every schema string that names a file in `model`
    which `named_files` does not list."""
    known = set(named_files(schema))
    return [(where, s) for where, s in _strings(schema)
            if s not in known and s != "schema.json" and os.path.isfile(os.path.join(model, s))]


def drop_packages(schema: dict) -> List[str]:
    """Removes from `schema` every AOTInductor package (compiled for the
    exporting CPU's vector ISA: not for a CUDA device nor another CPU);
    returns the keys removed."""
    dropped = [key for key in FILE_KEYS if "package" in key and schema.pop(key, None) is not None]
    user_once = schema.get("dense_user_once") or {}
    dropped += [f"dense_user_once.{key}" for key in USER_ONCE_FILE_KEYS
                if "package" in key and user_once.pop(key, None) is not None]
    return dropped


def copy_file(source: str, destination: str) -> None:
    """A copy of `source` at `destination`, written beside it and renamed
    into place (never a half copy under the final name)."""
    shutil.copy2(source, destination + ".partial")
    os.rename(destination + ".partial", destination)


def link_or_copy(source: str, destination: str) -> None:
    """A hard link to `source` at `destination`, or a copy where the two are
    on different file systems."""
    try:
        os.link(source, destination)
    except OSError:
        copy_file(source, destination)


def copy_named_files(source: str, out: str, schema: dict, skip: Iterable[str] = ()) -> List[str]:
    """Copies into `out` every file `schema` names from `source` but those in
    `skip` (files the caller writes itself), each under the same relative
    path, leaving one already in `out` as it is; returns the files copied.
    Copies, not links: a later export that rewrites the source's files in
    place leaves the copy as its schema describes it. Refuses a schema that
    names a file this module does not know, and a named file missing from
    `source`."""
    unknown = unknown_files(schema, source)
    if unknown:
        raise SystemExit(f"{source}/schema.json names {', '.join(f'{f} ({w})' for w, f in unknown)}, which "
                         f"models/model_files.py does not list: add its key there, or the copy leaves it behind")
    skip = set(skip)
    copied = []
    for file in named_files(schema):
        if file in skip:
            continue
        destination = os.path.join(out, file)
        if os.path.exists(destination):
            continue
        origin = os.path.join(source, file)
        if not os.path.isfile(origin):
            raise SystemExit(f"{origin}, which {source}/schema.json names, does not exist")
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        copy_file(origin, destination)
        copied.append(file)
    return copied
