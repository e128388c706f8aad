"""The ``ckptfmt`` command: inspect and verify checkpoints, using only the public core API.

Adding a command (``list``, ``rebuild``, ``reshard``, ...): define it with ``@cli.command()`` here,
or in a sibling module and register it with ``cli.add_command``. Let core errors propagate:
:class:`CkptGroup` maps every one to its exit status (``exits.py``) with a one-line message, and
gives the command the shared exit-status table in its help. A command that finds damage itself
ends with ``ctx.exit(ExitStatus.DAMAGED)``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

try:  # Ctrl-C while the core is imported (at start, before any command runs): as during one
    import click

    import ckptfmt
    from ckptfmt import VerifyReport
    from ckptfmt.storage import Location, parse_location
    from ckptfmt_cli import hints, render
    from ckptfmt_cli.exits import ExitStatus, error_message, exit_status, help_epilog
    from ckptfmt_cli.export_cmd import export_command
    from ckptfmt_cli.gc_cmd import gc_command
    from ckptfmt_cli.import_cmd import import_command
    from ckptfmt_cli.rebuild_cmd import node_spec, rebuild_command
    from ckptfmt_cli.reshard_cmd import reshard_command
    from ckptfmt_cli.summary import describe
except KeyboardInterrupt:
    sys.stderr.write("Error: interrupted\n")
    raise SystemExit(130) from None  # ExitStatus.INTERRUPTED, not imported yet


def fail(ctx: click.Context, message: str, status: ExitStatus) -> NoReturn:
    """End the command: ``Error: <message>`` on stderr (click's form for its own errors) and
    exit with ``status``."""
    click.echo(f"Error: {message}", err=True)
    ctx.exit(status)


class CkptGroup(click.Group):
    """The command group: one exit-status table in every help, one mapping of errors to statuses."""

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        if cmd.epilog is None:
            cmd.epilog = help_epilog()
        super().add_command(cmd, name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            fail(ctx, "interrupted", ExitStatus.INTERRUPTED)
        except BrokenPipeError:
            raise  # click's own handling: stdout went away, e.g. `ckptfmt inspect | head`
        except (ckptfmt.CkptError, OSError) as exc:
            status = exit_status(exc)
            if status is None:  # pragma: no cover - exit_status knows both families
                raise
            fail(ctx, error_message(exc), status)


def _json_out(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, allow_nan=False))


@click.group(
    cls=CkptGroup, epilog=help_epilog(), context_settings={"help_option_names": ["-h", "--help"]}
)
@click.version_option(
    ckptfmt.__version__, "-V", "--version", prog_name="ckptfmt", message="%(prog)s %(version)s"
)
def cli() -> None:
    """Inspect, verify, list, rebuild, reshard, export and import ckptfmt checkpoints (a zarr
    v3 hierarchy plus ckptfmt.json), and gc a bucket. `ckptfmt COMMAND --help` tells more of
    each command.

    A level-1 checkpoint lies in one directory per node: give its path with {node} in place
    of the node's name (verify, rebuild, inspect, reshard). A checkpoint in a bucket is given
    by its URL (s3://bucket/run/ckpt; inspect, verify, list, export, import, gc), reached with
    the AWS_* environment (AWS_ENDPOINT_URL, AWS_REGION, credentials).
    """


@cli.command("inspect")
@click.argument("path")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON document (stable keys) instead of tables.",
)
@click.option(
    "--regions", is_flag=True, help="Also list each region: offset, shape, writer rank and files."
)
def inspect_command(path: str, as_json: bool, regions: bool) -> None:
    """Show what the checkpoint at PATH holds: tensors, values, sizes, who wrote it.

    Reads only the manifest; use `ckptfmt verify` to check the data. A level-1 checkpoint:
    PATH with {node} in place of the node's name (any node's copy describes all of it). PATH
    may be the URL of a checkpoint in a bucket (s3://bucket/run/ckpt; the AWS_* environment
    says where and as whom).
    """
    where = parse_location(path)
    target = hints.first_node_dir(path) if where.kind == "spread" else where.shown
    doc = describe(ckptfmt.open(target), regions=regions)
    if as_json:
        _json_out(doc)
    else:
        render.inspect_tables(render.stdout_console(), doc, regions=regions)


def _verify(path: Location, show_progress: bool) -> VerifyReport:
    console = render.stderr_terminal() if show_progress else None
    with render.progress_bar(console, "verifying") as show:
        return ckptfmt.verify(path, progress=show)


@cli.command("verify")
@click.argument("path", required=False)
@click.option(
    "--node",
    "nodes",
    multiple=True,
    metavar="NAME=DIR",
    help="Level 1: the step directory of node NAME (repeat for every node); not PATH.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON document.")
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="No progress bar and no report (--json still prints): only the exit status.",
)
@click.pass_context
def verify_command(
    ctx: click.Context, path: str | None, nodes: tuple[str, ...], as_json: bool, quiet: bool
) -> None:
    """Re-read every byte of the checkpoint at PATH and report what is damaged.

    Checks the manifest, every zarr metadata document, and every data file's presence, size and
    CRC32C checksums. Each damaged or missing file is named with the tensors it affects. Files the
    manifest does not list are warnings. A progress bar is shown on stderr when it is a terminal.

    A level-1 checkpoint spread over node-local directories is checked node by node: PATH with
    {node} in place of the node's name (or --node NAME=DIR for each node). Its parity files are
    checked too (their CRC32Cs, and that they are the parity of the data); a level-3 copy holds
    none, by design.

    PATH may be the URL of a checkpoint in a bucket (s3://bucket/run/ckpt): every object its
    commit object lists must be there with its size, and every chunk's CRC32C is checked;
    problems name the keys under s3://bucket/run/ckpt/<save_id>/.
    """
    spec = node_spec(path, nodes)
    one = hints.one_node_of_level1(path) if path is not None and not spec.is_bucket else None
    if one is not None:  # not damage: the other nodes' files are in their own directories
        fail(ctx, hints.one_node_message(path or "", *one), ExitStatus.USAGE)
    report = _verify(spec, show_progress=not quiet)
    if as_json:
        _json_out(report.to_json())
    elif not quiet:
        render.verify_summary(render.stdout_console(), report)
        hint = None if spec.is_bucket else hints.rebuild_hint(spec.spec, report)
        if hint is not None:
            render.stdout_console().print(render.plain(hint))
    ctx.exit(ExitStatus.OK if report.healthy else ExitStatus.DAMAGED)


@cli.command("list")
@click.argument("path")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
def list_command(path: str, as_json: bool) -> None:
    """Show the steps saved under the level-3 (shared) root PATH and their state on each level.

    Level 3: flushed, flushing (a copy in progress or torn), damaged, absent. Level 1, for each
    node recorded in PATH/ckptfmt-levels.json whose directory is visible from here: complete
    (manifest and that node's files present with the right sizes), damaged, absent. Reads only
    manifests and file sizes; `ckptfmt verify` checks the data.

    PATH may be a level-3 root in a bucket (s3://bucket/run, a manager's shared_dir): a step
    is flushed when its commit object is there with every object it lists, damaged when some
    are missing or of another size, not committed when it has objects but no commit object.
    """
    where = parse_location(path)
    if where.is_bucket:
        doc = ckptfmt.list_levels(path)
    else:
        root = where.directory()
        if not root.is_dir():
            raise ckptfmt.errors.NotACheckpointError(str(root), "no such directory")
        doc = hints.without_absent_level1(ckptfmt.list_levels(root), root)
    if as_json:
        _json_out(doc)
    else:
        render.level_table(render.stdout_console(), doc)


cli.add_command(gc_command)
cli.add_command(rebuild_command)
cli.add_command(reshard_command)
cli.add_command(export_command)
cli.add_command(import_command)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``ckptfmt`` script and ``python -m ckptfmt_cli``; exits the process."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="ckptfmt")
