"""`zb ckpt ls` and `zb ckpt verify`: what checkpoints a run left, and whether one is intact."""

from __future__ import annotations

import click

from zb.cli.types import TEXT

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}

LS_EPILOG = """DIR: a ckpt.path (step-NNNNNNNNN directories), one node's RAM directory (<ckpt.ram_dir>/<node id>),
or a directory of node directories (ckpt.ram_dir itself, a remote copy mirrored locally). --remote URL lists
a remote copy (ckpt.remote.path or one node's directory in it; any fsspec URL, s3:// needs zb[remote]); with DIR
too, a node found in both is listed once and `latest` considers both copies, as a resume does.
Per step: run position (step, outer step, tokens), bytes, committed parts of the local rank count,
complete or why not, final (written at the end of a run), its branch. A run that resumes an older step
writes a new branch; with several branches each is listed with its steps and where it started. `latest`
is the step --ckpt.resume latest takes: the newest of the current branch (the one written last) and its
ancestors; checksums are checked only when it loads (zb ckpt verify checks them now). Several nodes:
`common` is the newest such step complete on every node, the step a restarted DiLoCo run agrees on.
Exit 2: DIR missing or holding no checkpoints; exit 1: the remote cannot be read."""

VERIFY_EPILOG = """PATH: a step directory (<ckpt.path>/step-NNNNNNNNN), one of its rank-N parts, or DIR --step N.
Every file of every part is checked against the part's manifest (COMMITTED marker, size, sha256), and the
manifest's step and local rank count against the others. Each part is reported OK or DAMAGED on stdout;
each damaged part again on stderr, then one summary line. Exit 0: all intact; 1: a part damaged or
missing; 2: PATH missing or not a checkpoint."""


@click.group("ckpt", context_settings=CONTEXT)
def ckpt() -> None:
    """List and verify checkpoints: a run's ckpt.path, ckpt.ram_dir or remote copy."""


@ckpt.command("ls", context_settings=CONTEXT, epilog=LS_EPILOG)
@click.argument("directory", type=TEXT, required=False, metavar="[DIR]")
@click.option("--remote", type=TEXT, metavar="URL", default=None,
              help="Also list a remote copy: ckpt.remote.path or one node's directory in it (an fsspec URL).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout (else a table or lines).")
def ls(directory: str | None, remote: str | None, as_json: bool) -> None:
    """List the checkpoints under DIR, and the one a resume takes.

    Per step: its run position, size, parts, whether it is complete (and why not), final and its branch;
    then the branches, and the step `--ckpt.resume latest` takes."""
    from zb.ckpt.durable.inventory import list_checkpoints
    from zb.cli.terminal import print_json, stdout

    listing = list_checkpoints(directory, remote)
    if as_json:
        print_json(listing.to_json())
    elif stdout.is_terminal:
        _print_tables(listing)
    else:
        click.echo("\n".join(listing_lines(listing)))


def _position(entry) -> tuple[str, str]:
    """(outer step, tokens) of a step's run position."""
    p = entry.position
    return ("—", "—") if p is None else (f"{p['outer_step']:,}", f"{p['tokens']:,}")


def _state(entry) -> str:
    return "complete" if entry.complete else f"incomplete: {entry.why}"


def _branch(branch: str | None) -> str:
    """A branch as shown: the first 6 characters of its id (--json has all), 'legacy' before lineage."""
    return "?" if branch is None else branch[:6] or "legacy"


def _branch_lines(node) -> list[str]:
    """One line per branch, only when there are several (one branch is the usual case)."""
    if len(node.branches) < 2:
        return []
    lines = []
    for b in node.branches:
        start = "from scratch" if b.base is None else f"from step {b.base} of branch {_branch(b.base_branch)}"
        role = "current: latest takes from it" if b.current else "left; its newest step is kept by pruning"
        lines.append(f"branch {_branch(b.id)}: step(s) {', '.join(map(str, b.steps))} ({start}); {role}")
    return lines


def _latest_line(node) -> str:
    if node.latest is None:
        return "latest: none complete (--ckpt.resume latest starts from scratch)"
    return f"latest: step {node.latest} (what --ckpt.resume latest takes; zb ckpt verify checks its checksums)"


