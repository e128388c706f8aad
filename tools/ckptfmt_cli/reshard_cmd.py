"""``ckptfmt reshard``: rewrite a checkpoint for another number of ranks, offline, one process.

Only :func:`ckptfmt.maintenance.reshard.reshard` does the work (the new ownership plan, reading
the chunks
each new shard needs, writing and committing, re-encoding redundancy); this module turns the
command line into its arguments and its report into text or JSON.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable

import click

from ckptfmt import Progress, ReadOptions, WriteOptions
from ckptfmt.errors import PerRankWarning
from ckptfmt.maintenance import ReshardReport, reshard
from ckptfmt.plan import RankMap
from ckptfmt.redundancy import DEFAULT_SET_SIZE, Redundancy
from ckptfmt_cli import render
from ckptfmt_cli.exits import cli_wording, one_line
from ckptfmt_cli.summary import human_bytes


def node_names(ranks: int, ranks_per_node: int | None, nodes: str | None) -> list[str]:
    """Each new rank's node: ``--nodes`` as given, or ``n0, n0, ..., n1, ...`` with
    ``--ranks-per-node`` ranks each (default: all on ``n0``)."""
    if nodes is not None and ranks_per_node is not None:
        raise click.UsageError("give --nodes or --ranks-per-node, not both")
    if nodes is not None:
        names = [n.strip() for n in nodes.split(",")]
        if len(names) != ranks:
            raise click.BadParameter(
                f"{len(names)} node names for {ranks} ranks", param_hint="--nodes"
            )
        return names
    per = ranks_per_node or ranks
    return [f"n{k // per}" for k in range(ranks)]


def parse_rank_map(text: str | None) -> RankMap:
    """``identity`` or ``OLD:NEW,OLD:NEW,...`` (saved rank -> new rank)."""
    if text is None or text == "identity":
        return text
    out: dict[int, int] = {}
    for item in text.split(","):
        old, sep, new = item.partition(":")
        try:
            pair = int(old), int(new)
        except ValueError:
            raise click.BadParameter(f"{item!r} is not OLD:NEW", param_hint="--rank-map") from None
        if not sep:
            raise click.BadParameter(f"{item!r} is not OLD:NEW", param_hint="--rank-map")
        if pair[0] in out:  # one saved rank to several new ones: each would repeat its stream
            raise click.BadParameter(
                f"saved rank {pair[0]} is given twice ({pair[0]}:{out[pair[0]]} and {item}): a "
                "saved rank's per-rank state (an RNG stream, a data position) goes to at most "
                "one new rank, or two ranks would draw the same numbers; new ranks without one "
                "need --drop-per-rank",
                param_hint="--rank-map",
            )
        out[pair[0]] = pair[1]
    return out


def redundancy_of(scheme: str | None, m: int | None, set_size: int | None) -> Redundancy | None:
    if scheme is None:
        if m is not None or set_size is not None:
            raise click.UsageError("--m and --set-size go with --redundancy")
        return None
    return Redundancy(scheme, m or 0, set_size or DEFAULT_SET_SIZE)


def report_text(r: ReshardReport) -> list[str]:
    nodes = sorted(set(r.nodes))
    lines = [
        f"resharded step {'none' if r.step is None else r.step}: {r.saved_ranks} rank(s) -> "
        f"{r.ranks} rank(s) on {len(nodes)} node(s) ({', '.join(nodes[:8])}"
        f"{', ...' if len(nodes) > 8 else ''})",
        f"  {r.tensors} tensor(s), {human_bytes(r.data_bytes)} in {r.seconds:.2f} s "
        f"({r.mb_per_s:.0f} MB/s); read {human_bytes(r.bytes_read)}, "
        f"wrote {human_bytes(r.bytes_written)}",
    ]
    if r.rows:
        lines.append(f"  row blocks: {', '.join(r.rows)}")
    if r.redundancy:
        lines.append(f"  redundancy: {r.redundancy}")
    if r.dropped:
        lines.append(
            f"  per-rank entries left out for every new rank (the items of all {r.saved_ranks} "
            f"saved ranks dropped): {', '.join(r.dropped)}"
        )
    lines += [f"  -> {d}" for d in r.destination]
    return lines


@click.command("reshard")
@click.argument("src")
@click.argument("dst")
@click.option(
    "--ranks",
    type=click.IntRange(1, 1 << 20),
    required=True,
    help="Number of ranks of the new job.",
)
@click.option(
    "--ranks-per-node",
    type=click.IntRange(1),
    default=None,
    help="New ranks per node (nodes named n0, n1, ...); default: one node.",
)
@click.option(
    "--nodes",
    default=None,
    metavar="N0,N1,...",
    help="The node of each new rank, comma-separated (the names the job will run on).",
)
@click.option(
    "--rows",
    multiple=True,
    metavar="GLOB",
    help="Tensors (names like 'model/*') the new ranks hold in row blocks (FSDP); "
    "repeatable. Every other tensor is held whole by every rank.",
)
@click.option(
    "--rank-map",
    default=None,
    metavar="identity|OLD:NEW,...",
    help="Which saved rank's per-rank state (RNG, data-loader position) each new rank takes.",
)
@click.option(
    "--drop-per-rank",
    is_flag=True,
    help="Leave out per-rank state that the rank map does not carry over (listed), "
    "instead of failing.",
)
@click.option(
    "--redundancy",
    type=click.Choice(["partner", "xor", "rs"]),
    default=None,
    help="Encode this redundancy over the new nodes (DST then usually has {node}).",
)
@click.option("--m", type=click.IntRange(1, 255), default=None, help="Parity count for rs.")
@click.option(
    "--set-size",
    type=click.IntRange(2, 256),
    default=None,
    help=f"Redundancy set size (default {DEFAULT_SET_SIZE}).",
)
@click.option("--chunk-bytes", type=click.IntRange(1), default=1 << 20, show_default=True)
@click.option("--shard-bytes", type=click.IntRange(1), default=16 << 20, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace a checkpoint at DST.")
@click.option("--no-fsync", is_flag=True, help="Do not fsync (faster; not crash-safe).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON document.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no report.")
def reshard_command(
    src: str,
    dst: str,
    ranks: int,
    ranks_per_node: int | None,
    nodes: str | None,
    rows: tuple[str, ...],
    rank_map: str | None,
    drop_per_rank: bool,
    redundancy: str | None,
    m: int | None,
    set_size: int | None,
    chunk_bytes: int,
    shard_bytes: int,
    overwrite: bool,
    no_fsync: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Rewrite the checkpoint SRC for a job of --ranks ranks, into DST.

    DST gets the ownership and shard files that a save by those ranks on those nodes would
    write, so that each rank of the new job reads its own data again (on level 1: from its own
    node), and with --redundancy the parity of the new redundancy sets. SRC is a complete
    checkpoint (a level-3 copy) or level-1 copies ({node} in place of the node's name); DST is
    one directory, or one level-1 directory per new node with {node}. Every byte read is
    checked; DST appears whole (staging, rename, manifest last) or not at all. Check it with
    `ckptfmt verify DST`.
    """
    names = node_names(ranks, ranks_per_node, nodes)
    red = redundancy_of(redundancy, m, set_size)
    mapping = parse_rank_map(rank_map)
    console = None if quiet or as_json else render.stderr_terminal()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerRankWarning)  # reported below, once
        args = (src, dst, ranks, names, rows, mapping, drop_per_rank, red)
        opts = (chunk_bytes, shard_bytes, overwrite, no_fsync)
        # the bar counts the whole work (read, write, parity) and is full once DST is committed
        with render.progress_bar(console, "resharding") as show:
            report = _run(*args, *opts, show)
    if report.warning:
        click.echo(one_line(cli_wording(f"Warning: {report.warning}")), err=True)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    elif not quiet:
        for line in report_text(report):
            click.echo(one_line(line))


def _run(
    src: str,
    dst: str,
    ranks: int,
    names: list[str],
    rows: tuple[str, ...],
    mapping: RankMap,
    drop: bool,
    red: Redundancy | None,
    chunk_bytes: int,
    shard_bytes: int,
    overwrite: bool,
    no_fsync: bool,
    progress: Callable[[Progress], None] | None,
) -> ReshardReport:
    return reshard(
        src,
        dst,
        ranks,
        nodes=names,
        rows=rows,
        read=ReadOptions(rank_map=mapping, per_rank="drop" if drop else "error"),
        redundancy=red,
        write=WriteOptions(
            chunk_bytes=chunk_bytes,
            shard_bytes=shard_bytes,
            overwrite=overwrite,
            fsync=not no_fsync,
        ),
        progress=progress,
    )
