"""``ckptfmt export``: a committed checkpoint as Hugging Face safetensors (or one torch.save file).

Only :func:`ckptfmt.interop.export_safetensors` (and, for ``--to torch``,
``ckptfmt_torch.interop.export_torch``) does the work; this module turns the command line into
their arguments and their report into text or JSON.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from ckptfmt import WriteOptions
from ckptfmt.errors import UsageError
from ckptfmt.interop import CAST_TARGETS, ExportReport, export_safetensors
from ckptfmt.maintenance import upload_file
from ckptfmt.storage import Location, parse_location
from ckptfmt_cli import render
from ckptfmt_cli.exits import help_epilog, one_line
from ckptfmt_cli.summary import human_bytes

EXPORT_EXITS = (
    "\b\nFor export:\n"
    "  0    exported (lost level-1 data rebuilt on the fly, if any: the output says so)\n"
    "  1    SRC is damaged beyond what its redundancy rebuilds; nothing appears at OUT\n"
    "  2    usage: OUT exists, no tensor matches --rows, a name clash, a dtype safetensors\n"
    "       lacks (complex128), a bad --max-shard-size\n"
    "  3    SRC is not a readable checkpoint\n"
)


def report_text(r: ExportReport) -> list[str]:
    step = "none" if r.step is None else r.step
    lines = [
        f"exported step {step}: {r.tensors} tensor(s), {human_bytes(r.total_size)} as "
        f"{r.format} in {r.seconds:.2f} s -> {r.destination}",
        f"  files: {', '.join(r.files)}",
    ]
    if r.cast:
        lines.append(f"  cast to {r.cast}: {r.cast_tensors} floating tensor(s)")
        if r.not_cast:
            shown = ", ".join(r.not_cast[:8]) + (", ..." if len(r.not_cast) > 8 else "")
            lines.append(f"  not cast (integer, bool or complex, kept as saved): {shown}")
    if r.format == "safetensors":
        if r.config is not None:
            lines.append(f"  config.json from {r.config}")
        else:
            lines.append(
                "  no config.json (none given, none beside SRC): transformers' "
                "from_pretrained(OUT) needs the model's; add it with --config PATH "
                "(with --overwrite over this export), or copy it into OUT"
            )
    if r.rebuilt_nodes:
        lines.append(
            f"  rebuilt from parity on the fly (source untouched): node(s) "
            f"{', '.join(r.rebuilt_nodes)}"
        )
    return lines


def _torch_export() -> Callable[..., ExportReport]:
    try:
        from ckptfmt_torch.interop import export_torch
    except ImportError as exc:
        raise UsageError(f"--to torch needs PyTorch ({exc})") from None
    fn: Callable[..., ExportReport] = export_torch
    return fn


def _export(
    src: str,
    out: Location,
    to: str,
    max_shard_size: str,
    quiet: bool,
    opts: dict[str, Any],
    config: str | None = None,
) -> ExportReport:
    if to == "torch":
        return _torch_file(src, out, opts)
    console = None if quiet else render.stderr_terminal()
    with render.progress_bar(console, "exporting") as show:
        return export_safetensors(
            src, out, max_shard_size=max_shard_size, progress=show, config=config, **opts
        )


def _torch_file(src: str, out: Location, opts: dict[str, Any]) -> ExportReport:
    """``--to torch``: ``torch.save`` takes the whole state and writes one file, so to a
    bucket the file is written locally (TMPDIR), then uploaded."""
    if not out.is_bucket:
        return _torch_export()(src, out.spec, **opts)
    with tempfile.TemporaryDirectory(prefix="ckptfmt-export-") as scratch:
        local = Path(scratch) / "out"
        report = _torch_export()(src, local, **opts)
        upload_file(local, str(out), overwrite=opts["write"].overwrite)
    return dataclasses.replace(report, destination=str(out))


@click.command("export", epilog=EXPORT_EXITS + help_epilog())
@click.argument("src")
@click.argument("out")
@click.option(
    "--to",
    "to",
    type=click.Choice(["safetensors", "torch"]),
    default="safetensors",
    show_default=True,
    help="safetensors: a Hugging Face directory OUT (model.safetensors, or shards and "
    "model.safetensors.index.json); torch: one torch.save file OUT of a flat state dict.",
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    metavar="SIZE",
    help="Largest safetensors file (5GB, 500MB, 2GiB, bytes); a larger tensor gets a file alone.",
)
@click.option(
    "--rows",
    multiple=True,
    metavar="GLOB",
    help="Export the tensors whose names match (like 'model/*'); repeatable. "
    "Default: those under --strip when there are any (a ckptfmt_torch checkpoint's model), "
    "else every tensor.",
)
@click.option(
    "--strip",
    default="model/",
    show_default=True,
    metavar="PREFIX",
    help="Removed from the front of each name before '/' becomes '.' (so a ckptfmt_torch "
    "checkpoint gives the names of model.state_dict()).",
)
@click.option(
    "--rename",
    "renames",
    multiple=True,
    metavar="OLD=NEW",
    help="Rewrite a leading OLD of an output name into NEW (after the mapping above); "
    "repeatable, the first match wins.",
)
@click.option(
    "--dtype",
    type=click.Choice(list(CAST_TARGETS)),
    default=None,
    help="Cast floating tensors to this dtype (round to nearest even). Integer, bool and "
    "complex tensors are never cast; the output lists them.",
)
@click.option(
    "--config",
    "config",
    default=None,
    metavar="PATH",
    type=click.Path(dir_okay=False),
    help="The model's config.json, copied into OUT for transformers' from_pretrained "
    "(with the generation_config.json beside it). Default: the one beside SRC when SRC is a "
    "Hugging Face Trainer's checkpoint-N/ckptfmt.",
)
@click.option("--overwrite", is_flag=True, help="Replace a previous export at OUT.")
@click.option("--no-fsync", is_flag=True, help="Do not fsync (faster; not crash-safe).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON document.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar and no report.")
def export_command(
    src: str,
    out: str,
    to: str,
    max_shard_size: str,
    rows: tuple[str, ...],
    strip: str,
    renames: tuple[str, ...],
    dtype: str | None,
    config: str | None,
    overwrite: bool,
    no_fsync: bool,
    as_json: bool,
    quiet: bool,
) -> None:
    """Export the checkpoint SRC for other tools: Hugging Face safetensors in the directory OUT.

    SRC is a committed checkpoint (a level-3 copy) or level-1 copies ({node} in place of the
    node's name); what a lost or damaged node held is rebuilt from parity on the fly, into
    scratch space, never into SRC. Each tensor is read at its global shape (whatever ranks
    saved it), every byte checked against its CRC32C, and streamed into its file: memory
    stays within about one output shard. OUT appears whole or not at all (staging directory,
    then rename). Read the result with safetensors, transformers' from_pretrained, or
    `ckptfmt import`.

    SRC may be the URL of a checkpoint in a bucket (s3://bucket/run/ckpt), read with ranged
    GETs; OUT may be a URL too: each file is streamed into the bucket as its tensors are read
    (no local copy), the index last (refused when anything is under OUT already, unless
    --overwrite, which replaces an earlier export). A --to torch file is written locally
    (TMPDIR), then uploaded.
    """
    if config is not None and to == "torch":
        raise UsageError("--config is for a safetensors export (--to safetensors)")
    opts: dict[str, Any] = {
        "rows": rows,
        "strip": strip,
        "renames": renames,
        "dtype": dtype,
        "write": WriteOptions(overwrite=overwrite, fsync=not no_fsync),
    }
    report = _export(src, parse_location(out), to, max_shard_size, quiet or as_json, opts, config)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    elif not quiet:
        for line in report_text(report):
            click.echo(one_line(line))
