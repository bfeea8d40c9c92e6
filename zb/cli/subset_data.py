"""`zb subset-data`: download only the files of a Hugging Face dataset that one data rank reads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click

EPILOG = """The files land in <out> in Hugging Face's cache layout, the one `zb train` and huggingface_hub read.
Train from them offline with: ZB_DATA_CACHE=<out> HF_HUB_OFFLINE=1 zb train --data.dataset_name_or_paths
<name> --data.data_rank R --data.data_world_size W. Reruns skip the files already there.
Prime's flag spellings work too (--dataset_name, --data_rank, --data_world_size, --max_shards, --dry_run,
--num_workers)."""


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}, epilog=EPILOG)
@click.option("--dataset", "--dataset_name", "dataset", required=True, envvar="ZB_DATA_DATASET_NAME_OR_PATHS",
              help="Hugging Face dataset name (owner/name, or owner/name:config). [env: ZB_DATA_DATASET_NAME_OR_PATHS]")
@click.option("--data-rank", "--data_rank", "data_rank", type=click.IntRange(min=0), default=0, show_default=True, envvar="ZB_DATA_DATA_RANK",
              help="The data rank whose files to fetch. [env: ZB_DATA_DATA_RANK]")
@click.option("--data-world-size", "--data_world_size", "data_world_size", type=click.IntRange(min=1), default=1, show_default=True,
              envvar="ZB_DATA_DATA_WORLD_SIZE", help="Number of data ranks. [env: ZB_DATA_DATA_WORLD_SIZE]")
@click.option("--out", type=click.Path(file_okay=False), default=None, envvar="ZB_DATA_CACHE",
              help="Cache directory to fill (default: huggingface_hub's, ~/.cache/huggingface/hub). "
                   "[env: ZB_DATA_CACHE]")
@click.option("--split", default="train", show_default=True, envvar="ZB_DATA_SPLIT",
              help="Dataset split. [env: ZB_DATA_SPLIT]")
@click.option("--config", "config_name", default=None, envvar="ZB_DATA_DATASET_CONFIG",
              help="Dataset config (subset) name. [env: ZB_DATA_DATASET_CONFIG]")
@click.option("--max-shards", "--max_shards", "max_shards", type=click.IntRange(min=1), default=None,
              help="Fetch at most this many of the rank's files (a quick start or a smoke test).")
@click.option("--filter", "filters", default="",
              help="Comma-separated substrings: only files whose path holds one of them, chosen before the files "
                   "are dealt to data ranks.")
@click.option("--num-workers", "--num_workers", "workers", type=click.IntRange(min=1), default=4, show_default=True,
              help="Files downloaded at once.")
@click.option("--reverse-data-files", "--reverse_data_files", "reverse", is_flag=True,
              envvar="ZB_DATA_REVERSE_DATA_FILES",
              help="The files in reverse order before they are dealt to data ranks, as data.reverse_data_files: "
                   "give it when training sets that key, or this fetches other files than training reads. "
                   "[env: ZB_DATA_REVERSE_DATA_FILES]")
@click.option("--split-by-data-rank/--no-split-by-data-rank", "split_by_rank", default=True, show_default=True,
              envvar="ZB_DATA_SPLIT_BY_DATA_RANK",
              help="As data.split_by_data_rank: --no-split-by-data-rank fetches every file (a node that reads "
                   "its sources whole). [env: ZB_DATA_SPLIT_BY_DATA_RANK]")
@click.option("--dry-run", "--dry_run", "dry_run", is_flag=True,
              help="List the rank's files and their total size; download nothing.")
@click.option("--retries", type=click.IntRange(min=0), default=5, show_default=True, envvar="ZB_DATA_RETRIES",
              help="Retries with exponential backoff on transient HTTP errors. [env: ZB_DATA_RETRIES]")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON summary on stdout.")
def subset_data(dataset: str, data_rank: int, data_world_size: int, out: str | None, split: str,
                config_name: str | None, max_shards: int | None, filters: str, workers: int, reverse: bool,
                split_by_rank: bool, dry_run: bool, retries: int, as_json: bool) -> None:
    """Download the part of a Hugging Face dataset that one data rank trains on (set HF_ENDPOINT for a mirror)."""
    from dataclasses import asdict
    from pathlib import Path

    from zb.cli.terminal import print_json, stderr
    from zb.data.hub import cache_root
    from zb.data.subset import subset_dataset
    from zb.errors import InvalidInput

    if data_rank >= data_world_size:
        raise InvalidInput(f"--data-rank {data_rank} must be below --data-world-size {data_world_size}")
    wanted = tuple(part.strip() for part in filters.split(",") if part.strip())
    with make_progress() as progress:
        report = subset_dataset(dataset, data_rank=data_rank, data_world_size=data_world_size,
                                out=Path(out) if out else cache_root(), split=split, config=config_name,
                                max_shards=max_shards, retries=retries, filters=wanted, workers=workers,
                                dry_run=dry_run, reverse_data_files=reverse, split_by_data_rank=split_by_rank,
                                progress=progress)
    if not report.files:
        raise InvalidInput(f"--dataset {dataset!r}: no files for data rank {data_rank} of {data_world_size}"
                           + (f" match --filter {filters!r}" if wanted else ""))
    if dry_run:
        for path in report.files:
            click.echo(path)
        stderr.print(f"{dataset}: {len(report.files)} files ({report.bytes / 1e6:.1f} MB) for data rank {data_rank} "
                     f"of {data_world_size}; dry run: nothing downloaded", markup=False, highlight=False)
        if as_json:
            print_json(asdict(report))
        return
    stderr.print(f"{dataset}: {len(report.files)} files for data rank {data_rank} of {data_world_size} "
                 f"({len(report.downloaded)} downloaded, {len(report.skipped)} already complete, "
                 f"{report.bytes / 1e6:.1f} MB) in {report.out}", markup=False, highlight=False)
    if as_json:
        print_json(asdict(report))


@contextmanager
def make_progress() -> Iterator:
    """A rich byte-progress bar on a terminal, one plain line per file otherwise."""
    from zb.cli.terminal import interactive

    yield from (_rich_progress() if interactive() else _plain_progress())


def _plain_progress() -> Iterator:
    from zb.cli.terminal import stderr
    from zb.data.subset import Progress

    class Plain(Progress):
        def file_done(self, remote, fetched: bool, seconds: float) -> None:
            what = f"fetched in {seconds:.1f}s" if fetched else "already complete"
            size = f"{remote.size / 1e6:.1f} MB" if remote.size is not None else "size unknown"
            stderr.print(f"{remote.path} ({size}): {what}", markup=False, highlight=False)

    yield Plain()


def _rich_progress() -> Iterator:
    from zb.cli.terminal import stderr
    from zb.data.subset import Progress
    from zb.progress import byte_bar

    with byte_bar(console=stderr, transient=False) as bar:
        task = bar.add_task("subset-data", total=None)

        class Rich(Progress):
            def start(self, files) -> None:
                bar.update(task, total=sum(f.size or 0 for f in files) or None)

            def file_done(self, remote, fetched: bool, seconds: float) -> None:
                bar.advance(task, remote.size or 0)  # per file: hf_hub_download reports no bytes on the way

        yield Rich()
