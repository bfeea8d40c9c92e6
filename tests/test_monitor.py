"""Metric backends (log.backends: jsonl, wandb, tensorboard), Prime's wandb settings, MFU and perplexity.

The wandb test runs a real `zb train` with WANDB_MODE=offline (no network) and reads back the run's
transaction log; the tensorboard test reads the event files with tensorboard's own reader.
"""

from __future__ import annotations

import math
import subprocess

import pytest

from zb.config import ConfigError, load_config
from zb.metrics import MetricsSink, read_metrics
from zb.monitor.scalars import scalars
from zb.monitor.wandb_backend import init_arguments
from zb.testing.procs import PYTHON, REPO, TINY, free_port, subprocess_env, zb_process


def test_step_scalars_take_primes_wandb_names():
    record = {"event": "step", "time": 1.0, "node": "a", "step": 10, "outer_step": 1, "loss": 2.0, "lr": 1e-3,
              "grad_norm": 0.5, "z_loss": 3.0, "tokens": 640, "tokens_per_s": 100.0, "run_tokens": 1280,
              "run_tokens_per_s": 200.0, "perplexity": math.exp(2.0), "mfu": None}
    assert scalars(record) == {"step": 10, "outer_step": 1, "Loss": 2.0, "inner_lr": 1e-3, "grad_norm": 0.5,
                               "z_loss": 3.0, "step/tokens": 640, "tokens_per_second": 100.0, "total_tokens": 1280,
                               "step/run_tokens_per_s": 200.0, "Perplexity": math.exp(2.0)}
    outer = {"event": "outer_step", "outer_step": 2, "step": 20, "allreduce_s": 0.5, "num_peers": 2, "applied": True,
             "outer_tokens_per_s": 50.0, "outer_mfu": 1.5, "params_hash": "ab12", "wire_mbps": "nan"}
    assert scalars(outer) == {"outer_step": 2, "step": 20, "all_reduce_step": 0.5, "num_peers": 2,
                              "outer_step/applied": 1, "outer_tokens_per_second": 50.0, "outer_mfu": 1.5}
    assert scalars({"event": "eval", "step": 5, "loss": 1.0}) == {"step": 5, "eval/loss": 1.0}
    assert scalars({"event": "run_start", "pid": 3}) == {}


def test_wandb_init_arguments_follow_primes_settings():
    cfg = load_config([], {"log.wandb_project": "p", "log.wandb_id": "r1", "log.wandb_resume": "true",
                           "log.wandb_mode": "offline", "log.dir": "/x"}, environ={})
    alone = init_arguments(cfg.log, node="n1", diloco=False)
    assert alone == {"project": "p", "name": "n1", "group": None, "id": "r1", "dir": "/x", "resume": "allow",
                     "mode": "offline"}
    # Each DiLoCo node logs its own run: the ids must not collide.
    assert init_arguments(cfg.log, node="n1", diloco=True)["id"] == "r1-n1"
    plain = load_config([], {"log.wandb_resume": "true", "log.wandb_name": "first"}, environ={})
    args = init_arguments(plain.log, node="n1", diloco=True)
    assert args["resume"] == "auto" and args["id"] is None and args["name"] == "first" and "mode" not in args