def listing_lines(listing) -> list[str]:
    """Plain lines: one per step, then the step `latest` takes; per node when there are several."""
    lines = []
    for node in listing.nodes:
        lines.append(f"{', '.join(node.roots)}" + (f" (node {node.node})" if node.node else "") + ":")
        for e in node.steps:
            outer, tokens = _position(e)
            parts = f"{e.parts}/{e.ranks if e.ranks is not None else '?'} part(s)"
            where = " remote" if e.where == "remote" else ""
            lines.append(f"  step {e.step}{where}  outer step {outer}  tokens {tokens}  {e.bytes:,} bytes  {parts}  "
                         f"{_state(e)}  branch {_branch(e.branch)}" + ("  final" if e.final else ""))
        lines += [f"  {line}" for line in _branch_lines(node)]
        lines.append(f"  {_latest_line(node)}")
    if sum(n.node is not None for n in listing.nodes) > 1:
        lines.append(f"common: {'none' if listing.common is None else f'step {listing.common}'} (the newest step "
                     "complete on every node)")
    return lines


def _print_tables(listing) -> None:
    from rich.markup import escape
    from rich.table import Table

    from zb.cli.terminal import stdout

    for node in listing.nodes:
        title = ", ".join(node.roots) + (f" (node {node.node})" if node.node else "")
        table = Table(title=escape(title), title_justify="left")
        remote = any(e.where == "remote" for e in node.steps)
        for name in ("step", "where", "outer step", "tokens", "bytes", "parts", "state", "branch", "final"):
            if name != "where" or remote:
                table.add_column(name, justify="left" if name in ("where", "state") else "right")
        for e in node.steps:
            outer, tokens = _position(e)
            state = "[green]complete[/]" if e.complete else f"[red]incomplete[/]: {escape(e.why or '')}"
            table.add_row(str(e.step), *([e.where] if remote else []), outer, tokens, f"{e.bytes:,}",
                          f"{e.parts}/{e.ranks if e.ranks is not None else '?'}", state,
                          _branch(e.branch) + ("*" if e.step in node.lineage else ""), "final" if e.final else "")
        stdout.print(table)
        for line in _branch_lines(node):
            stdout.print(escape(line))
        stdout.print(escape(_latest_line(node)))
    if sum(n.node is not None for n in listing.nodes) > 1:
        common = "none" if listing.common is None else f"step {listing.common}"
        stdout.print(f"common: {common} (the newest step complete on every node)")


@ckpt.command("verify", context_settings=CONTEXT, epilog=VERIFY_EPILOG)
@click.argument("path", type=TEXT)
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="With a checkpoint root (ckpt.path) as PATH: the step to verify.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as one JSON document on stdout (the exit code and stderr stay as they are).")
def verify(path: str, step: int | None, as_json: bool) -> None:
    """Check every file of a checkpoint against its sha256.

    Every local rank's part, or the one part PATH names, is reported OK or DAMAGED with the reason."""
    from zb.ckpt.durable.inventory import verify_checkpoint
    from zb.cli.terminal import print_json, stderr, warn
    from zb.errors import EnvironmentFailure

    report = verify_checkpoint(path, step)
    if as_json:
        print_json(report.to_json())
    else:
        for part in report.parts:
            state = f"OK  {part.bytes:,} bytes" if part.ok else f"DAMAGED  {part.why}"
            click.echo(f"rank-{part.rank}  {state}  {part.path}" if part.ok else f"rank-{part.rank}  {state}")
    for extra in report.ignored:
        warn(f"{extra} is not part of this checkpoint (written by {report.ranks} local rank(s)); not checked")
    damaged = [p for p in report.parts if not p.ok]
    what = f"checkpoint step {report.step if report.step is not None else '?'} ({report.step_dir})"
    if damaged:
        for part in damaged:
            stderr.print(f"DAMAGED rank-{part.rank}: {part.why}", markup=False)
        raise EnvironmentFailure(f"{what}: {len(damaged)} of {len(report.parts)} part(s) damaged or missing")
    total = sum(p.bytes for p in report.parts)
    stderr.print(f"{what}: {len(report.parts)} part(s) OK, {total:,} bytes checked", markup=False)
