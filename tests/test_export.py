"""`zb export --format hf`: checkpoints of real runs (one process; two local ranks under FSDP2 with
DiLoCo) load with transformers' LlamaForCausalLM and give zb's logits; bad inputs fail in one line
and leave OUT untouched.

The reference is built here, independently of zb.export: the ranks' model shards concatenated by
hand into zb's own Transformer.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from zb.errors import InvalidInput
from zb.export import export_checkpoint
from zb.testing.procs import TINY, free_port, zb_process


def _transformers():
    import transformers  # in [dev]; imported here, not at collection (it takes seconds)

    return transformers

TEXT = "The cat sat on the mat. Ünïcode too!"


def _train(root: Path, *args: str, **env: str) -> Path:
    proc = zb_process("train", *TINY, "--optim.total_steps", "8", "--ckpt.path", str(root / "ckpt"),
                      "--ckpt.interval", "4", "--ckpt.ram_dir", str(root / "ram"), "--log.dir", str(root / "log"),
                      *args, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "ckpt" / "step-000000008"


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    """A plain run (no DiLoCo): the checkpoint holds the params only, whole tensors."""
    return _train(tmp_path_factory.mktemp("one"), "--model.type", "llama2")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """Two local ranks (FSDP2 shards), DiLoCo outer params, GQA, activation checkpointing (wrapped names)."""
    return _train(tmp_path_factory.mktemp("two"), "--nproc-per-node", "2", "--model.type", "llama3",
                  "--model.n_kv_heads", "2", "--train.ac_ckpt", "1", "--diloco.inner_steps", "4",
                  "--elastic.host_store", GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(free_port()),
                  GLOBAL_UNIQUE_ID="node-a")


def _reference(step_dir: Path) -> torch.nn.Module:
    """zb's model from the ranks' model shards, concatenated in rank order (FSDP2 shards dim 0)."""
    from safetensors import safe_open

    from zb.config_schema import ModelConfig
    from zb.models import Transformer, model_args

    shards: dict[str, list[torch.Tensor]] = {}
    for part in sorted(step_dir.glob("rank-*")):
        with safe_open(str(part / "model.safetensors"), "pt") as f:
            for key in f.keys():
                shards.setdefault(key.replace("_checkpoint_wrapped_module.", ""), []).append(f.get_tensor(key))
    state = {k: torch.cat(v) for k, v in shards.items()}
    config = json.loads((step_dir / "rank-0" / "manifest.json").read_text())["meta"]["config"]
    args = model_args(ModelConfig(**config["model"]), vocab_size=state["tok_embeddings.weight"].shape[0],
                      max_seq_len=config["data"]["seq_length"])
    model = Transformer(args)
    model.load_state_dict(state, strict=True)
    model.reset_rope()
    return model.eval()


def _tokens(out: Path) -> torch.Tensor:
    tok = _transformers().AutoTokenizer.from_pretrained(str(out))
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert ids == list(TEXT.encode("utf-8"))  # the byte tokenizer zb trained with
    assert tok.decode(ids) == TEXT and tok.eos_token_id == 257
    return torch.tensor([ids[:32], ids[-32:]])


def _max_diff(step_dir: Path, out: Path) -> float:
    hf = _transformers().LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokens = _tokens(out)
    with torch.no_grad():
        return (hf(tokens).logits - _reference(step_dir)(tokens)).abs().max().item()


def test_one_rank_export_gives_zbs_logits(one_rank, tmp_path):
    report = export_checkpoint(one_rank, tmp_path / "hf")
    assert (report.params, report.local_ranks, report.step) == ("inner", 1, 8)
    assert _max_diff(one_rank, tmp_path / "hf") <= 1e-4
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["num_key_value_heads"] == config["num_attention_heads"] and config["rope_theta"] == 1e4


def test_two_rank_fsdp_export_gives_zbs_logits_outer_and_inner(two_ranks, tmp_path):
    report = export_checkpoint(two_ranks, tmp_path / "outer")
    assert (report.params, report.local_ranks) == ("outer", 2)
    # Right after an outer step the inner params are the outer params: both exports match the shards.
    assert _max_diff(two_ranks, tmp_path / "outer") <= 1e-4
    assert export_checkpoint(two_ranks / "rank-1", tmp_path / "inner", inner=True).params == "inner"
    assert _max_diff(two_ranks, tmp_path / "inner") <= 1e-4
    config = json.loads((tmp_path / "outer" / "config.json").read_text())
    assert (config["num_key_value_heads"], config["num_attention_heads"], config["rope_theta"]) == (2, 4, 5e5)


def test_bf16_sharded_export_loads_with_an_index(two_ranks, tmp_path):
    from safetensors.torch import load_file

    export_checkpoint(two_ranks.parent, tmp_path / "fp32")  # a checkpoint root: its newest complete step
    report = export_checkpoint(two_ranks, tmp_path / "bf16", dtype="bf16", max_shard_size="100KB")
    out = tmp_path / "bf16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).stat().st_size <= 100_000 + 10_000 for s in shards)
    assert index["metadata"]["total_size"] == report.bytes
    full = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    halves = {k: v for s in shards for k, v in load_file(str(out / s)).items()}
    assert halves.keys() == full.keys() and all(torch.equal(halves[k], full[k].bfloat16()) for k in full)
    hf = _transformers().LlamaForCausalLM.from_pretrained(str(out))
    assert hf.dtype == torch.bfloat16 and json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_rope_reordering_matches_transformers_rotate_half():
    """zb's pairwise rotation of q equals transformers' half-split rotation of the reordered q."""
    from zb.export.hf_llama import interleaved_to_half
    from zb.models.llama import apply_rope, rope_tables

    heads, head_dim, dim, t = 3, 8, 5, 6
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(heads * head_dim, dim, generator=gen), torch.randn(1, t, dim, generator=gen)
    cos, sin = rope_tables(head_dim, t, 10000.0)
    zb_q = apply_rope((x @ w.T).view(1, t, heads, head_dim), cos, sin)  # computes in fp32
    q = (x @ interleaved_to_half(w, heads, head_dim).T).view(1, t, heads, head_dim)
    cos2, sin2 = torch.cat((cos, cos), -1)[None, :, None], torch.cat((sin, sin), -1)[None, :, None]
    rotated = torch.cat((-q[..., head_dim // 2:], q[..., :head_dim // 2]), -1)
    hf_q = q * cos2 + rotated * sin2
    perm = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    assert torch.allclose(hf_q, zb_q[..., perm], atol=1e-5)


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_an_existing_out_is_never_overwritten(one_rank, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    before = _tree(tmp_path / "mine")
    proc = zb_process("export", str(one_rank), str(tmp_path / "mine"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: output directory {tmp_path / 'mine'} exists; choose a new one (nothing was written), or pass "
        "--force to replace an earlier export"]
    with pytest.raises(InvalidInput, match="not an earlier zb export .* even with --force"):
        export_checkpoint(one_rank, tmp_path / "mine", force=True)
    assert _tree(tmp_path / "mine") == before
    export_checkpoint(one_rank, tmp_path / "hf")
    export_checkpoint(one_rank, tmp_path / "hf", force=True, dtype="bf16")  # an earlier export: replaced
    assert json.loads((tmp_path / "hf" / "zb_export.json").read_text())["dtype"] == "bf16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine"]  # no temporary directory left


def test_missing_parents_of_out_are_made_as_the_readme_writes_it(one_rank, tmp_path):
    """`zb export CKPT out/my-model` was refused for its missing parent (issue 30, defect 7)."""
    proc = zb_process("export", str(one_rank), str(tmp_path / "out" / "my-model"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "my-model" / "zb_export.json").is_file()
    (tmp_path / "afile").write_text("x")
    with pytest.raises(InvalidInput, match="afile is not a directory"):
        export_checkpoint(one_rank, tmp_path / "afile" / "sub" / "model")


def _copy(step_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt" / step_dir.name
    shutil.copytree(step_dir, copy)
    return copy


def test_damaged_or_incomplete_checkpoints_are_refused(two_ranks, tmp_path):
    out = tmp_path / "out"
    damaged = _copy(two_ranks, tmp_path / "a")
    with open(damaged / "rank-1" / "outer.safetensors", "r+b") as f:  # same size, one byte changed
        f.seek(-5, 2)
        byte = f.read(1)
        f.seek(-5, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    proc = zb_process("export", str(damaged), str(out))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: checkpoint {damaged} is damaged: {damaged / 'rank-1' / 'outer.safetensors'}: sha256 does not "
        "match the manifest (corrupted)"]
    # --inner reads model.safetensors only, which is intact.
    export_checkpoint(damaged, out, inner=True)
    incomplete = _copy(two_ranks, tmp_path / "b")
    (incomplete / "rank-1" / "COMMITTED").unlink()
    with pytest.raises(InvalidInput, match="is incomplete or damaged: .*rank-1 is not a committed snapshot"):
        export_checkpoint(incomplete, tmp_path / "out2")
    truncated = _copy(two_ranks, tmp_path / "c")
    with open(truncated / "rank-0" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(InvalidInput, match="incomplete or damaged: .*has 100 bytes, the manifest says"):
        export_checkpoint(truncated, tmp_path / "out3")
    with pytest.raises(InvalidInput, match="no complete checkpoint under .*the newest, step 8, is incomplete"):
        export_checkpoint(truncated.parent, tmp_path / "out4")
    assert not any(p.name.startswith(("out2", "out3", "out4", ".tmp-")) for p in tmp_path.iterdir())


def _rewrite_config(step_dir: Path, change) -> None:
    """Edit every part's manifest config and re-commit it (marker = sha256 of the manifest)."""
    for part in step_dir.glob("rank-*"):
        manifest = json.loads((part / "manifest.json").read_text())
        change(manifest["meta"]["config"])
        data = json.dumps(manifest, sort_keys=True).encode()
        (part / "manifest.json").write_bytes(data)
        (part / "COMMITTED").write_text(hashlib.sha256(data).hexdigest())


