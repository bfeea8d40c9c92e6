"""`zb generate`: a checkpoint's completion of a prompt, to try what a run trained."""

from __future__ import annotations

import click

from zb.cli.types import TEXT, FiniteFloatRange

EPILOG = """CHECKPOINT: a step directory (<ckpt.path>/step-NNNNNNNNN), one of its rank-N parts, or a checkpoint root
(its newest complete step), written by any number of local ranks; the files read are checked against their
sha256 first, as zb export does. The run's tokenizer (data.tokenizer; bytes is built in) encodes the prompt;
the context starts with its EOS, as every training document after the first did, and generation stops at
the next EOS or after --max-new-tokens. The model sees at most the run's data.seq_length tokens: beyond
that the oldest are dropped. --temperature 0 is greedy (deterministic); above 0 tokens are sampled
(--top-p keeps the smallest set of tokens whose probability reaches it) with --seed, which makes a run
reproducible (without it a random seed is drawn and shown). bf16 on CUDA, fp32 elsewhere; no KV cache.
The completion goes to stdout, log lines to stderr. Exit 2: a checkpoint missing, incomplete or damaged,
--params outer without DiLoCo, a device that is not there."""


@click.command("generate", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
               epilog=EPILOG)
@click.argument("checkpoint", type=TEXT)
@click.option("--prompt", type=TEXT, required=True, help="The text to complete.")
@click.option("--max-new-tokens", type=click.IntRange(1, 1_000_000), default=64, show_default=True,
              help="Most tokens to generate (fewer when the model ends the text with EOS).")
@click.option("--temperature", type=FiniteFloatRange(min=0, max=100), default=0.0, show_default=True,
              help="Sampling temperature; 0 is greedy (the most likely token every time).")
@click.option("--top-p", type=FiniteFloatRange(min=0, min_open=True, max=1), default=1.0, show_default=True,
              help="Nucleus sampling: draw from the most likely tokens whose probability adds up to this (0 < p <= 1).")
@click.option("--seed", type=click.IntRange(0, 2**63 - 1), default=None,
              help="Seed of the sampling (with --temperature above 0) [default: a random one, shown].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda", "mps"]), default="auto", show_default=True,
              help="Where the model runs; auto: CUDA when visible, else the CPU.")
@click.option("--params", type=click.Choice(["inner", "outer"]), default="inner", show_default=True,
              help="inner: the node's params as trained; outer: the DiLoCo outer params every node shares.")
@click.option("--tokenizer", type=TEXT, default=None,
              help="Another tokenizer than the run's data.tokenizer: bytes, a tokenizer.json, a directory holding "
                   "one, or a hub name.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON document on stdout: prompt, completion, token ids, step, settings, seconds.")
def generate(checkpoint: str, prompt: str, max_new_tokens: int, temperature: float, top_p: float, seed: int | None,
             device: str, params: str, tokenizer: str | None, as_json: bool) -> None:
    """Complete a prompt with a checkpoint's model (greedy, or sampled with a temperature and top-p)."""
    import secrets

    from zb.cli.terminal import print_json, stderr, warn
    from zb.data.tokenizers import build_tokenizer
    from zb.generate import Sampling, load_model, pick_device
    from zb.generate import generate as complete

    if temperature == 0:
        ignored = [name for name, given in (("--top-p", top_p != 1.0), ("--seed", seed is not None)) if given]
        if ignored:
            warn(f"{' and '.join(ignored)} {'has' if len(ignored) == 1 else 'have'} no effect with --temperature 0 "
                 "(greedy)")
    sampling = Sampling(temperature, top_p, seed if seed is not None else secrets.randbelow(2**63))
    where = pick_device(device)
    loaded = load_model(checkpoint, params=params, device=where)
    tok = build_tokenizer(tokenizer or loaded.tokenizer)
    result = complete(loaded, tok, prompt, max_new_tokens=max_new_tokens, sampling=sampling)
    if as_json:
        print_json({"checkpoint": loaded.checkpoint, "step": loaded.step, "params": loaded.params,
                    "local_ranks": loaded.local_ranks, "tokenizer": tok.name, "device": str(where),
                    "dtype": loaded.dtype, "temperature": temperature, "top_p": top_p,
                    "seed": sampling.seed if temperature > 0 else None, "max_new_tokens": max_new_tokens,
                    "prompt": result.prompt, "completion": result.completion, "prompt_ids": result.prompt_ids,
                    "completion_ids": result.completion_ids, "stop": result.stop, "seconds": result.seconds})
        return
    click.echo(result.completion)
    how = "greedy" if temperature == 0 else f"temperature {temperature:g}, top-p {top_p:g}, seed {sampling.seed}"
    rate = len(result.completion_ids) / result.seconds if result.seconds > 0 else 0.0
    stderr.print(f"zb generate: step {loaded.step} of {loaded.checkpoint} ({loaded.params} params, "
                 f"{loaded.dtype} on {where}), {how}: {len(result.completion_ids)} token(s) in "
                 f"{result.seconds:.2f} s ({rate:.0f}/s), stopped at {result.stop.replace('_', '-')}", markup=False)
