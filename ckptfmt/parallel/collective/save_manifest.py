"""The manifest of a collective save, built the same on every rank from what the ranks
gathered: the declarations and plan (``Declared``), rank 0's entry order and values, and every
rank's file lists (``build_manifest``); and the sizes the plan fixes before any byte is written
(each rank's member data, where each of its files goes in it)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptfmt.dtypes import by_name
from ckptfmt.errors import UsageError
from ckptfmt.format.shard_io import Geometry, region_file_nbytes
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import (
    Entry,
    FileRef,
    GroupEntry,
    Manifest,
    PerRankValueEntry,
    RankInfo,
    Region,
    TensorEntry,
    ValueEntry,
)
from ckptfmt.manifest.values import decode_value, encode_value
from ckptfmt.parallel.collective.save_state import LocalState
from ckptfmt.plan.ownership import SavePlan, TensorPlan

Name = tuple[str, ...]


@dataclass
class Declared:
    """What every rank knows once the declarations are gathered and the plan is made, the same
    on every rank: what the manifest is built from."""

    info: list[dict[str, Any]]
    plan: SavePlan
    order_values: dict[str, Any]
    per_rank_values: dict[Name, list[Any]]
    save_id: str
    created: str
    step: int | None


def gathered_per_rank(info: list[dict[str, Any]]) -> dict[Name, list[Any]]:
    """Every rank's per-rank values by name; every rank must hold the same names in the same
    order (raises the same :class:`UsageError` on every rank otherwise)."""
    names0 = [n for n, *_ in info[0]["per_rank"]]
    for rank, i in enumerate(info):
        if [n for n, *_ in i["per_rank"]] != names0:
            raise UsageError(
                f"rank {rank}'s per-rank values are not those of rank 0 (same names, same order)"
            )
    return {tuple(n): [i["per_rank"][k][1:] for i in info] for k, n in enumerate(names0)}


def check_rank0_declares_all(plan: SavePlan, info: list[dict[str, Any]]) -> None:
    """Rank 0 orders the manifest: it must know every tensor (the same verdict everywhere)."""
    held_by_0 = {tuple(d["name"]) for d in info[0]["decl"]}
    missing = [t.name for t in plan.tensors if t.name not in held_by_0]
    if missing:
        shown = ", ".join("/".join(n) for n in missing[:5])
        raise UsageError(f"rank 0 does not declare tensor(s) {shown}")


def geometry_of(t: TensorPlan) -> Geometry:
    return Geometry("/".join(t.name), by_name(t.dtype).numpy, t.shape, t.shard_shape, t.chunk_shape)


def planned_member_bytes(plan: SavePlan, world_size: int) -> list[int]:
    """Every rank's member data size (its files' bytes) as the plan fixes it."""
    sizes = [0] * world_size
    for t in plan.tensors:
        geo = geometry_of(t)
        for r in t.regions:
            sizes[r.writer] += sum(region_file_nbytes(geo, r.offset, r.shape))
    return sizes


def member_slices(
    skeleton: Manifest,
    rank: int,
    jobs_by_region: list[tuple[TensorPlan, Any, list[Any]]],
    member: np.ndarray | None,
) -> list[np.ndarray | None] | None:
    """Where in ``member`` (this rank's member data: its files in manifest order, the order of
    ``redundancy.record.member_files``) each job's file goes, in the order of the jobs."""
    if member is None:
        return None
    jobs_at = {("/".join(t.name), tuple(r.offset)): jobs for t, r, jobs in jobs_by_region}
    slot: dict[int, np.ndarray] = {}
    at = 0
    for t in skeleton.tensors():
        for r in t.regions:
            if r.rank != rank:
                continue
            for job in jobs_at[(t.path, tuple(r.offset))]:
                size = job.nbytes()
                slot[id(job)] = member[at : at + size]
                at += size
    return [slot[id(j)] for _, _, jobs in jobs_by_region for j in jobs]


def order_and_values(local: LocalState) -> dict[str, Any]:
    """Rank 0's entry order and JSON values, as broadcast to every rank."""
    return {
        "order": [[list(n), kind] for n, kind in local.order],
        "values": [[list(n), encode_value(v, display(n))] for n, v in local.values.items()],
    }


def build_manifest(
    d: Declared, all_refs: list[Any] | None, writer: dict[str, Any], levels: dict[str, Any]
) -> Manifest:
    """The same manifest on every rank: tensors from the plan and the gathered file lists
    (``None``: a skeleton without files, enough for the zarr documents), values and order from
    rank 0."""
    plan, order_values, per_rank_values = d.plan, d.order_values, d.per_rank_values
    values = {
        tuple(n): decode_value(copy.deepcopy(v), nf, display(n))  # decode_value fills in place
        for n, (v, nf) in order_values["values"]
    }
    files_at: dict[tuple[str, tuple[int, ...]], tuple[FileRef, ...]] = {}
    for rank_refs in all_refs or []:
        for path, regions in rank_refs.items():
            for offset, files in regions:
                # a file is [path, size, crc32c] and, when the save hashes, its content hash
                files_at[(path, tuple(offset))] = tuple(FileRef(*f[:3]) for f in files)
    plans = {t.name: t for t in plan.tensors}
    entries: list[Entry] = []
    for n, kind in order_values["order"]:
        name = tuple(n)
        if kind == "group":
            entries.append(GroupEntry(name))
        elif kind in ("list", "tuple"):
            entries.append(GroupEntry(name, kind))
        elif kind == "value":
            entries.append(ValueEntry(name, values[name]))
        elif kind == "per_rank_value":
            shown = display(name)
            entries.append(
                PerRankValueEntry(
                    name,
                    tuple(
                        decode_value(copy.deepcopy(v), nf, shown) for v, nf in per_rank_values[name]
                    ),
                )
            )
        else:
            t = plans[name]
            path = "/".join(name)
            regions = tuple(
                Region(r.offset, r.shape, r.writer, files_at.get((path, r.offset), ()))
                for r in t.regions
            )
            entries.append(
                TensorEntry(
                    name,
                    path,
                    t.dtype,
                    t.shape,
                    t.shard_shape,
                    t.chunk_shape,
                    regions,
                    per_rank=kind == "per_rank_tensor",
                    encoding=kind if kind in ("bytes", "pickle") else None,
                )
            )
    missing = set(plans) - {e.name for e in entries if isinstance(e, TensorEntry)}
    if missing:
        raise UsageError(f"tensors held by other ranks but not by rank 0: {sorted(missing)}")
    return Manifest(
        save_id=d.save_id,
        step=d.step,
        created=d.created,
        world_size=len(d.info),
        ranks=tuple(RankInfo(r, i["node"]) for r, i in enumerate(d.info)),
        entries=tuple(entries),
        levels=levels,
        writer=writer,
    )
