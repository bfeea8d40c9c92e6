"""`zb generate` on checkpoints of real tiny runs: greedy output is deterministic and equals a greedy
loop written here over the checkpoint's own tensors; a seed reproduces a sampled completion; DiLoCo
outer params; bad inputs fail in one line with exit 2.

The reference is independent of zb.generate and zb.export: the model shards read with safetensors,
zb's Transformer, argmax over the tokenizer's ids, the context cut to the last seq_length tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zb.generate import Sampling, next_token
from zb.testing.procs import TINY, free_port, zb_process

SEQ = 32  # TINY's data.seq_length: the model's context
EOS = 257  # zb's byte tokenizer: bytes 0-255, BOS 256, EOS 257, PAD 258


def _train(tmp: Path, *args: str, **env: str) -> Path:
    proc = zb_process("train", *TINY, "--optim.total_steps", "8", "--ckpt.path", str(tmp / "ckpt"), "--ckpt.interval",
                      "4", "--ckpt.ram_dir", str(tmp / "ram"), "--log.dir", str(tmp / "log"), *args, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "ckpt" / "step-000000008"


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def diloco(tmp_path_factory) -> Path:
    """One DiLoCo node (its own store): step 8 is an outer step, so inner and outer params agree."""
    return _train(tmp_path_factory.mktemp("diloco"), "--diloco.inner_steps", "4", "--elastic.host_store",
                  GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(free_port()), GLOBAL_UNIQUE_ID="node-a")


def generate(run_zb, *args: str) -> dict:
    result = run_zb("generate", *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def reference_greedy(step_dir: Path, prompt: str, max_new_tokens: int) -> list[int]:
    from safetensors import safe_open

    from zb.config_schema import ModelConfig
    from zb.models import Transformer, model_args

    with safe_open(str(step_dir / "rank-0" / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    config = json.loads((step_dir / "rank-0" / "manifest.json").read_text())["meta"]["config"]
    model = Transformer(model_args(ModelConfig(**config["model"]), vocab_size=state["tok_embeddings.weight"].shape[0],
                                   max_seq_len=config["data"]["seq_length"]))
    model.load_state_dict(state, strict=True)
    model.reset_rope()
    ids, out = [EOS, *prompt.encode()], []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model.eval()(torch.tensor([ids[-SEQ:]]))[0, -1, :259].argmax())
            if token == EOS:
                break
            out.append(token)
            ids.append(token)
    return out


@pytest.mark.parametrize("prompt", ["The cat", "A prompt longer than the model's context of 32 bytes, cut."])
def test_greedy_is_deterministic_and_equals_a_plain_greedy_loop(plain, run_zb, prompt):
    first = generate(run_zb, str(plain), "--prompt", prompt, "--max-new-tokens", "40")
    assert first == {**generate(run_zb, str(plain), "--prompt", prompt, "--max-new-tokens", "40"),
                     "seconds": first["seconds"]}
    assert first["prompt_ids"] == [EOS, *prompt.encode()] and first["params"] == "inner" and first["step"] == 8
    assert first["completion_ids"] == reference_greedy(plain, prompt, 40)
    assert first["completion"] == bytes(first["completion_ids"]).decode("utf-8", errors="replace")
    assert first["stop"] == ("eos" if len(first["completion_ids"]) < 40 else "max_new_tokens")


def test_a_seed_reproduces_a_sampled_completion(plain, run_zb):
    args = [str(plain.parent), "--prompt", "The", "--max-new-tokens", "40", "--temperature", "1", "--top-p", "0.95"]
    a = generate(run_zb, *args, "--seed", "7")
    assert a["completion_ids"] == generate(run_zb, *args, "--seed", "7")["completion_ids"] and a["seed"] == 7
    assert a["completion_ids"] != generate(run_zb, *args, "--seed", "8")["completion_ids"]
    drawn = generate(run_zb, *args)["seed"]  # none given: a random one, reported so it can be repeated
    assert isinstance(drawn, int) and drawn >= 0


def test_top_p_keeps_the_smallest_set_reaching_it():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    gen = torch.Generator().manual_seed(0)
    assert {next_token(logits, Sampling(1.0, 0.7), gen) for _ in range(300)} == {0, 1}
    assert {next_token(logits, Sampling(1.0, 0.5), gen) for _ in range(50)} == {0}
    assert {next_token(logits, Sampling(1.0, 1.0), gen) for _ in range(1000)} == {0, 1, 2, 3}
    assert next_token(logits, Sampling(0.0), gen) == 0


def test_outer_params_of_a_diloco_checkpoint(diloco, run_zb):
    outer = generate(run_zb, str(diloco / "rank-0"), "--prompt", "The cat", "--params", "outer")
    inner = generate(run_zb, str(diloco), "--prompt", "The cat")
    assert outer["params"] == "outer" and outer["completion_ids"] == inner["completion_ids"]


def test_the_completion_goes_to_stdout_and_the_summary_to_stderr(plain):
    proc = zb_process("generate", str(plain), "--prompt", "The cat", "--max-new-tokens", "8", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == bytes(reference_greedy(plain, "The cat", 8)).decode("utf-8", errors="replace") + "\n"
    assert "warning: --seed has no effect with --temperature 0 (greedy)" in proc.stderr
    assert f"zb generate: step 8 of {plain} (inner params, fp32 on cpu), greedy: " in proc.stderr


def test_bad_inputs_exit_2_with_one_line(plain, tmp_path, run_zb):
    proc = zb_process("generate", str(tmp_path / "missing"), "--prompt", "x")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        (f"error: checkpoint {tmp_path / 'missing'} does not exist; name a step directory (<ckpt.path>/step-NNNNNNNNN) "
         "or a checkpoint root")]
    proc = zb_process("generate", str(plain), "--prompt", "x", "--params", "outer")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        (f"error: --params outer: checkpoint {plain} has no DiLoCo outer params (a run without DiLoCo); use "
         "--params inner")]
    for value in ("1.5", "0", "nan"):
        result = run_zb("generate", str(plain), "--prompt", "x", "--top-p", value)
        assert result.exit_code == 2 and "Invalid value for '--top-p'" in result.output
    assert run_zb("generate", str(plain), "--prompt", "x", "--temperature", "-1").exit_code == 2