def test_backends_are_a_list_from_toml_flags_and_env(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[log]\nbackends = ["jsonl", "tensorboard", "jsonl"]\n')
    assert load_config([str(path)], {}, environ={}).log.backends == "jsonl,tensorboard"
    assert load_config([], {"log.backends": "wandb, jsonl"}, environ={}).log.backends == "wandb,jsonl"
    assert load_config([], {}, environ={"ZB_LOG_BACKENDS": "tensorboard"}).log.backends == "tensorboard"
    with pytest.raises(ConfigError, match=r"log.backends = 'jsonl,mlflow' \(from flag --log.backends\): unknown "
                                          r"entry 'mlflow'; each must be one of jsonl, wandb, tensorboard"):
        load_config([], {"log.backends": "jsonl,mlflow"}, environ={})
    with pytest.raises(ConfigError, match="give at least one of"):
        load_config([], {"log.backends": ","}, environ={})
    path.write_text("[log]\nbackends = [1]\n")
    with pytest.raises(ConfigError, match="expected str"):
        load_config([str(path)], {}, environ={})


def test_primes_metric_logger_settings_map_onto_the_backends(tmp_path):
    path = tmp_path / "prime.toml"
    path.write_text('name_model = "debugmodel"\nproject = "proj"\nrun_name = "first"\nrun_id = "abc"\n'
                    'metric_logger_type = "wandb"\nwandb_resume = true\n')
    cfg = load_config([str(path)], {}, environ={})
    assert (cfg.log.backends, cfg.log.wandb_project, cfg.log.wandb_name, cfg.log.wandb_id, cfg.log.wandb_resume) == \
        ("jsonl,wandb", "proj", "first", "abc", True)
    path.write_text('name_model = "debugmodel"\nmetric_logger_type = "dummy"\n')
    cfg = load_config([str(path)], {}, environ={})
    assert cfg.log.backends == "jsonl" and cfg.log.wandb_project == "zeroband"  # Prime's default project
    path.write_text('name_model = "debugmodel"\nmetric_logger_type = "mlflow"\n')
    with pytest.raises(ConfigError, match="metric_logger_type = 'mlflow'.*must be one of wandb or dummy"):
        load_config([str(path)], {}, environ={})


class _Failing:
    name = "flaky"

    def __init__(self):
        self.closed = False

    def write(self, record):
        raise RuntimeError("server went away")

    def close(self):
        self.closed = True


def test_a_failing_backend_is_dropped_with_one_warning_and_the_file_goes_on(tmp_path, caplog):
    flaky = _Failing()
    sink = MetricsSink(tmp_path, "a", backends=[flaky])
    sink.log("step", step=1, loss=1.0)
    sink.log("step", step=2, loss=0.5)
    sink.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl", "step")] == [1, 2]
    assert flaky.closed and sum("metrics backend flaky failed" in r.message for r in caplog.records) == 1


def test_without_jsonl_no_file_is_written(tmp_path):
    sink = MetricsSink(tmp_path, "a", jsonl=False)
    sink.log("step", step=1)
    sink.close()
    assert sink.path is None and not (tmp_path / "metrics.jsonl").exists()


def _diloco_run(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """A tiny one-node DiLoCo run hosting its own store: step, eval and outer_step events in seconds."""
    return zb_process("train", *TINY, "--optim.total_steps", "8", "--diloco.inner_steps", "4",
                      "--elastic.host_store", "--ckpt.ram_dir", str(tmp_path / "ram"),
                      "--log.dir", str(tmp_path / "log"), "--eval.interval", "4", *args, GLOBAL_ADDR="127.0.0.1", GLOBAL_PORT=str(free_port()),
                      GLOBAL_UNIQUE_ID="node-a", **env)


def test_wandb_offline_and_tensorboard_get_what_metrics_jsonl_gets(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from wandb_records import history, run_info

    proc = _diloco_run(tmp_path, "--log.backends", "jsonl,wandb,tensorboard", "--log.wandb_project", "proj",
                       "--log.wandb_id", "run1", "--log.wandb_group", "g", "--train.peak_tflops", "0.01",
                       WANDB_MODE="offline", WANDB_SILENT="true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = tmp_path / "log"
    steps = read_metrics(log / "metrics.jsonl", "step")
    outer = read_metrics(log / "metrics.jsonl", "outer_step")
    assert [s["step"] for s in steps] == list(range(1, 9)) and len(outer) == 2
    for s in steps:
        assert s["perplexity"] == pytest.approx(math.exp(s["loss"]), rel=1e-9)
        assert s["mfu"] > 0
    assert all(o["outer_mfu"] > 0 and o["outer_tokens_per_s"] > 0 for o in outer)

    (wandb_file,) = (log / "wandb").glob("offline-run-*/run-*.wandb")
    info = run_info(wandb_file)
    assert (info["id"], info["name"], info["project"], info["group"]) == ("run1-node-a", "node-a", "proj", "g")
    assert info["config"]["log"]["backends"] == "jsonl,wandb,tensorboard"
    rows = history(wandb_file)
    logged = {row["step"]: row for row in rows if "Loss" in row}
    assert sorted(logged) == list(range(1, 9))
    for s in steps:
        row = logged[s["step"]]
        assert row["Loss"] == pytest.approx(s["loss"]) and row["Perplexity"] == pytest.approx(s["perplexity"])
        assert row["mfu"] == pytest.approx(s["mfu"]) and row["total_tokens"] == s["run_tokens"]
    assert [r["all_reduce_step"] for r in rows if "outer_mfu" in r] == pytest.approx([o["allreduce_s"] for o in outer])
    assert any("eval/loss" in r for r in rows)

    acc = EventAccumulator(str(log / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("Loss")] == [(s["step"], pytest.approx(s["loss"])) for s in steps]
    assert [e.step for e in acc.Scalars("outer_mfu")] == [o["step"] for o in outer]


def test_a_missing_backend_package_is_one_line_naming_the_extra(tmp_path):
    # wandb blocked in the child even where it is installed.
    code = "import sys; sys.modules['wandb'] = None; from zb.cli import main; main(sys.argv[1:])"
    proc = subprocess.run([PYTHON, "-c", code, "train", *TINY, "--optim.total_steps", "2", "--log.dir", str(tmp_path),
                           "--log.backends", "jsonl,wandb"], capture_output=True, text=True, timeout=150,
                          env=subprocess_env(), cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: log.backends = 'jsonl,wandb' needs wandb, which is not installed: pip install 'zb[monitor]'")
    assert "Traceback" not in proc.stderr


def test_wandb_settings_without_the_wandb_backend_are_warned_about(tmp_path):
    proc = zb_process("train", *TINY, "--optim.total_steps", "1", "--log.dir", str(tmp_path),
                      "--log.wandb_project", "p")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "settings without effect (log.wandb_project): log.backends = 'jsonl' does not include wandb" in proc.stderr


def test_flops_per_token_counts_every_matmul_weight_and_attention():
    from zb.config_schema import ModelConfig
    from zb.models import Transformer, count_params, model_args
    from zb.models.flops import flops_per_token, non_embedding_params

    for name, family in (("debug", "llama3"), ("tiny", "llama2")):
        args = model_args(ModelConfig(name=name, type=family), vocab_size=259, max_seq_len=64)
        model = Transformer(args)
        assert non_embedding_params(args) == count_params(model) - model.tok_embeddings.weight.numel()
        assert flops_per_token(args, 64) == 6 * non_embedding_params(args) + 12 * args.n_layers * args.dim * 64


def test_peak_table_and_mfu():
    import torch

    from zb.train.mfu import mfu_percent, peak_flops, table_peak_tflops

    assert table_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert table_peak_tflops("NVIDIA H100 PCIe") == 756.0 and table_peak_tflops("NVIDIA H100 NVL") == 835.0
    assert table_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0 and table_peak_tflops("NVIDIA A10") == 125.0
    assert table_peak_tflops("NVIDIA A10G") is None and table_peak_tflops("NVIDIA L4") == 121.0
    assert peak_flops(torch.device("cpu"), None)[0] is None
    assert peak_flops(torch.device("cpu"), 2.0) == (2e12, "train.peak_tflops = 2")
    # 1e9 FLOPs per token at 1000 tokens/s on 2 devices of 1 TFLOPS each: 50%.
    assert mfu_percent(1e9, 1000.0, 1e12, 2) == pytest.approx(50.0)
    assert mfu_percent(1e9, 1000.0, None, 2) is None


def test_a_wandb_run_that_cannot_start_is_one_line_suggesting_offline(tmp_path):
    pytest.importorskip("wandb")
    env = {k: v for k, v in subprocess_env(HOME=str(tmp_path), WANDB_SILENT="true").items()
           if k not in ("WANDB_API_KEY", "WANDB_MODE", "NETRC")}
    proc = subprocess.run([PYTHON, "-m", "zb", "train", *TINY, "--optim.total_steps", "1", "--log.dir", str(tmp_path),
                           "--log.backends", "wandb", "--log.wandb_mode", "online"],
                          capture_output=True, text=True, timeout=150, env=env, cwd=REPO)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: log.backends wandb: could not start a wandb run in online mode (")
    assert last.endswith("without a network or a wandb login use --log.wandb_mode offline (upload later with "
                         "`wandb sync`)")
    assert "Traceback" not in proc.stderr and not (tmp_path / "metrics.jsonl").exists()
