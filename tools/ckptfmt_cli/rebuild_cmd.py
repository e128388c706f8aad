"""``ckptfmt rebuild``: repair a level-1 checkpoint offline from its redundancy.

Only :func:`ckptfmt.maintenance.repair.rebuild` does the work (reading every member's data and
parity,
planning, rebuilding set by set, writing atomically); this module turns the command line into its
argument and its report (or :class:`UnrecoverableDamageError`) into text, JSON and an exit status.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from ckptfmt import WriteOptions
from ckptfmt.errors import UnrecoverableDamageError
from ckptfmt.maintenance import RepairReport, rebuild
from ckptfmt.manifest import MANIFEST_NAME
from ckptfmt.storage import Location, parse_location
from ckptfmt_cli import render
from ckptfmt_cli.exits import ExitStatus, help_epilog, one_line
from ckptfmt_cli.hints import lost_for_real
from ckptfmt_cli.summary import human_bytes

REBUILD_EXITS = (
    "\b\nFor rebuild:\n"
    "  0    healthy afterwards: repaired, or nothing to do (the output says which);\n"
    "       with --dry-run: the repair would succeed\n"
    "  1    damaged beyond what the redundancy rebuilds (the output names the ranks, nodes\n"
    "       and tensors lost); nothing was written\n"
    "  3    no directory holds a readable copy of the checkpoint\n"
)


PHASES = {"check": "checking", "rebuild": "rebuilding"}  # the bar's label in each phase


def node_spec(path: str | None, nodes: Sequence[str]) -> Location:
    """PATH (a ``{node}`` template, one directory, or the URL of a checkpoint in a bucket, which
    verify and inspect read there) or the ``--node NAME=DIR`` pairs, never both, parsed
    (``ckptfmt.storage.parse_location``: a URL of another scheme is refused);
    :class:`click.UsageError` (exit status 2) without one or with both."""
    if path is not None and nodes:
        raise click.UsageError("give PATH or --node NAME=DIR, not both")
    if path is None and not nodes:
        raise click.UsageError("give PATH (a {node} template or a directory) or --node NAME=DIR")
    if path is not None:
        return parse_location(path)
    mapping: dict[str, str] = {}
    for item in nodes:
        name, sep, where = item.partition("=")
        if not sep or not name or not where:
            raise click.BadParameter(f"{item!r} is not NAME=DIR", param_hint="--node")
        if name in mapping:
            raise click.BadParameter(f"node {name!r} given twice", param_hint="--node")
        mapping[name] = where
    return parse_location(mapping)


def report_json(report: RepairReport, dry_run: bool) -> dict[str, Any]:
    status = "repairable" if dry_run else "repaired"
    return {
        "path": report.where,
        "status": status if report.repaired else "healthy",
        "dry_run": dry_run,
        "step": report.step,
        "scheme": report.scheme,
        "lost_data_ranks": report.lost_data,
        "lost_parity_ranks": report.lost_parity,
        "lost_nodes": report.lost_nodes,
        "damaged_metadata": report.metadata,
        "notes": report.notes,
        "recreated": report.recreated,
        "files_written": report.files_written,
        "bytes_read": report.bytes_read,
        "seconds": round(report.seconds, 6),
    }


def unrecoverable_json(
    exc: UnrecoverableDamageError, dry_run: bool, lost: Sequence[str] | None = None
) -> dict[str, Any]:
    return {
        "path": exc.path,
        "status": "unrecoverable",
        "dry_run": dry_run,
        "reason": exc.reason,
        "lost_ranks": list(exc.lost_ranks),
        "lost_nodes": list(exc.nodes),
        "lost_tensors": list(exc.tensors if lost is None else lost),
        "written": False,
    }


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def report_text(report: RepairReport, dry_run: bool) -> list[str]:
    where = f"{report.where} (step {'none' if report.step is None else report.step}"
    where += f", {report.scheme} redundancy)" if report.scheme else ", no redundancy)"
    read = f"{human_bytes(report.bytes_read)} read in {report.seconds:.2f} s"
    if not report.repaired:
        return [f"healthy, nothing to do: {where}", read]
    lines = [("would repair (dry run, nothing written): " if dry_run else "repaired: ") + where]
    lost = []
    if report.lost_data:
        lost.append(f"data of rank(s) {_ranks(report.lost_data)}")
    if report.lost_parity:
        lost.append(f"parity of rank(s) {_ranks(report.lost_parity)}")
    if lost:
        lines.append(f"  lost: {'; '.join(lost)} (node(s) {', '.join(report.lost_nodes)})")
    lines.extend(f"  note: {n}" for n in report.notes)
    copies = [f for f in report.metadata if f.endswith(f": {MANIFEST_NAME}")]
    docs = [f for f in report.metadata if f not in copies]
    if copies:
        lines.append(
            f"  manifest copies damaged ({len(copies)}), written anew from the good copy "
            "(its checksum holds):"
        )
        lines.extend(f"    {f}" for f in copies)
    if docs:
        lines.append(
            f"  zarr documents missing or damaged ({len(docs)}), written anew from the manifest:"
        )
        lines.extend(f"    {f}" for f in docs)
    verb = "to recreate" if dry_run else "recreated"
    lines.extend(f"  {verb}: {d}" for d in report.recreated)
    if not dry_run:
        lines.append(f"  rebuilt {len(report.files_written)} file(s):")
        lines.extend(f"    {f}" for f in report.files_written)
        lines.append(f"healthy now; {read}")
    else:
        lines.append(read)
    return lines


@click.command("rebuild", epilog=REBUILD_EXITS + help_epilog())
@click.argument("path", required=False)
@click.option(
    "--node",
    "nodes",
    multiple=True,
    metavar="NAME=DIR",
    help="The step directory of node NAME (repeat for every node); instead of PATH.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Find what is lost and whether it can be rebuilt; write nothing.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option(
    "--no-fsync", is_flag=True, help="Do not fsync what is written (faster; not crash-safe)."
)
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="No progress bar and no report (--json still prints): only the exit status.",
)
@click.pass_context
def rebuild_command(
    ctx: click.Context,
    path: str | None,
    nodes: tuple[str, ...],
    dry_run: bool,
    as_json: bool,
    no_fsync: bool,
    quiet: bool,
) -> None:
    """Rebuild what a level-1 checkpoint lost, from its redundancy (partner, xor, rs).

    PATH is the node-local step directory with {node} in place of the node's name (e.g.
    '/local/{node}/ckpt/step-0000000010'), or one directory holding every node's files; or name
    each node's directory with --node NAME=DIR. Every member's data and parity is read and
    checked; damaged files are replaced one by one, a node's lost directory is recreated whole
    (committed like a save). A node's damaged copy of the manifest or of a zarr.json is written
    anew from a good copy (the one whose checksum holds; the majority's where good copies
    disagree, which the output says). Beyond what the redundancy tolerates nothing is
    written, and the output names the ranks, nodes and tensors lost. A progress bar is shown
    on stderr when it is a terminal (checking, then rebuilding).
    """
    spec = node_spec(path, nodes).on_disk().spec  # level-1 copies are never in a bucket
    console = None if quiet or as_json else render.stderr_terminal()
    try:
        with render.progress_bar(console, "rebuild", PHASES) as show:
            write = WriteOptions(fsync=not no_fsync)
            report = rebuild(spec, write=write, dry_run=dry_run, progress=show)
    except UnrecoverableDamageError as exc:
        lost = lost_for_real(spec, exc)  # not every tensor of those ranks: their lost files'
        if as_json:
            click.echo(json.dumps(unrecoverable_json(exc, dry_run, lost), indent=2))
        elif not quiet:
            click.echo(f"UNRECOVERABLE: {one_line(exc.path)}: nothing was written")
            click.echo(one_line(f"  {exc.reason}"))
            click.echo(f"  lost ranks: {_ranks(exc.lost_ranks) or '-'}")
            click.echo(one_line(f"  lost nodes: {', '.join(exc.nodes) or '-'}"))
            click.echo(one_line(f"  lost tensors: {', '.join(lost) or '-'}"))
        ctx.exit(ExitStatus.DAMAGED)
    if as_json:
        click.echo(json.dumps(report_json(report, dry_run), indent=2))
    elif not quiet:
        for line in report_text(report, dry_run):
            click.echo(one_line(line))
    ctx.exit(ExitStatus.OK)
