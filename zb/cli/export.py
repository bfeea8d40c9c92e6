"""`zb export`: a checkpoint as a Hugging Face model directory (LlamaForCausalLM)."""

from __future__ import annotations

import click

from zb.cli.types import TEXT

EPILOG = """CHECKPOINT: a step directory (<ckpt.path>/step-NNNNNNNNN), one of its rank-N parts, or a checkpoint
root (its newest complete step). Every local rank's part must be committed and its files intact (sha256);
any rank count works. OUT must not exist (or be empty); --force replaces only an earlier export.
OUT gets config.json, model.safetensors (or model-0000i-of-0000n.safetensors + model.safetensors.index.json
above --max-shard-size), tokenizer files, zb_export.json (provenance) and zb_config.json (the run's config).
Load it with transformers: LlamaForCausalLM.from_pretrained(OUT), AutoTokenizer.from_pretrained(OUT).
Exit 2: incomplete or damaged checkpoint, OUT exists, a model Llama cannot express; exit 1: disk full."""


@click.command("export", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
               epilog=EPILOG)
@click.argument("checkpoint", type=TEXT)
@click.argument("out", type=TEXT)
@click.option("--format", "fmt", type=click.Choice(["hf"]), default="hf", show_default=True,
              help="Output layout: hf is Hugging Face's Llama (LlamaForCausalLM).")
@click.option("--inner", is_flag=True,
              help="Export this node's inner params (as trained since the last outer step) instead of the DiLoCo "
                   "outer params, which every node shares. A run without DiLoCo has only these.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Weights' dtype in the export (checkpoints hold fp32; bf16 halves the size).")
@click.option("--tokenizer", type=TEXT, default=None,
              help="Tokenizer files to include: bytes, a tokenizer.json or a directory holding one, a hub name "
                   "(from the local cache only), or none. Default: the run's data.tokenizer; when that is not "
                   "available locally the export has no tokenizer files and says so.")
@click.option("--max-shard-size", type=TEXT, default="5GB", show_default=True,
              help="Largest safetensors file (5GB is 10^9 bytes x 5, 5GiB 2^30 x 5); larger exports are sharded.")
@click.option("--force", is_flag=True, help="Replace OUT if it holds an earlier export (never any other directory).")
@click.option("--json", "as_json", is_flag=True,
              help="Print the summary as one JSON document on stdout (else lines on stderr).")
def export(checkpoint: str, out: str, fmt: str, inner: bool, dtype: str, tokenizer: str | None, max_shard_size: str,
           force: bool, as_json: bool) -> None:
    """Export a checkpoint as a Hugging Face model (LlamaForCausalLM) with its tokenizer."""
    from zb.cli.terminal import print_json, stderr
    from zb.export import export_checkpoint

    report = export_checkpoint(checkpoint, out, dtype=dtype, inner=inner, tokenizer=tokenizer,
                               max_shard_size=max_shard_size, force=force)
    if as_json:
        print_json(report.to_json())
        return
    stderr.print(f"zb export: step {report.step} of {report.checkpoint} ({report.local_ranks} local rank(s), "
                 f"{report.params} params) -> {report.out}", markup=False)
    stderr.print(f"  {report.parameters:,} parameters, {report.bytes / 1e6:,.1f} MB in {report.dtype}; "
                 f"{report.seconds['total']:.1f} s", markup=False)
    stderr.print(f"  files: {', '.join(report.files)}", markup=False)
    stderr.print(f"  tokenizer: {report.tokenizer}", markup=False)
