"""Rich rendering of the inspect document and of a verify report, for people at a terminal.

Everything that comes from the checkpoint (names, paths, values, reasons) goes in as plain
:class:`rich.text.Text` with control characters escaped, so it is never taken for markup or
terminal escape sequences.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.progress import Progress as Bars
from rich.table import Table
from rich.text import Text

from ckptfmt import Progress, VerifyReport
from ckptfmt_cli.exits import one_line
from ckptfmt_cli.summary import human_bytes, rank_ranges

PIPE_WIDTH = 200  # when stdout is not a terminal: wide enough that rows rarely wrap in a pipe


def stdout_console() -> Console:
    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH
    return console


def stderr_terminal() -> Console | None:
    """A console on stderr when stderr is a terminal (for progress bars), else None."""
    console = Console(stderr=True)
    return console if console.is_terminal else None


@contextmanager
def progress_bar(
    console: Console | None, label: str, phases: Mapping[str, str] | None = None
) -> Iterator[Callable[[Progress], None] | None]:
    """A progress bar on ``console`` (:func:`stderr_terminal`) fed by the core's
    :class:`ckptfmt.Progress` events: yields the callable to pass as ``progress=``, or None (no
    bar) without a console. The bar is full only when the operation's last event says its work
    is done. Work added once the bar started (a rebuild's, after its check) gets a bar of its
    own, so that no bar ever goes back. ``phases``: the label of a phase (else ``label``)."""
    if console is None:
        yield None
        return
    names = dict(phases or {})
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Bars(*columns, console=console, transient=True) as bars:
        task: TaskID | None = None
        base = 0  # the work of the bars before this one
        total = -1

        def show(p: Progress) -> None:
            nonlocal task, base, total
            if task is None or p.total != total:
                if task is not None:  # its work is done: full
                    bars.update(task, completed=total - base)
                    base = total
                total = p.total
                task = bars.add_task(names.get(p.phase, label))
            bars.update(task, total=total - base, completed=p.done - base)

        yield show


def plain(value: object) -> Text:
    return Text(one_line(str(value), limit=10_000))


def shape_text(shape: list[int]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _redundancy_text(red: dict[str, Any] | None) -> str:
    if red is None:
        return "none"
    scheme = red["scheme"] + (f" (m={red['m']})" if red["scheme"] == "rs" else "")
    sets = "; ".join(rank_ranges(s) for s in red["sets"])
    return (
        f"{scheme} over {len(red['sets'])} set(s) of ranks {sets}; parity "
        f"{human_bytes(red['parity_bytes'])} ({100 * red['overhead']:.1f}% of the data) on level 1"
    )


def inspect_tables(console: Console, doc: dict[str, Any], regions: bool = False) -> None:
    """Print the inspect document as a header, a tensor table, a value table and totals."""
    _header_grid(console, doc)
    if doc["tensors"]:
        _tensor_table(console, doc)
    if regions and doc["tensors"]:
        _region_table(console, doc)
    if doc["values"]:
        _value_table(console, doc)
    if doc["empty_groups"]:
        console.print(Text("empty groups: ") + plain(", ".join(doc["empty_groups"])))
    if doc["containers"]:
        shown = (f"{c['name']} ({c['kind']} of {c['items']})" for c in doc["containers"])
        console.print(Text("lists and tuples: ") + plain(", ".join(shown)))
    tot = doc["totals"]
    console.print(
        f"{tot['tensors']} tensor(s), {human_bytes(tot['bytes'])} ({tot['bytes']} bytes); "
        f"{tot['values']} value(s); {tot['files']} file(s), {human_bytes(tot['stored_bytes'])} "
        f"({tot['stored_bytes']} bytes) stored"
    )


def _header_grid(console: Console, doc: dict[str, Any]) -> None:
    """The checkpoint's identity: path, format version, step, save, writer, world, levels."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    step = "none" if doc["step"] is None else str(doc["step"])
    nodes = doc["world"]["nodes"]
    world = f"{doc['world']['size']} rank(s) on {len(nodes)} node(s): " + ", ".join(
        f"{n['node']} [{rank_ranges(n['ranks'])}]" for n in nodes
    )
    writer = doc["writer"]
    for key, value in (
        ("checkpoint", doc["path"]),
        ("format version", doc["format_version"]),
        ("step", step),
        ("save id", doc["save_id"]),
        ("created", doc["created"]),
        (
            "writer",
            " ".join(str(writer.get(k, "")) for k in ("library", "version")).strip() or "unknown",
        ),
        ("world", world),
        ("levels", ", ".join(doc["levels"]) or "none recorded"),
        ("redundancy", _redundancy_text(doc.get("redundancy"))),
    ):
        head.add_row(key, plain(value))
    console.print(head)


def _tensor_table(console: Console, doc: dict[str, Any]) -> None:
    """One row per tensor: dtype, shape, bytes, regions and the ranks that wrote them."""
    table = Table(title="Tensors", title_justify="left", title_style="bold")
    for col, justify in (
        ("name", "left"),
        ("dtype", "left"),
        ("shape", "left"),
        ("bytes", "right"),
        ("regions", "right"),
        ("ranks", "left"),
    ):
        table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for t in doc["tensors"]:
        table.add_row(
            plain(t["name"]),
            t["dtype"] + (f" ({t['encoding']})" if t.get("encoding") else ""),
            shape_text(t["shape"]),
            human_bytes(t["bytes"]),
            str(t["regions"]),
            rank_ranges(t["writer_ranks"]) or "-",
        )
    console.print(table)


def _region_table(console: Console, doc: dict[str, Any]) -> None:
    """One row per region of every tensor, with its files' sizes and CRCs."""
    table = Table(title="Regions", title_justify="left", title_style="bold")
    for col in ("tensor", "offset", "shape", "rank", "files"):
        table.add_column(col, overflow="fold")
    for t in doc["tensors"]:
        for r in t.get("region_details", []):
            files = Text("\n").join(
                plain(f"{f['path']} ({human_bytes(f['size'])}, crc32c {f['crc32c']})")
                for f in r["files"]
            )
            table.add_row(
                plain(t["name"]),
                shape_text(r["offset"]),
                shape_text(r["shape"]),
                str(r["rank"]),
                files,
            )
    console.print(table)


def _value_table(console: Console, doc: dict[str, Any]) -> None:
    """One row per JSON value: its type and its repr."""
    table = Table(title="Values", title_justify="left", title_style="bold")
    table.add_column("name", overflow="fold")
    table.add_column("type")
    table.add_column("value", overflow="fold")
    for v in doc["values"]:
        table.add_row(plain(v["name"]), v["type"], plain(v["repr"]))
    console.print(table)


def verify_summary(console: Console, report: VerifyReport) -> None:
    """Print a verify report: the verdict, every problem, and unexpected files as warnings."""
    m = report.manifest
    where = (
        Text(" ")
        + plain(report.path)
        + Text(f" (step {'none' if m.step is None else m.step}, save id {m.save_id})")
    )
    read = (
        f"{report.files_checked} data file(s) checked, "
        f"{human_bytes(report.bytes_checked)} read and verified"
    )
    if report.healthy:
        console.print(Text("healthy", style="bold green") + where)
        console.print(read)
    else:
        console.print(Text("DAMAGED", style="bold red") + where)
        console.print(f"{len(report.problems)} problem(s); {read}")
        table = Table(title="Problems", title_justify="left", title_style="bold")
        if report.nodes is not None:
            table.add_column("node", overflow="fold")
        table.add_column("file", overflow="fold")
        table.add_column("problem")
        table.add_column("reason", overflow="fold")
        table.add_column("tensors affected", overflow="fold")
        for p in report.problems:
            node = [plain(p.node or "-")] if report.nodes is not None else []
            table.add_row(
                *node, plain(p.file), p.kind, plain(p.reason), plain(", ".join(p.tensors) or "-")
            )
        console.print(table)
        if report.damaged_tensors:
            console.print(
                Text("damaged tensors: ", style="bold") + plain(", ".join(report.damaged_tensors))
            )
    red = report.redundancy
    if red is not None:
        scheme = red["scheme"] + (f" (m={red['m']})" if red["scheme"] == "rs" else "")
        line = f"level-1 redundancy: {scheme}, {len(red['sets'])} set(s): {red['status']}"
        if red["sets_not_compared"]:
            line += (
                f"; parity of set(s) {', '.join(map(str, red['sets_not_compared']))} not "
                "compared with the data (the data is damaged)"
            )
        console.print(plain(line))
    if report.unexpected_files:
        console.print(
            Text(
                f"warning: {len(report.unexpected_files)} file(s) not listed in the manifest "
                "(they do not make it damaged, but nothing vouches for them):",
                style="yellow",
            )
        )
        for f in report.unexpected_files:
            console.print(Text("  ") + plain(f))


def level_table(console: Console, doc: dict[str, Any]) -> None:
    """The table of ``ckptfmt list``: one row per step, one column per level-1 node and level 3."""
    nodes = list(doc["nodes"])
    table = Table(title=f"steps under {doc['shared']}")
    table.add_column("step", justify="right")
    for node in nodes:
        table.add_column(f"level 1: {node}")
    table.add_column("level 3")
    for step, e in doc["steps"].items():
        table.add_row(
            step, *(plain(e["level1"].get(n, "absent")) for n in nodes), plain(e["level3"])
        )
    console.print(table)
    for node, where in doc["nodes"].items():
        console.print(plain(f"node {node}: {where}"))
