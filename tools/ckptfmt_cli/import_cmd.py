"""``ckptfmt import``: safetensors, Hugging Face, torch.save and DCP checkpoints into ckptfmt.

Only :func:`ckptfmt.interop.import_safetensors` and ``ckptfmt_torch.interop``'s
``import_torch`` / ``import_dcp`` do the work; this module picks the format, turns the command
line into their arguments and their report into text or JSON. ``--trust-pickle`` is passed to
the DCP import only (DCP's ``.metadata`` is a pickle) and refused with every other format.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

import click

from ckptfmt import WriteOptions
from ckptfmt.errors import ForeignFormatError, UsageError
from ckptfmt.interop import ImportReport, hf, import_safetensors, recover_export
from ckptfmt.maintenance import download_tree
from ckptfmt.storage import Location, parse_location
from ckptfmt_cli.exits import help_epilog, one_line
from ckptfmt_cli.reshard_cmd import node_names
from ckptfmt_cli.summary import human_bytes

FORMATS = ("safetensors", "hf", "torch", "dcp")


def detect(src: Path) -> str:
    """The format of ``src`` from what is there: a DCP directory has ``.metadata``, a Hugging
    Face one its index or ``model.safetensors``; a safetensors file has its JSON header at byte
    8, a torch.save file is a zip archive (or an old-style pickle)."""
    if src.is_dir():
        if (src / ".metadata").is_file():
            return "dcp"
        if (src / hf.INDEX).is_file() or (src / hf.SINGLE).is_file():
            return "hf"
        raise ForeignFormatError(str(src), "a directory of no format ckptfmt imports")
    try:
        with open(src, "rb") as f:
            head = f.read(9)
    except OSError as exc:
        raise ForeignFormatError(str(src), f"cannot read: {exc}") from None
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"\x80"):
        return "torch"
    raise ForeignFormatError(str(src), "not a format ckptfmt recognizes (give --format)")


def _torch_side() -> Any:
    try:
        import ckptfmt_torch.interop as m
    except ImportError as exc:
        raise UsageError(f"importing this format needs PyTorch ({exc})") from None
    return m


IMPORT_EXITS = (
    "\b\nFor import (nothing is written unless it exits 0):\n"
    "  0    imported\n"
    "  2    usage: OUT exists, a DCP checkpoint without --trust-pickle, a rename clash\n"
    "  3    SRC is not a valid file of its format: truncated, a header lying about offsets,\n"
    "       overlapping tensors, an index naming missing files, a name like ../x, a\n"
    "       torch.save file that needs more than weights_only unpickling\n"
)


def report_text(r: ImportReport) -> list[str]:
    lines = [
        f"imported {r.format}: {r.tensors} tensor(s), {human_bytes(r.total_size)}"
        + (f", {r.values} value(s)" if r.values else "")
        + f" in {r.seconds:.2f} s -> {r.destination}"
    ]
    shown = list(r.names.items())[:3]
    if shown:
        lines.append(
            "  names: "
            + ", ".join(f"{a} -> {b}" for a, b in shown)
            + (", ..." if len(r.names) > 3 else "")
        )
    return lines


def _import(
    src: Path, out: Location, fmt: str | None, trust_pickle: bool, opts: dict[str, Any]
) -> ImportReport:
    if not src.exists():
        recover_export(src.absolute(), clean=False)  # an export killed while replacing it
    if not src.exists():
        raise ForeignFormatError(str(src), "no such file or directory")
    fmt = fmt or detect(src)
    if trust_pickle and fmt != "dcp":
        raise click.UsageError("--trust-pickle applies to DCP checkpoints only (--format dcp)")
    if fmt in ("safetensors", "hf"):
        if (fmt == "hf") != src.is_dir():
            raise click.UsageError(
                f"--format {fmt} takes a {'directory' if fmt == 'hf' else 'file'}, {src} is not one"
            )
        report = import_safetensors(src, out, **opts)
    elif fmt == "torch":
        report = _torch_side().import_torch(src, out, **opts)
    else:
        report = _torch_side().import_dcp(src, out, trust_pickle=trust_pickle, **opts)
    return report


@click.command("import", epilog=IMPORT_EXITS + help_epilog())
@click.argument("src")
@click.argument("out")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(FORMATS),
    default=None,
    help="safetensors (one file), hf (a directory: model.safetensors or an index and its "
    "shards), torch (a torch.save file), dcp (a torch.distributed.checkpoint directory). "
    "Default: recognized from SRC.",
)
@click.option(
    "--prefix",
    default=None,
    metavar="PREFIX",
    help="Put the names under PREFIX ('' for none). Default: 'model' for flat state dicts "
    "(safetensors, hf, a torch.save of model.state_dict()), so that "
    "ckptfmt_torch.load({'model': model}, OUT) loads them; a nested state keeps its structure.",
)
@click.option(
    "--rename",
    "renames",
    multiple=True,
    metavar="OLD=NEW",
    help="Rewrite a leading OLD of a source name into NEW (before --prefix); repeatable, "
    "the first match wins.",
)
@click.option(
    "--trust-pickle",
    is_flag=True,
    help="DCP only: allow unpickling DCP's .metadata file (a pickle runs whatever code it "
    "holds: only for a checkpoint you trust). Without it a DCP import is refused. No other "
    "format is ever unpickled: torch.save files are read with torch.load(weights_only=True).",
)
@click.option(
    "--ranks",
    type=click.IntRange(1, 1 << 20),
    default=1,
    show_default=True,
    help="Write the checkpoint a job of this many ranks would save (each rank its share); "
    "OUT may then be a level-1 {node} template.",
)
@click.option(
    "--ranks-per-node",
    type=click.IntRange(1),
    default=None,
    help="With --ranks: ranks per node (nodes n0, n1, ...); default one node.",
)
@click.option("--nodes", default=None, metavar="N0,N1,...", help="With --ranks: each rank's node.")
@click.option(
    "--rows",
    multiple=True,
    metavar="GLOB",
    help="With --ranks: tensors (ckptfmt names like 'model/*') the ranks hold in row blocks.",
)
@click.option("--step", type=click.IntRange(0), default=None, help="The step to record.")
@click.option("--overwrite", is_flag=True, help="Replace a checkpoint at OUT.")
@click.option("--no-fsync", is_flag=True, help="Do not fsync (faster; not crash-safe).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON document.")
@click.option("-q", "--quiet", is_flag=True, help="No report.")
def import_command(
    src: str,
    out: str,
    fmt: str | None,
    prefix: str | None,
    renames: tuple[str, ...],
    trust_pickle: bool,
    ranks: int,
    ranks_per_node: int | None,
    nodes: str | None,
    rows: tuple[str, ...],
    step: int | None,
    overwrite: bool,
    no_fsync: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Import the weights at SRC as a ckptfmt checkpoint OUT.

    SRC is a safetensors file, a Hugging Face directory (model.safetensors, or the shards its
    model.safetensors.index.json names), a torch.save file (read with
    torch.load(weights_only=True) only) or a DCP checkpoint directory (needs --trust-pickle).
    Every header and the index are checked before anything is written; bad input (truncated,
    offsets that lie or overlap, an index naming missing files, names like ../x) writes
    nothing. OUT is a normal checkpoint: ckptfmt_torch.load loads it into a model in place,
    ckptfmt_keras.load_variables with a name map into Keras.

    SRC and OUT may be URLs (s3://bucket/prefix): SRC is downloaded first (a file, or every
    object under a directory's prefix, into TMPDIR); OUT is written into the bucket straight
    from the tensors (no local copy) and committed there, its commit object last: over an
    existing checkpoint (--overwrite) the old one stays whole until that put. With --ranks
    above 1 the checkpoint is laid out in TMPDIR first, then written into the bucket.
    """
    with contextlib.ExitStack() as stack:
        src_path = Path(src)
        if parse_location(src).is_bucket:  # fetched whole first: an import reads every byte
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ckptfmt-in-")))
            src_path = download_tree(src, scratch / "src")
        report = _import(
            src_path,
            parse_location(out),
            fmt,
            trust_pickle,
            {
                "prefix": prefix,
                "renames": renames,
                "write": WriteOptions(overwrite=overwrite, fsync=not no_fsync),
                "step": step,
                "ranks": ranks,
                "nodes": None
                if ranks == 1 and nodes is None and ranks_per_node is None
                else node_names(ranks, ranks_per_node, nodes),
                "rows": rows,
            },
        )
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    elif not quiet:
        for line in report_text(report):
            click.echo(one_line(line))
