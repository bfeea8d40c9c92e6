"""`zb export`: a checkpoint's shards gathered into one model in Hugging Face's Llama layout.

    report = export_checkpoint("ckpt/step-000000100", "out/model", dtype="bf16")
    # out/model: config.json, model.safetensors (or shards + index), tokenizer files, zb_export.json

Modules: source (which checkpoint; complete and intact), gather (whole tensors from per-rank shards,
outer or inner params), hf_llama (names, RoPE layout, config.json), tokenizer_files, writer (the
output directory, written aside and renamed into place).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zb import __version__
from zb.errors import InvalidInput
from zb.models.args import ModelArgs

if TYPE_CHECKING:
    from zb.export.writer import Staging

log = logging.getLogger("zb.export")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_SHARD_SIZE = "5GB"  # as save_pretrained


@dataclass
class ExportReport:
    out: str
    checkpoint: str
    step: int
    params: str                  # "outer" or "inner"
    dtype: str
    local_ranks: int
    parameters: int
    bytes: int
    files: list[str] = field(default_factory=list)
    tokenizer: str = ""
    seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _model_args(ckpt, vocab_rows: int):
    from zb.config_schema import ModelConfig
    from zb.export.hf_llama import FAMILIES
    from zb.models.args import model_args

    model = dict(ckpt.config["model"])
    family = model.get("type")
    if family not in FAMILIES:
        raise InvalidInput(f"checkpoint {ckpt.step_dir} is of model family {family!r}; zb export --format hf knows "
                           f"{' and '.join(FAMILIES)}")
    try:
        model_cfg = ModelConfig(**model)
        seq_length = int(ckpt.config["data"]["seq_length"])
        return model_args(model_cfg, vocab_size=vocab_rows, max_seq_len=seq_length)
    except (TypeError, KeyError, ValueError, InvalidInput) as e:
        raise InvalidInput(f"checkpoint {ckpt.step_dir}: its model config cannot be read by this zb ({e})") from None


def _parameter_order(args) -> list[str]:
    from zb.models import Transformer

    with torch.device("meta"):
        return [name for name, _ in Transformer(args).named_parameters()]


def _vocab_rows(ckpt) -> int:
    """The embedding table's rows: the sum of the ranks' shards (dim 0), from their manifests."""
    from zb.export.gather import shard_shapes

    rows = 0
    for part, manifest in zip(ckpt.parts, ckpt.manifests):
        shape = shard_shapes(manifest).get("tok_embeddings.weight")
        if shape is None:
            raise InvalidInput(f"{part}/model.safetensors has no tok_embeddings.weight: not a zb LLaMA checkpoint")
        rows += shape[0]
    return rows


def _check_shapes(params: dict[str, torch.Tensor], args) -> None:
    """Every gathered tensor has the shape the config's model gives it (shards that do not add up to
    the model, or a config that does not describe these weights, fail here)."""
    from zb.models import Transformer

    with torch.device("meta"):
        expected = {name: tuple(p.shape) for name, p in Transformer(args).named_parameters()}
    for name, tensor in params.items():
        if tuple(tensor.shape) != expected[name]:
            raise InvalidInput(f"{name} gathers to {list(tensor.shape)}, the checkpoint's config says "
                               f"{list(expected[name])}: the checkpoint is damaged or its parts come from different "
                               "runs")


def read_params(ckpt, *, inner: bool) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """(the model's args, its full fp32 params by name) from an opened checkpoint (zb.export.source):
    every part joined, shapes checked against the model the checkpoint's config describes."""
    from zb.export.gather import gather

    args = _model_args(ckpt, _vocab_rows(ckpt))
    params = gather(ckpt, _parameter_order(args), inner=inner)
    _check_shapes(params, args)
    return args, params


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, dtype: str = "fp32", inner: bool = False,
                      tokenizer: str | None = None, max_shard_size: str = DEFAULT_SHARD_SIZE,
                      force: bool = False) -> ExportReport:
    """Export a checkpoint as a Hugging Face LlamaForCausalLM directory; InvalidInput (exit 2) or
    EnvironmentFailure (exit 1) name what is wrong, and OUT is then untouched. So does a stop signal
    (its Interrupted says whether it came before or after OUT was complete)."""
    from zb.export.writer import Staging
    from zb.stop_signals import when

    staging = Staging(Path(out).absolute(), force)
    with when(staging.stopped):
        return _export(checkpoint, staging, dtype=dtype, inner=inner, tokenizer=tokenizer,
                       max_shard_size=max_shard_size)


def _export(checkpoint: str | Path, staging: Staging, *, dtype: str, inner: bool, tokenizer: str | None,
            max_shard_size: str) -> ExportReport:
    from zb.export.hf_llama import hf_config, hf_state_dict
    from zb.export.source import open_checkpoint
    from zb.export.tokenizer_files import export_tokenizer
    from zb.export.writer import INDEX, PROVENANCE, check_out, parse_size, write_json, write_weights

    out, force = staging.out, staging.force
    if dtype not in DTYPES:
        raise InvalidInput(f"--dtype {dtype!r}: must be one of {', '.join(DTYPES)}")
    try:
        max_bytes = parse_size(max_shard_size)
    except ValueError as e:
        raise InvalidInput(f"--max-shard-size: {e}") from None
    check_out(out, force)
    t0 = time.perf_counter()
    ckpt = open_checkpoint(Path(checkpoint), inner=inner)
    params_kind = "outer" if ckpt.has_outer and not inner else "inner"
    if not ckpt.has_outer and not inner:
        log.info("the checkpoint has no DiLoCo outer params (a run without DiLoCo): exporting its params")
    t1 = time.perf_counter()
    args, params = read_params(ckpt, inner=inner)
    tensors = hf_state_dict(params, args, DTYPES[dtype])
    del params
    t2 = time.perf_counter()
    with staging as tmp:
        digests = write_weights(tmp, tensors, max_bytes)
        files = list(digests) + ([INDEX] if len(digests) > 1 else [])
        t3 = time.perf_counter()
        tok_name = tokenizer if tokenizer is not None else ckpt.config.get("data", {}).get("tokenizer", "none")
        tok = export_tokenizer(tok_name, tmp, max_length=args.max_seq_len, explicit=tokenizer is not None)
        write_json(tmp / "config.json", hf_config(args, DTYPES[dtype], bos_id=tok.bos_id, eos_id=tok.eos_id,
                                                  pad_id=tok.pad_id))
        report = ExportReport(str(out), str(ckpt.step_dir), ckpt.step, params_kind, dtype, len(ckpt.parts),
                              sum(t.numel() for t in tensors.values()),
                              sum(t.numel() * t.element_size() for t in tensors.values()),
                              sorted(["config.json", "zb_config.json", PROVENANCE, *files, *tok.written]), tok.note)
        report.seconds = {"check": round(t1 - t0, 3), "gather": round(t2 - t1, 3), "write": round(t3 - t2, 3)}
        # The run's config travels with the weights (which data, which schedule), as plain JSON.
        write_json(tmp / "zb_config.json", ckpt.config)
        write_json(tmp / PROVENANCE, {"zb_version": __version__, "time": time.time(), **report.to_json(),
                                      "sha256": digests})
        staging.commit()
    report.seconds["total"] = round(time.perf_counter() - t0, 3)
    return report