def test_models_llama_cannot_express_are_refused(one_rank, tmp_path):
    from zb.export.hf_llama import hf_name

    other = _copy(one_rank, tmp_path / "a")
    _rewrite_config(other, lambda c: c["model"].update(type="mamba"))
    with pytest.raises(InvalidInput, match="model family 'mamba'; zb export --format hf knows llama2 and llama3"):
        export_checkpoint(other, tmp_path / "out")
    wrong = _copy(one_rank, tmp_path / "b")
    _rewrite_config(wrong, lambda c: c["model"].update(n_layers=3))
    with pytest.raises(InvalidInput, match="has no tensor layers.2.attention.wq.weight"):
        export_checkpoint(wrong, tmp_path / "out")
    with pytest.raises(InvalidInput, match="layers.0.attention.q_norm.weight has no place in Hugging Face's Llama"):
        hf_name("layers.0.attention.q_norm.weight")
    assert not (tmp_path / "out").exists()


def test_tokenizer_that_is_not_available_locally(one_rank, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ZB_DATA_CACHE", str(tmp_path / "cache"))
    other = _copy(one_rank, tmp_path / "a")
    _rewrite_config(other, lambda c: c["data"].update(tokenizer="owner/not-cached"))
    report = export_checkpoint(other, tmp_path / "out")
    assert report.tokenizer.startswith("no tokenizer files: the run's tokenizer 'owner/not-cached'")
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["eos_token_id"] is None
    with pytest.raises(InvalidInput, match="--tokenizer 'owner/not-cached': no tokenizer.json there"):
        export_checkpoint(other, tmp_path / "out2", tokenizer="owner/not-cached")
    # A tokenizer.json given by path is copied (with the files beside it), its BOS/EOS in config.json.
    export_checkpoint(one_rank, tmp_path / "bytes")
    report = export_checkpoint(other, tmp_path / "out5", tokenizer=str(tmp_path / "bytes" / "tokenizer.json"))
    assert "tokenizer.json" in report.files and "copied from" in report.tokenizer
    assert json.loads((tmp_path / "out5" / "config.json").read_text())["eos_token_id"] == 257


def test_max_shard_size_and_dtype_are_checked(one_rank, tmp_path):
    with pytest.raises(InvalidInput, match="--max-shard-size: 'lots' is not a size"):
        export_checkpoint(one_rank, tmp_path / "o", max_shard_size="lots")
    with pytest.raises(InvalidInput, match="--dtype 'fp16': must be one of fp32, bf16"):
        export_checkpoint(one_rank, tmp_path / "o", dtype="fp16")
    assert not (tmp_path / "o").exists()


def test_export_benchmark_runs_on_existing_checkpoints(one_rank, two_ranks, capsys):
    from conftest import load_script

    result = load_script("bench_export").main(["--checkpoints", f"{one_rank},{two_ranks}", "--repeats", "1", "--json"])
    assert [row["local_ranks"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        assert set(row["ratio_to_copy"]) == {"outer fp32", "outer bf16", "inner fp32"}
        assert all(s > 0 for s in row["seconds"].values())
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith('{"benchmark": "export"')


def test_provenance_records_the_weights_sha256(one_rank, tmp_path):
    export_checkpoint(one_rank, tmp_path / "hf", max_shard_size="200KB")
    out = tmp_path / "hf"
    provenance = json.loads((out / "zb_export.json").read_text())
    assert provenance["step"] == 8 and provenance["params"] == "inner" and len(provenance["sha256"]) > 1
    for name, digest in provenance["sha256"].items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    assert sorted(provenance["files"]) == sorted(p.name for p in out.iterdir())


def test_a_full_disk_is_exit_1_and_leaves_the_earlier_export_whole(one_rank, tmp_path):
    from ckpt_states import tmpfs

    from zb.errors import EnvironmentFailure

    with tmpfs(tmp_path / "small", 450_000) as disk:
        export_checkpoint(one_rank, disk / "hf", dtype="bf16")  # ~0.3 MB: fits
        before = _tree(disk / "hf")
        with pytest.raises(EnvironmentFailure, match=r"writing the export .*/hf failed \(No space left on device"):
            export_checkpoint(one_rank, disk / "hf", force=True)  # fp32, ~0.6 MB: does not
        assert _tree(disk / "hf") == before and sorted(p.name for p in disk.iterdir()) == ["hf"]


def test_a_disk_without_room_for_the_tokenizer_is_one_line_naming_its_free_space(one_rank, tmp_path):
    """`zb export` itself, out of room after the weights (tokenizer.json, which the tokenizers library
    wrote: its error was a bare Exception and a traceback): exit 1, one line naming OUT and the free
    space, and nothing left on the disk."""
    from ckpt_states import tmpfs

    probe = tmp_path / "probe"
    export_checkpoint(one_rank, probe, dtype="bf16")
    page = 4096
    weights = -(-(probe / "model.safetensors").stat().st_size // page) * page
    assert (probe / "tokenizer.json").stat().st_size > page, "the tokenizer must not fit in the page left"
    with tmpfs(tmp_path / "small", weights + page) as disk:
        proc = zb_process("export", str(one_rank), str(disk / "hf"), "--dtype", "bf16")
        left = sorted(p.name for p in disk.iterdir())
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"error: writing the export {re.escape(str(disk / 'hf'))} failed \(No space left on device"
                        r"(: \S+)?; [\d.,]+ \w+ free there\); free space or choose another disk \(nothing was left "
                        r"behind\)", last), last
    assert left == []
