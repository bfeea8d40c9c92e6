"""`zb train`: an elastic training worker (FSDP2 inside the node, DiLoCo across nodes)."""

from __future__ import annotations

import click

from zb.cli.config_options import config_options, pop_config_flags, split_config_files
from zb.cli.help_sections import SectionedCommand

EPILOG = """One section in full (flag, type, default, env twin): zb train --help SECTION, e.g. --help diloco.
Every option, by section: zb train --help all (or zb man train).

Config sources, later wins: defaults < @files (left to right) < env twins < flags.
Example: zb train @configs/debug/normal.toml --optim.lr 3e-4.
Local ranks: torchrun --nproc_per_node 2 -m zb train ..., or zb train --nproc-per-node 2 ...
Metrics: one JSON object per line in <log.dir>/metrics.jsonl."""


@click.command(cls=SectionedCommand, epilog=EPILOG,
               context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.argument("config_files", nargs=-1, metavar="[@CONFIG.toml]...")
@click.option("--print-config", is_flag=True, help="Print the resolved config with the source of every value, then exit.")
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=None,
              help="Launch N local ranks through torch's launcher (same as torchrun --nproc_per_node N -m zb train).")
@config_options()
def train(config_files: tuple[str, ...], print_config: bool, nproc_per_node: int | None, **kwargs) -> None:
    """Train a model: the built-in default with no arguments (a short CPU run on offline data)."""
    from zb.config import describe, load_config

    flags = pop_config_flags(kwargs)
    files = split_config_files(config_files, flags)
    cfg = load_config(files, flags)
    if print_config:
        click.echo(describe(cfg), nl=False)
        return
    if nproc_per_node is not None:
        from zb.local_world import LocalWorld
        from zb.train.launch import launch_local_ranks

        if cfg.swarm is None:   # a stage worker holds a part of the model: it checks its own
            from zb.train.setup import preflight

            preflight(cfg, LocalWorld(rank=0, world_size=nproc_per_node), announce=False)

        launch_local_ranks(nproc_per_node, grace_period_s=cfg.ckpt.grace_period)
        return
    from zb.process_exit import uses_gloo

    uses_gloo()  # set before training: a failing run must skip interpreter finalization too
    if cfg.swarm is not None:
        # The one place that knows DiLoCo-SWARM exists: a [swarm] table makes this process a stage worker.
        from zb.swarm.entry import run as run_stage_worker

        stop_signal = run_stage_worker(cfg).stop_signal
    else:
        from zb.train.run import run

        stop_signal = run(cfg).stop_signal
    if stop_signal is not None:
        # Stopped cleanly by a signal: the conventional 128 + signal number, so scripts can tell.
        raise SystemExit(128 + int(stop_signal))
