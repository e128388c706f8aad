"""``ckptfmt gc URL``: remove from a bucket what no checkpoint commit names (crashed, failed or
superseded saves) and abort unfinished multipart uploads; ``ckptfmt.maintenance.gc`` does the
work."""

from __future__ import annotations

import json

import click

from ckptfmt.errors import UsageError
from ckptfmt.maintenance import gc
from ckptfmt.storage import parse_location
from ckptfmt_cli.exits import help_epilog, one_line


@click.command("gc", epilog=help_epilog())
@click.argument("url")
@click.option(
    "--min-age",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    metavar="SECONDS",
    help="Leave a save prefix holding any object newer than this (a save may be in flight).",
)
@click.option(
    "--no-multipart",
    is_flag=True,
    help="Do not look for unfinished multipart uploads (only the uncommitted prefixes).",
)
@click.option("--json", "as_json", is_flag=True, help="Print what was done as one JSON document.")
def gc_command(url: str, min_age: float, no_multipart: bool, as_json: bool) -> None:
    """Delete, under the bucket prefix URL (a checkpoint or a manager's level-3 root, e.g.
    s3://bucket/run), every save prefix U/<save_id>/ that no commit object U/ckptfmt-commit.json
    names: what a save that crashed, failed or lost its commit left. Committed checkpoints are
    never touched. Unfinished multipart uploads under URL are aborted too (S3, with boto3);
    the bucket lifecycle rule AbortIncompleteMultipartUpload does the same on its own.

    Run it while no save to URL is in flight, or give --min-age.
    """
    if not parse_location(url).is_bucket:
        raise UsageError(f"{url!r}: gc works on object-store URLs (s3://bucket/prefix)")
    result = gc(url, min_age=min_age, multipart=not no_multipart)
    if as_json:
        doc = {
            "removed": result.removed,
            "objects": result.objects,
            "aborted_uploads": result.aborted,
            "note": result.note,
        }
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(f"removed {len(result.removed)} uncommitted save(s), {result.objects} object(s)")
    for prefix in result.removed:
        click.echo(one_line(f"  {prefix}/"))
    if result.aborted:
        click.echo(f"aborted {len(result.aborted)} unfinished multipart upload(s)")
    if result.note:
        click.echo(one_line(f"note: {result.note}"))
