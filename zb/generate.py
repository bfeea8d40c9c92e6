"""Text from a checkpoint: `zb generate`, to try what a run trained.

    model = load_model("ckpt/step-000000100", params="inner", device=torch.device("cpu"))
    result = generate(model, tokenizer, "Once upon a time", max_new_tokens=64, sampling=Sampling())

The weights are gathered as `zb export` gathers them (zb.export.source and gather: any local rank
count, inner or DiLoCo outer params, files checked against their sha256 first) into zb's own
Transformer. The loop has no KV cache: each new token runs the whole context again (at most
max_seq_len, the run's data.seq_length, tokens: the oldest are dropped beyond that), which is simple
and exact, and fast enough for the small models one tries this way. zb trains without BOS: each
document follows the EOS of the one before, so the context starts with EOS, and generation stops
at the next EOS. Ids the tokenizer has no token for (the vocabulary is padded to a multiple of 64)
are never chosen. Sampling draws from a CPU generator seeded by `seed`, so a seed gives the same
text on every device for the same logits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zb.errors import InvalidInput

if TYPE_CHECKING:
    from zb.models import Transformer

log = logging.getLogger("zb.generate")


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0     # 0: greedy (the most likely token)
    top_p: float = 1.0           # nucleus: the smallest set of tokens whose probability reaches top_p
    seed: int = 0


@dataclass
class Loaded:
    model: Transformer
    checkpoint: str
    step: int
    params: str                  # "inner" or "outer"
    local_ranks: int
    tokenizer: str               # the run's data.tokenizer (resolved)
    dtype: str


@dataclass
class Generation:
    prompt: str
    completion: str
    prompt_ids: list[int]        # the context fed to the model: EOS, then the prompt's tokens
    completion_ids: list[int]    # without the EOS that stopped it
    stop: str                    # "eos" or "max_new_tokens"
    seconds: float


def load_model(checkpoint: str | Path, *, params: str, device: torch.device) -> Loaded:
    """zb's Transformer with a checkpoint's inner or outer params, in eval mode on `device` (bf16 on
    CUDA, fp32 elsewhere). InvalidInput (exit 2) names what is wrong with the checkpoint."""
    from zb.export import read_params
    from zb.export.source import open_checkpoint
    from zb.models import Transformer

    ckpt = open_checkpoint(Path(checkpoint), inner=params == "inner")
    if params == "outer" and not ckpt.has_outer:
        raise InvalidInput(f"--params outer: checkpoint {ckpt.step_dir} has no DiLoCo outer params (a run without "
                           "DiLoCo); use --params inner")
    # The attention kernel the run trained with (flash-attn: CUDA only) is no part of the weights.
    ckpt = replace(ckpt, config={**ckpt.config, "model": {**ckpt.config["model"], "attn_impl": "auto"}})
    args, tensors = read_params(ckpt, inner=params == "inner")
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device=device)
    model.load_state_dict(tensors, strict=True)
    model.reset_rope()  # non-persistent buffers: not in the checkpoint
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model.to(dtype).eval()
    tokenizer = ckpt.config.get("data", {}).get("tokenizer", "auto")
    if tokenizer == "auto":  # written before zb.config resolved it: resolve it the same way
        from zb.config import auto_tokenizer

        data = ckpt.config.get("data", {})
        tokenizer = auto_tokenizer(ckpt.config["model"].get("type", ""), bool(data.get("fake")),
                                   data.get("dataset_name_or_paths", ""))
    return Loaded(model, str(ckpt.step_dir), ckpt.step, params, len(ckpt.parts), tokenizer,
                  "bf16" if dtype == torch.bfloat16 else "fp32")


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """One token id from fp32 CPU logits [vocab] (only the ids the tokenizer has)."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep a token while the mass before it is below top_p: the first token is always kept.
        keep = torch.cumsum(sorted_probs, 0) - sorted_probs < sampling.top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate_ids(model: Transformer, context: list[int], *, max_new_tokens: int, sampling: Sampling,
                 eos_id: int | None, vocab: int) -> tuple[list[int], str]:
    """(new token ids, why it stopped): each step runs the last max_seq_len tokens of the context."""
    device = next(model.parameters()).device
    window = model.args.max_seq_len
    generator = torch.Generator().manual_seed(sampling.seed)
    ids = list(context)
    out: list[int] = []
    for _ in range(max_new_tokens):
        tokens = torch.tensor([ids[-window:]], dtype=torch.long, device=device)
        logits = model(tokens)[0, -1, :vocab].float().cpu()
        token = next_token(logits, sampling, generator)
        if token == eos_id:
            return out, "eos"
        out.append(token)
        ids.append(token)
    return out, "max_new_tokens"


def generate(loaded: Loaded, tokenizer, prompt: str, *, max_new_tokens: int, sampling: Sampling) -> Generation:
    """The completion of `prompt` by the loaded model, in the run's tokenizer."""
    context = [tokenizer.eos_id, *tokenizer.encode(prompt)]
    if max(context) >= loaded.model.args.vocab_size:
        raise InvalidInput(f"tokenizer {tokenizer.name!r} gives token id {max(context)}, the model has "
                           f"{loaded.model.args.vocab_size} ids: it is not the tokenizer the run trained with")
    window = loaded.model.args.max_seq_len
    if len(context) > window:
        log.warning("the prompt is %d tokens and the model sees %d (the run's data.seq_length): only its last %d "
                    "are read", len(context) - 1, window, window)
    vocab = min(tokenizer.vocab_size, loaded.model.args.vocab_size)
    t0 = time.perf_counter()
    new, stop = generate_ids(loaded.model, context, max_new_tokens=max_new_tokens, sampling=sampling,
                             eos_id=tokenizer.eos_id, vocab=vocab)
    return Generation(prompt, tokenizer.decode(new), context, new, stop, round(time.perf_counter() - t0, 3))


def pick_device(name: str) -> torch.device:
    """auto: CUDA when visible, else the CPU; a device that is not there is InvalidInput (exit 2)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise InvalidInput("--device cuda: no CUDA device is visible; use --device cpu or auto")
    mps = getattr(torch.backends, "mps", None)
    if name == "mps" and not (mps is not None and mps.is_available()):
        raise InvalidInput("--device mps: MPS is not available (it needs an Apple-silicon Mac and a torch built "
                           "with MPS); use --device cpu or auto")
    return torch.device(name)
