"""The collective save and load of one checkpoint by every rank (``spec/PROTOCOL.md`` §2).

``save_collective`` (every rank calls it, with its own state and its own destination path):

1. each rank checks its state and declares what it holds; ``allgather`` of the declarations
   (with rank 0's entry order and values);
2. every rank computes the same plan (``plan.make_plan``): who writes which regions; a caller
   saving the same layout again passes a ``plan.cache.PlanCache``, which plans it once;
3. ranks writing to the same directory form a group (one per node for node-local storage, one
   for shared storage); each group's leader (its lowest rank) creates the staging directory;
   barrier;
4. each rank writes its regions' shard files into its group's staging directory;
5. vote: if any rank failed, every leader removes its staging directory and every rank raises;
6. ``allgather`` of every rank's file list; every rank builds the same manifest;
7. each leader writes the zarr metadata documents and the manifest into its staging directory
   and commits it (fsync, rename, fsync parent); a last vote says whether every group committed.

So every group's directory holds the whole manifest and metadata and the files its own ranks
wrote. ``load_collective`` reads them back: a rank reads the regions written in its own group
itself and receives the others from their writers over the ``Comm`` (on node-local storage no
rank can see another node's directory).

This module runs the phases; what they rest on has a module each: the check of one rank's state
(``save_state``), the manifest every rank builds the same (``save_manifest``), the step's
directories and the commit vote (``publish``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ckptfmt.container.metadata import ManifestMeta, utc_now, write_metadata, writer_info
from ckptfmt.container.reader import read_manifest
from ckptfmt.engine.encode import (
    SetLayout,
    base_parity,
    data_buffer,
    encode_collective,
    link_parity,
    make_record,
    member_sets,
    plan_set,
    reserve_buffers,
)
from ckptfmt.errors import SaveFailedError as SaveFailedError  # re-exported
from ckptfmt.errors import StorageFullError, UsageError, level_name
from ckptfmt.format import incremental as inc
from ckptfmt.format.options import WriteOptions
from ckptfmt.format.shard_io import plan_region, run_jobs
from ckptfmt.manifest.codec import dump_manifest
from ckptfmt.manifest.limits import display
from ckptfmt.manifest.model import Manifest
from ckptfmt.manifest.values import encode_value
from ckptfmt.parallel.collective.boundary import Boundary
from ckptfmt.parallel.collective.publish import (
    FaultHook,
    groups_of,
    level_directory,
    publish_commit,
)
from ckptfmt.parallel.collective.save_manifest import (
    Declared,
    build_manifest,
    check_rank0_declares_all,
    gathered_per_rank,
    geometry_of,
    member_slices,
    order_and_values,
    planned_member_bytes,
)
from ckptfmt.parallel.collective.save_state import LocalState, check_state, region_data
from ckptfmt.plan.cache import PlanCache
from ckptfmt.plan.ownership import Holding, SavePlan, make_plan
from ckptfmt.redundancy.config import Redundancy
from ckptfmt.redundancy.record import member_files
from ckptfmt.storage.pools import writer_pool
from ckptfmt.storage.progress import current_meter
from ckptfmt.storage.store.base import Draft, Store, StoreBase
from ckptfmt.storage.store.directory import DirectoryDraft, DirectoryStore
from ckptfmt.transport.comm import Comm

log = logging.getLogger("ckptfmt")


def save_collective(
    comm: Comm,
    state: Mapping[str, Any],
    path: str | os.PathLike[str] | Store,
    *,
    step: int | None,
    node: str,
    write: WriteOptions = WriteOptions(),
    meta: ManifestMeta = ManifestMeta(),
    group: str | None = None,
    fault: FaultHook | None = None,
    redundancy: Redundancy | None = None,
    seq: int | None = None,
    failure: BaseException | None = None,
    base: str | os.PathLike[str] | StoreBase | None = None,
    report: dict[str, Any] | None = None,
    plans: PlanCache | None = None,
) -> tuple[Manifest, SavePlan]:
    """Collective: every rank of ``comm`` calls it, once per checkpoint, with its own ``state``
    and the store it writes to (``path``: a directory, this rank's node-local copy or the
    shared one; or any ``storage.store.Store``: a bucket prefix, memory). Returns the manifest
    (the same on every rank) and the plan. Every rank writes its files into its group's draft
    of the store (``Draft.set``: a file in the staging directory, an object put straight from
    the arrays' memory), and each group's leader commits it with the store's commit (a rename;
    the commit object).

    Ranks with the same ``group`` key see the same store (default: the store's ``group``: a
    directory's absolute path, a bucket's URL; on a cluster, node-local paths are equal strings
    on different nodes, so the caller passes the node for level 1 and one key for the shared
    level).

    With ``redundancy`` (level-1 saves), once every rank's data files are written the ranks
    encode it across the nodes (``ckptfmt/engine/encode.py``), each writing its parity file into its
    own staging directory, and the manifest records it under ``levels["1"]["redundancy"]``.

    Values (non-tensor leaves) are taken from rank 0; every rank must have the same names.

    Errors: any exception on any rank, in any phase, is voted on
    (``parallel/collective/boundary.py``): every rank raises :class:`SaveFailedError` naming each
    failing rank's error, every staging directory is removed, and nothing is committed anywhere (a
    step already renamed into place on some node is rolled back). ``failure``: this rank failed
    before the save (staging the state); it takes part in the first vote only, which fails the save
    everywhere. ``seq``: the caller's call number, checked by every vote like the step.

    ``base`` (this rank's view of a committed checkpoint, like ``path``: its node-local copy or
    the shared one): an incremental save. Each rank hashes the content of every file it writes
    (``format/incremental.py``) and hard-links the base's file at the same path instead of
    writing it when the base's manifest records the same content; the result is a complete
    checkpoint like any other. Into a bucket, ``base`` is a ``StoreBase`` (the checkpoint at
    another prefix of the same bucket, ``storage.store.incremental_base``): an unchanged file is
    copied by the store from the base's object (a server-side copy) instead of put; every rank
    reads the base's commit object and manifest in the stage phase, before anything is put.
    Hashes are recorded in the manifest's ``writer`` (also with
    ``write.content_hash`` and no base). A base that is not a committed checkpoint fails the
    save. ``report``: filled with this rank's tallies (``linked_bytes``, ``written_bytes``,
    ``linked_files``, ``unlinkable``: files written because the file system refused a link;
    with redundancy ``parity_linked_bytes``, ``parity_written_bytes``) and the job's
    (``job_linked_bytes``, ``job_written_bytes``, ``job_parity_linked_bytes``).

    With ``base`` and ``redundancy`` a set whose every member's data is the base's byte for
    byte, under the base's redundancy layout, takes the base's parity files (hard links) and
    skips its encode (``_Save.reuse_parity``); any other set encodes as a full save does.

    ``plans``: where the plan of this layout may already be (made by an earlier save, or by the
    manager's staging for the same declarations) and where it is kept for the next save; the
    plan is the same either way (``plan/cache.py``: a plan is kept by everything it depends on),
    so each rank may pass its own cache, or none.
    """
    store = path if isinstance(path, Store) else DirectoryStore(path)
    run = _Save(comm, state, store, step, node, write, meta, fault, seq, failure)
    run.plans = plans
    if isinstance(base, StoreBase):
        run.in_store = base
    elif base is not None:
        run.base = Path(base).absolute()
    run.hashing = run.base is not None or run.in_store is not None or write.content_hash
    run.declare(group)
    run.plan(redundancy)
    run.stage()
    refs, parity = run.write()
    manifest = run.manifest(refs, parity)
    publish_commit(run.b, run.is_leader, run.draft, write.fsync, run.hook)
    mine = run.tallies[comm.rank] if len(run.tallies) == comm.size else None
    if mine is not None and mine["unlinkable"]:
        log.warning(
            "incremental save to %s: %d unchanged file(s) written, not linked from %s (the file "
            "system refused a hard link: %s)",
            run.final,
            mine["unlinkable"],
            run.base,
            mine["unlinkable_example"],
        )
    if report is not None and run.tallies:
        report.update(run.tallies[comm.rank])
        report["job_linked_bytes"] = sum(t["linked_bytes"] for t in run.tallies)
        report["job_written_bytes"] = sum(t["written_bytes"] for t in run.tallies)
        report["job_parity_linked_bytes"] = sum(
            t.get("parity_linked_bytes", 0) for t in run.tallies
        )
    return manifest, run.plan_


class _Save:
    """One rank's side of one :func:`save_collective`, phase by phase. Each phase is local work
    under the boundary's guard (``parallel/collective/boundary.py``) and a vote; every rank calls
    the phases in this order: :meth:`declare`, :meth:`plan`, :meth:`stage`, :meth:`write` (with
    the encode when there is redundancy), :meth:`manifest`, then ``publish_commit``."""

    def __init__(
        self,
        comm: Comm,
        state: Mapping[str, Any],
        store: Store,
        step: int | None,
        node: str,
        write: WriteOptions,
        meta: ManifestMeta,
        fault: FaultHook | None,
        seq: int | None,
        failure: BaseException | None,
    ) -> None:
        self.comm, self.state, self.store, self.node = comm, state, store, node
        self.final = Path(store.where)  # for messages (a URL's never name a full disk)
        self.step, self.write_options, self.meta = step, write, meta
        self.hook: FaultHook = fault or (lambda _point: None)
        self.b = Boundary(comm, "save", step, seq=seq, failure=failure)
        self.local = LocalState([], {}, {})
        self.layout: SetLayout | None = None
        self.member: np.ndarray | None = None
        self.redundancy: Redundancy | None = None
        self.base: Path | None = None  # a directory's base: its files hard-linked
        self.in_store: StoreBase | None = None  # a bucket's: its objects copied by the store
        self.base_manifest: Manifest | None = None
        self.any_base = False  # some rank saves against a base: the parity reuse round runs
        self.hashing = False
        self.hash_name = inc.algorithm()
        self.tallies: list[dict[str, Any]] = []
        self.plans: PlanCache | None = None
        self.written: list[Any] = []  # every writer's Draft.written(), for the committer

    def declare(self, group: str | None) -> None:
        """Collective (one vote): check this rank's state and gather every rank's declarations
        (what it holds, its per-rank values, its directory and group, its node); rank 0's save
        id and time are everyone's, and so are its entry order and values (the manifest's).
        Ranks with the same ``group`` key share a directory and a leader (its lowest rank),
        which makes the staging directory and commits it."""
        b, comm = self.b, self.comm
        decl: list[Any] = []
        per_rank: list[Any] = []
        order_values: dict[str, Any] | None = None
        with b.guard("declare"):
            if not b.failed:
                self.local = check_state(self.state, comm.rank, comm.size)
                decl = [h.to_json() for h in self.local.holdings()]
                per_rank = [
                    [list(n), *encode_value(v, display(n))]
                    for n, v in self.local.per_rank_values.items()
                ]
                if comm.rank == 0:
                    order_values = order_and_values(self.local)
            self.hook("declared")
        self.info = b.vote(
            "declare",
            {
                "decl": decl,
                "per_rank": per_rank,
                "path": self.store.where,
                "group": group if group is not None else self.store.group,
                "node": self.node,
                "save_id": self.meta.save_id or os.urandom(16).hex(),
                "created": self.meta.created or utc_now(),
                "hash": inc.algorithm(),
                "base": self.base is not None,
                "order_values": order_values,
            },
        )
        # one content hash for the whole job: ISA-L's CRC-64 only where every rank has it
        names = {i["hash"] for i in self.info}
        self.hash_name = names.pop() if len(names) == 1 else "blake2b-64"
        leaders = groups_of([i["group"] for i in self.info])
        self.is_leader = leaders[comm.rank] == comm.rank
        self.save_id: str = self.info[0]["save_id"]  # rank 0's proposal, the same everywhere
        self.draft: Draft = self.store.join(self.save_id)  # the leader's is prepared in stage
        self.mine_staging = self.draft.abort if self.is_leader else None
        self.nodes = [i["node"] for i in self.info]
        self.any_base = any(i["base"] for i in self.info)

    def plan(self, redundancy: Redundancy | None) -> None:
        """Local: every rank makes the same plan from the gathered declarations (or finds it
        in :attr:`plans`, made for the same layout), so a usage error found here fails every
        rank alike (voted on with the staging)."""
        b, write = self.b, self.write_options
        self.redundancy = redundancy
        with b.guard("plan"):
            per_rank_values = gathered_per_rank(self.info)
            decls = [i["decl"] for i in self.info]
            if self.plans is not None:
                self.plan_ = self.plans.plan(decls, write.chunk_bytes, write.shard_bytes)
            else:
                self.plan_ = make_plan(
                    [[Holding.from_json(d) for d in decl] for decl in decls],
                    write.chunk_bytes,
                    write.shard_bytes,
                )
            check_rank0_declares_all(self.plan_, self.info)
            self.declared = Declared(
                self.info,
                self.plan_,
                self.info[0]["order_values"],
                per_rank_values,
                self.save_id,
                self.info[0]["created"],
                self.step,
            )

    def stage(self) -> None:
        """Collective (a vote): the leaders make their staging directories and write the zarr
        documents into them (they depend on the plan alone, so that only the manifest and the
        rename remain once every rank has written); with redundancy, every rank reserves its
        buffers. Every leader has a staging directory, or nobody goes on (none is left)."""
        b = self.b
        with b.guard("stage"), level_directory(self.final, self.meta.levels):
            if not b.failed:
                self.skeleton = build_manifest(self.declared, None, {}, {})
                if self.redundancy is not None:  # the same on every rank
                    sizes = planned_member_bytes(self.plan_, self.comm.size)
                    self.layout = plan_set(self.redundancy, self.nodes, sizes, self.comm.rank)
                    reserve_buffers(self.layout)
                    self.member = data_buffer(self.layout)
                if self.in_store is not None:  # not a checkpoint: fail before anything is put
                    self.in_store.manifest()
                if self.is_leader:
                    self.draft = self.store.prepare(self.save_id, self.write_options.overwrite)
                    self.mine_staging = self.draft.abort
                    write_metadata(
                        self.draft, self.skeleton, self.write_options.fsync, like=self.base
                    )
        b.vote("stage", cleanup=self.mine_staging)

    def write(self) -> tuple[list[Any], list[Any]]:
        """Collective (the encode's exchanges, then a vote that gathers every rank's file list
        and parity record): this rank writes its regions' shard files into its group's staging
        directory, with a node's thread budget shared by the ranks on it; with redundancy the
        ranks encode across the nodes, each writing its parity file."""
        b, comm, write = self.b, self.comm, self.write_options
        refs: dict[str, list[list[Any]]] = {}
        tally: dict[str, Any] | None = None
        levels = self.meta.levels
        with (
            b.guard("write"),
            _storage_context(self.final, levels, self.plan_, comm.rank, comm.size),
        ):
            self.hook("staged")
            incremental = self._incremental() if self.hashing else None
            jobs_by_region = []
            for t, r in self.plan_.for_rank(comm.rank):
                data = region_data(self.local, t, r.offset, r.shape)
                jobs = plan_region(self.draft, geometry_of(t), data, r.offset)
                jobs_by_region.append((t, r, jobs))
            all_jobs = [j for _, _, jobs in jobs_by_region for j in jobs]
            into = member_slices(self.skeleton, comm.rank, jobs_by_region, self.member)
            on_node = sum(1 for i in self.info if i["node"] == self.node)
            workers = max(1, write.threads // on_node, self.draft.writes_in_flight)
            pool = writer_pool(workers) if workers > 1 else None
            files = iter(run_jobs(all_jobs, pool, write.fsync, into, incremental))
            digests = incremental.digests if incremental is not None else {}
            for t, r, jobs in jobs_by_region:
                refs.setdefault("/".join(t.name), []).append(
                    [
                        list(r.offset),
                        [
                            [f.path, f.size, f.crc32c, *([digests[f.path]] if digests else [])]
                            for f in (next(files) for _ in jobs)
                        ],
                    ]
                )
            tally = incremental.report() if incremental is not None else None
            self.hook("written")
        parity: dict[str, Any] | None = None
        if self.layout is not None and self.member is not None:  # the vote carries the parity
            with b.guard("encode"):
                parity = self.reuse_parity(refs) if self.any_base else None
                if parity is None:
                    parity = encode_collective(
                        comm,
                        self.layout,
                        self.member,
                        self._local_dir(),
                        write.fsync,
                        failed=b.failed,
                        in_place=isinstance(self.draft, DirectoryDraft) and self.draft.in_place,
                    )
                    if tally is not None and parity is not None:
                        tally["parity_written_bytes"] = parity["size"]
                elif tally is not None:
                    tally["parity_linked_bytes"] = parity["size"]
                self.hook("encoded")
        payload: dict[str, Any] = {"refs": refs, "parity": parity, "tally": tally}
        written = self.draft.written() if not b.failed else []
        if written:  # what the committer lists (a bucket's objects), from every writer
            payload["objects"] = written
        gathered = b.vote("write", payload, cleanup=self.mine_staging)
        self.tallies = [g["tally"] for g in gathered if g["tally"] is not None]
        self.written = [g["objects"] for g in gathered if "objects" in g]
        return [g["refs"] for g in gathered], [g["parity"] for g in gathered]

    def reuse_parity(self, refs: dict[str, list[list[Any]]]) -> dict[str, Any] | None:
        """Collective (one ``allgather``, every rank, when some rank saves against a base): the
        base's parity file of this rank, hard-linked into the staging directory, when every
        member of this rank's set could link its own, else None (the caller encodes; a link
        made here is then removed). A rank links its base parity file when its own member
        data is the base's byte for byte (:meth:`_member_unchanged`) and the base's record
        gives its set this save's layout (``engine.encode.base_parity``); the gathered answers
        (the base's save id, or no) make every member of a set decide the same, so a set either
        skips its exchange on every member, when all of them link from one save, or runs it on
        every member. Reuse is per set: each parity file is a function of (nearly) every
        member's data, so one changed member changes them all. Never raises
        before the ``allgather`` (a rank missing from it would hang the job): any doubt is a
        no, and the set encodes."""
        assert self.layout is not None
        linked: dict[str, Any] | None = None
        staging: Path | None = None
        try:
            if not self.b.failed and self.base is not None and self.base_manifest is not None:
                staging = self._local_dir()
                found = base_parity(self.layout, self.base_manifest, self.comm.rank)
                if found is not None and self._member_unchanged(refs):
                    linked = link_parity(staging, self.base, found)
        except Exception as exc:  # any doubt: encode as a full save does
            log.debug("parity of rank %d not reused: %s", self.comm.rank, exc)
            linked = None
        # each rank's answer is the save its parity file would come from (None: no): the
        # members of a set may link only from one save (each node names its own base, and a
        # parity file of one save covers that save's data of the other members, not another's)
        mine = self.base_manifest.save_id if linked is not None and self.base_manifest else None
        answers = self.comm.allgather_json(mine)
        same = mine is not None and all(answers[r] == mine for r in self.layout.members)
        if linked is not None and same:
            current_meter().add(int(linked["size"]), "parity")
            return linked
        if linked is not None and staging is not None:
            # the encode writes a new file (O_EXCL: never through this link); should the link
            # outlive this, that write fails after the exchange and the save's vote with it
            with contextlib.suppress(OSError):
                (staging / linked["path"]).unlink()
        return None

    def _member_unchanged(self, refs: dict[str, list[list[Any]]]) -> bool:
        """Whether this rank's member data (its files whole, in manifest order) is the base's:
        the same files in the same order, each with the same tensor geometry, size, CRC32C and
        content hash (both of this save's algorithm)."""
        base = self.base_manifest
        recorded = inc.hashes_of(base) if base is not None else None
        if base is None or recorded is None or recorded[0] != self.hash_name:
            return False
        digest = {f.path: h for (_, f), h in zip(base.files(), recorded[1])}
        before = [
            (f.path, _geo(t), f.size, f.crc32c, digest[f.path])
            for t, f in member_files(base, self.comm.rank)
        ]
        written = {
            (name, tuple(offset)): files
            for name, regions in refs.items()
            for offset, files in regions
        }
        now = [
            (f[0], _geo(t), f[1], f[2], f[3] if len(f) > 3 else None)
            for t in self.skeleton.tensors()
            for r in t.regions
            if r.rank == self.comm.rank
            for f in written[(t.path, tuple(r.offset))]
        ]
        return now == before

    def _local_dir(self) -> Path:
        """The draft's directory, for the parity files of a level-1 save (node-local disks)."""
        if self.draft.path is None:
            raise UsageError(
                f"redundancy applies to a save into node-local directories, not {self.store.where}"
            )
        return self.draft.path

    def _incremental(self) -> inc.Incremental:
        """This rank's hashing (and, with a base, linking) for the files it writes: the base's
        manifest read from this rank's view of it (a node's copy holds the whole manifest)."""
        if self.in_store is not None:
            in_store = self.in_store
            found = inc.Incremental(
                name=self.hash_name, copy_in_store=lambda rel: in_store.copy(self.draft, rel)
            )
            self.base_manifest = in_store.manifest()
            found.base = inc.base_files(self.base_manifest, self.hash_name)
            return found
        if self.base is None:
            return inc.Incremental(name=self.hash_name)
        found = inc.Incremental(name=self.hash_name, base_root=self.base)
        self.base_manifest = read_manifest(self.base)
        found.base = inc.base_files(self.base_manifest, self.hash_name)
        return found

    def manifest(self, refs: list[Any], parity: list[Any]) -> Manifest:
        """Collective (a vote): every rank builds the same manifest from the gathered file
        lists (and the redundancy record from the parity records); the leaders stage it. Every
        node's manifest is staged before any node's step becomes visible."""
        b = self.b
        manifest = self.skeleton
        with b.guard("manifest"):
            writer = self.meta.writer or writer_info()
            manifest = build_manifest(self.declared, refs, writer, self.meta.levels or {})
            if self.hashing:
                digests = _digests(refs)
                writer = inc.with_hashes(
                    writer, self.hash_name, [digests[f.path] for _, f in manifest.files()]
                )
                manifest = dataclasses.replace(manifest, writer=writer)
            if self.redundancy is not None:
                sets = member_sets(self.redundancy, self.nodes)
                record = make_record(self.redundancy, manifest, sets, parity)
                new_levels = dict(manifest.levels)
                new_levels["1"] = {**dict(new_levels.get("1", {})), "redundancy": record.to_json()}
                manifest = dataclasses.replace(manifest, levels=new_levels)
            self.hook("manifest")
            data = dump_manifest(manifest)  # on every rank: a manifest too big fails them all
            if self.is_leader:
                if isinstance(self.draft, DirectoryDraft):  # a recycled step's leftovers
                    self.draft.sweep(manifest)
                self.draft.stage_manifest(data, self.written, self.write_options.fsync)
        b.vote("manifest", cleanup=self.mine_staging)
        return manifest


def _geo(t: Any) -> tuple[Any, ...]:
    """A tensor entry's geometry: what fixes its files' layout besides their content."""
    return (t.dtype, tuple(t.shape), tuple(t.shard_shape), tuple(t.chunk_shape))


def _digests(refs: list[Any]) -> dict[str, str]:
    """Every file's content hash from the gathered file lists (``[path, size, crc, hash]``)."""
    return {
        f[0]: f[3]
        for rank_refs in refs
        for regions in rank_refs.values()
        for _, files in regions
        for f in files
    }


@contextmanager
def _storage_context(
    final: Path, levels: dict[str, Any] | None, plan: SavePlan, rank: int, size: int
) -> Iterator[None]:
    """A full disk while writing is reported with what the save knows and a file write does
    not: the level, the checkpoint's directory and the bytes this rank's save needed."""
    try:
        yield
    except StorageFullError as exc:
        needed = planned_member_bytes(plan, size)[rank]
        level = level_name(next(iter(levels or {}), None))
        raise exc.with_context(level=level, needed=needed, path=str(final.parent)) from exc
