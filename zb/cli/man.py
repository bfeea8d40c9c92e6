"""`zb man`: show a command's man page: the checkout's man/, or the one shipped inside a wheel (zb/man/)."""

from __future__ import annotations

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.argument("command", required=False)
@click.option("--path", "print_path", is_flag=True, help="Print the page's file path instead of showing it.")
def man(command: str | None, print_path: bool) -> None:
    """Show the man page of zb, or of COMMAND (e.g. zb man train)."""
    import shutil
    import subprocess
    import sys

    from zb.cli.manpages import MAN_DIR
    from zb.errors import EnvironmentFailure, InvalidInput

    page = MAN_DIR / (f"zb-{command}.1" if command else "zb.1")
    if not page.is_file():
        known = sorted(p.stem.removeprefix("zb-") for p in MAN_DIR.glob("zb-*.1"))
        raise InvalidInput(f"no man page for {command!r}; commands: {', '.join(known)}")
    if print_path:
        click.echo(str(page))
        return
    viewer = shutil.which("man")
    if viewer is None:
        raise EnvironmentFailure(f"no `man` program on PATH; the page is {page}")
    sys.exit(subprocess.run([viewer, "-l", str(page)]).returncode)
