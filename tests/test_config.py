"""Config: sources and their order, env twins, every error path, and the shipped configs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zb.config import KEYS, ConfigError, describe, load_config

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_are_valid_and_diloco_is_off():
    cfg = load_config([], {}, environ={})
    assert cfg.diloco is None
    assert cfg.optim.lr > 0


def test_later_sources_win(tmp_path):
    a = write(tmp_path, "a.toml", "[optim]\nlr = 0.1\nwarmup_steps = 5\n")
    b = write(tmp_path, "b.toml", "[optim]\nlr = 0.2\n")
    cfg = load_config([a, b], {}, environ={})
    assert cfg.optim.lr == 0.2 and cfg.optim.warmup_steps == 5
    cfg = load_config([a, b], {}, environ={"ZB_OPTIM_LR": "0.3"})
    assert cfg.optim.lr == 0.3
    cfg = load_config([a, b], {"optim.lr": "0.4"}, environ={"ZB_OPTIM_LR": "0.3"})
    assert cfg.optim.lr == 0.4
    assert "flag --optim.lr" in describe(cfg)


def test_dashes_and_underscores_name_the_same_key():
    cfg = load_config([], {"--optim.warmup-steps": "7"}, environ={})
    assert cfg.optim.warmup_steps == 7


def test_prime_env_names_and_aliases():
    env = {"GLOBAL_WORLD_SIZE": "3", "ZERO_BAND_EDM_HEARTBEAT_TIMEOUT_SECONDS": "12"}
    cfg = load_config([], {"diloco.compression": "uint8"}, environ=env)
    assert cfg.elastic.world_size == 3 and cfg.elastic.heartbeat_timeout == 12.0
    assert cfg.diloco is not None and cfg.diloco.compression == "int8"
    assert load_config([], {"diloco.compression": "no"}, environ={}).diloco.compression == "none"


def test_empty_diloco_table_turns_diloco_on(tmp_path):
    cfg = load_config([write(tmp_path, "d.toml", "[diloco]\n")], {}, environ={})
    assert cfg.diloco is not None and cfg.diloco.inner_steps == 100


def test_unknown_env_var_is_a_warning_not_an_error(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="zb.config"):
        load_config([], {}, environ={"ZB_OPTIM_LRR": "1"})
    assert "ZB_OPTIM_LRR" in caplog.text and "ZB_OPTIM_LR" in caplog.text


def test_prime_variables_are_read_or_warned_about(caplog, monkeypatch):
    """A Prime user's ZERO_BAND_* settings never vanish without a word."""
    import logging

    from zb.log import apply_log_config

    env = {"ZERO_BAND_GLOBAL_PG_TIMEOUT_SECONDS": "7", "ZERO_BAND_LOG_LEVEL": "DEBUG",
           "ZERO_BAND_LOG_ALL_RANK": "true", "ZERO_BAND_IPERF_PORT": "10101", "ZERO_BAND_OPTIM_LRR": "1"}
    with caplog.at_level(logging.WARNING, logger="zb.config"):
        cfg = load_config([], {}, environ=env)
    assert cfg.elastic.pg_timeout == 7.0
    assert "ZERO_BAND_IPERF_PORT has no effect in zb" in caplog.text
    assert "ignoring unknown environment variable ZERO_BAND_OPTIM_LRR" in caplog.text
    assert "ZERO_BAND_LOG_ALL_RANK" not in caplog.text and "ZERO_BAND_LOG_LEVEL" not in caplog.text
    assert cfg.log.level == "DEBUG" and cfg.log.all_ranks
    zb_logger = logging.getLogger("zb")
    monkeypatch.setattr(zb_logger, "level", logging.INFO)
    apply_log_config("INFO", cfg.log.all_ranks, local_rank=1)
    assert zb_logger.level == logging.INFO, "ZERO_BAND_LOG_ALL_RANK=true keeps a follower rank's info lines"
    apply_log_config("INFO", False, local_rank=1)
    assert zb_logger.level == logging.WARNING, "without it a follower rank logs warnings only"


@pytest.mark.parametrize("text, message", [
    ("[optim]\nlrr = 1\n", "unknown key optim.lrr in"),
    ("[optimizer]\nlr = 1\n", "unknown section [optimizer] in"),
    ("[zzzq]\nlr = 1\n", "; the sections are [ckpt], [data], [diloco], [elastic], [eval], [log], [model], [optim]"),
    ("[optim]\nlr = -1.0\n", "optim.lr = -1.0 (from file"),
    ("[optim]\nlr = 'fast'\n", "optim.lr = 'fast' (from file"),
    ("[optim]\nbatch_size = 10\n[train]\nmicro_bs = 4\n", "must be a multiple of train.micro_bs"),
    ("[diloco]\ncompression = 'fp8'\n", "must be one of none, int8"),
    ("[train]\nmicro_bs = 2.5\n", "expected int"),
    ("[optim\nlr = 1\n", "is not valid TOML"),
])
def test_bad_files_name_key_and_file(tmp_path, text, message):
    path = write(tmp_path, "bad.toml", text)
    with pytest.raises(ConfigError) as e:
        load_config([path], {}, environ={})
    assert message in str(e.value)
    assert e.value.exit_code == 2


def test_bad_flag_and_env_values_name_their_source():
    with pytest.raises(ConfigError, match=r"flag --optim.total_steps.*must be positive"):
        load_config([], {"optim.total_steps": "0"}, environ={})
    with pytest.raises(ConfigError, match=r"env ZB_TRAIN_SEED"):
        load_config([], {}, environ={"ZB_TRAIN_SEED": "abc"})
    with pytest.raises(ConfigError, match="unknown key optim.lrr; did you mean optim.lr"):
        load_config([], {"optim.lrr": "1"}, environ={})


def test_missing_file():
    with pytest.raises(ConfigError, match="not found"):
        load_config(["/nonexistent/x.toml"], {}, environ={})


def test_every_key_has_a_doc_and_one_env_twin():
    envs = [spec.env for spec in KEYS.values()]
    assert len(envs) == len(set(envs))
    assert all(spec.doc for spec in KEYS.values())


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.toml")))
def test_shipped_configs_validate(path):
    from zb.models import model_args

    cfg = load_config([str(REPO / path)], {}, environ={})
    model_args(cfg.model, vocab_size=50_000, max_seq_len=cfg.data.seq_length)


FLOAT_KEYS = sorted(k for k, spec in KEYS.items() if spec.type is float)


@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_key_refuses_nan_and_inf(key):
    for bad in ("nan", "inf", "-inf"):
        with pytest.raises(ConfigError, match=f"{key} = .*must be a finite number"):
            load_config(flags={key: bad})
    with pytest.raises(ConfigError, match="must be a finite number"):
        load_config(environ={KEYS[key].env: "nan"})


def test_float_options_of_every_command_refuse_nan_and_inf(run_zb):
    import click

    from zb.cli import cli
    from zb.cli.types import FiniteFloatRange

    checked, ctx = 0, click.Context(cli)
    for name in cli.list_commands(ctx):
        for param in cli.get_command(ctx, name).params:
            if isinstance(param, click.Option) and isinstance(param.type, (click.FloatRange, type(click.FLOAT))):
                assert isinstance(param.type, FiniteFloatRange), f"zb {name} {param.opts[0]} accepts nan"
                for bad in ("nan", "inf"):
                    result = run_zb(name, param.opts[0], bad)
                    assert result.exit_code == 2 and "not a finite number" in result.output, (name, param.opts[0])
                checked += 1
    assert checked >= 7


@pytest.mark.parametrize("uid", ["../../etc", "a/b", "..", ".hidden", "a b", "x" * 65, "-n"])
def test_unique_id_that_is_not_a_plain_name_is_refused(uid, run_zb):
    with pytest.raises(ConfigError, match="elastic.unique_id .*must be 1-64 letters"):
        load_config(environ={"GLOBAL_UNIQUE_ID": uid})
    result = run_zb("ckpt-serve", "--dir", "unused", "--node-id", uid)
    assert result.exit_code == 2 and "must be 1-64 letters" in result.output


def test_generated_and_usual_unique_ids_are_accepted():
    from zb.config import NODE_ID
    from zb.elastic.identity import new_uid

    for uid in (new_uid(), "node-1", "gpu_box.eu-west", "A" * 64):
        assert load_config(environ={"GLOBAL_UNIQUE_ID": uid}).elastic.unique_id == uid
        assert NODE_ID.fullmatch(uid)


@pytest.mark.parametrize("path", ["configs/debug/normal.toml", "configs/debug/diloco.toml"])
def test_print_config_loads_back_to_the_same_config(path, tmp_path):
    """--print-config is TOML that loads back: each table declared once (ckpt.remote used to split
    [ckpt] in two), values unchanged."""
    import tomllib

    from zb.config import to_dict

    cfg = load_config([str(REPO / path)])
    printed = tmp_path / "printed.toml"
    printed.write_text(describe(cfg))
    tomllib.loads(printed.read_text())
    assert to_dict(load_config([str(printed)])) == to_dict(cfg)


DEEP = 5000  # past Python's recursion limit: tomllib recurses once per nesting level


@pytest.mark.parametrize("text", ["x = " + "[" * DEEP + "]" * DEEP + "\n",
                                  "x = " + "{a = " * DEEP + "1" + "}" * DEEP + "\n"])
def test_deeply_nested_toml_is_an_invalid_file_not_a_crash(tmp_path, text):
    path = write(tmp_path, "deep.toml", text)
    with pytest.raises(ConfigError, match=f"config file {path} is not valid TOML: nested too deeply") as e:
        load_config([path], {}, environ={})
    assert e.value.exit_code == 2


def test_text_that_is_not_utf8_is_refused_naming_the_variable():
    # Python hands undecodable bytes of the environment and argv over as lone surrogates.
    with pytest.raises(ConfigError, match=r"elastic.addr = '\\udcff' \(from env GLOBAL_ADDR\): not UTF-8 text"):
        load_config(environ={"GLOBAL_ADDR": "\udcff"})
    with pytest.raises(ConfigError, match=r"ckpt.path = 'a\\udcffb' \(from flag --ckpt.path\): not UTF-8 text"):
        load_config(flags={"ckpt.path": "a\udcffb"}, environ={})


def test_seq_length_has_an_upper_bound():
    with pytest.raises(ConfigError, match=r"data.seq_length = 1000000000 \(from flag --data.seq_length\): must be "
                                          r"between 1 and 1048576"):
        load_config(flags={"data.seq_length": "1e9"}, environ={})
    assert load_config(flags={"data.seq_length": str(2 ** 20)}, environ={}).data.seq_length == 2 ** 20


def test_resume_latest_without_a_checkpoint_path_is_refused():
    with pytest.raises(ConfigError, match=r"ckpt.resume = 'latest' \(from flag --ckpt.resume\): .*set ckpt.path"):
        load_config(flags={"ckpt.resume": "latest"}, environ={})
    assert load_config(flags={"ckpt.resume": "latest", "ckpt.path": "ck"}, environ={}).ckpt.resume == "latest"
    assert load_config(flags={"ckpt.resume": "ck/step-000000002"}, environ={}).ckpt.resume  # a named step needs none


@pytest.mark.parametrize("value", ["BOGUS", "info", " Warning ", "true", "1", "debug", "NOTSET", "verbose", "\udcff"])
@pytest.mark.parametrize("name", ["ZB_LOG_LEVEL", "ZERO_BAND_LOG_LEVEL"])
def test_early_log_level_and_the_config_agree(name, value):
    """zb.log reads the level before the config (so config errors log at it): the two must agree on
    every value, and neither may ignore one the other refuses."""
    import logging

    from zb.log import level_from_env

    try:
        expected = getattr(logging, load_config(environ={name: value}).log.level)
    except ConfigError as e:
        with pytest.raises(ConfigError) as early:
            level_from_env({name: value})
        assert str(early.value).split(" (from")[0] == str(e).split(" (from")[0]
        assert f"(from env {name}" in str(early.value)
        return
    assert level_from_env({name: value}) == expected


def test_bogus_log_level_stops_every_command_with_one_line():
    from zb.testing.procs import zb_process

    proc = zb_process("store", "--port", "0", ZERO_BAND_LOG_LEVEL="BOGUS")  # refused before --port is parsed
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: log.level = 'BOGUS' (from env ZERO_BAND_LOG_LEVEL): must be one of NOTSET, DEBUG, INFO, WARNING, "
        "ERROR, CRITICAL"]


def test_messages_show_values_as_a_config_file_writes_them():
    """true, not True; unset, not None (issue 30, minor)."""
    from zb.config import toml_value

    with pytest.raises(ConfigError, match=r"^data.fake = true \(from flag --data.fake\): conflicts"):
        load_config([], {"data.fake": "true", "data.dataset_name_or_paths": "x.jsonl"}, environ={})
    assert [toml_value(v) for v in (None, False, "it's", [1, "a"])] == ["unset", "false", '"it\'s"', "[1, 'a']"]


def test_eager_with_outer_momentum_is_warned_about_with_the_measured_reason():
    """BENCHMARKS.md, "Eager across the regime": momentum made eager far worse than blocking here."""
    from zb.config_checks import advisories

    eager = load_config([], {"diloco.overlap": "eager"}, environ={})
    (found,) = [m for k, m in advisories(eager) if k == "diloco.outer_momentum"]
    assert "set diloco.outer_momentum = 0" in found and "Eager across the regime" in found
    plain = load_config([], {"diloco.overlap": "eager", "diloco.outer_momentum": "0"}, environ={})
    assert not [k for k, _ in advisories(plain) if k == "diloco.outer_momentum"]
    assert not [k for k, _ in advisories(load_config([], {"diloco.inner_steps": "10"}, environ={}))
                if k == "diloco.outer_momentum"]


def test_eager_itself_is_warned_about_with_the_measured_gap():
    """BENCHMARKS.md, "Eager across the regime": eager lost to blocking on every model size measured here."""
    from zb.config_checks import advisories

    (found,) = [m for k, m in advisories(load_config([], {"diloco.overlap": "eager"}, environ={}))
                if k == "diloco.overlap"]
    assert "14-37%" in found and "streaming" in found and "Eager across the regime" in found
    for overlap in ("none", "streaming"):
        assert not [k for k, _ in advisories(load_config([], {"diloco.overlap": overlap}, environ={}))
                    if k == "diloco.overlap"]


def test_error_feedback_defaults_by_width_and_is_warned_about_without_compression():
    from zb.config_checks import advisories
    from zb.diloco.error_feedback import enabled

    for compression, on in (("none", False), ("int8", False), ("int4", True), ("int2", True)):
        cfg = load_config([], {"diloco.compression": compression}, environ={})
        assert enabled(cfg.diloco.compression, cfg.diloco.error_feedback) is on
    cfg = load_config([], {"diloco.compression": "int4", "diloco.error_feedback": "false"}, environ={})
    assert not enabled(cfg.diloco.compression, cfg.diloco.error_feedback)
    cfg = load_config([], {"diloco.compression": "int8", "diloco.error_feedback": "true"}, environ={})
    assert enabled(cfg.diloco.compression, cfg.diloco.error_feedback)
    useless = load_config([], {"diloco.error_feedback": "true"}, environ={})
    assert [m for k, m in advisories(useless) if k == "diloco.error_feedback"] == [
        "has no effect with diloco.compression = none (nothing is dropped)"]
    with pytest.raises(ConfigError, match="diloco.compression"):
        load_config([], {"diloco.compression": "int3"}, environ={})


def test_evict_clipped_without_clip_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"diloco.evict_clipped = true \(from flag --diloco.evict_clipped\): needs "
                                          r"diloco.clip") as e:
        load_config([], {"diloco.evict_clipped": "true"}, environ={})
    assert e.value.exit_code == 2
    result = subprocess.run([sys.executable, "-m", "zb", "train", "--diloco.evict_clipped", "true"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "needs diloco.clip" in result.stderr + result.stdout
    assert len((result.stderr + result.stdout).strip().splitlines()) == 1
    assert load_config([], {"diloco.evict_clipped": "true", "diloco.clip": "1"}, environ={}).diloco.evict_clipped
    assert not load_config([], {"diloco.clip": "1"}, environ={}).diloco.evict_clipped


@pytest.mark.parametrize("flags, line", [
    ({"diloco.sparse_k": "5000"}, r"^diloco.sparse_k = 5000 \(from flag --diloco.sparse_k\): is wrong: k = 5000 .*multiple of 8"),
    ({"diloco.sparse_k": "12"}, r"^diloco.sparse_k = 12 .*multiple of 8"),
    ({"diloco.sparse_chunk": "1000"}, r"^diloco.sparse_chunk = 1000 .*power of two"),
    ({"diloco.sparse_beta": "1"}, r"^diloco.sparse_beta = 1.* outside \[0, 1\)"),
    ({"diloco.sparse_beta": "-0.1"}, r"^diloco.sparse_beta = -0.1.* outside \[0, 1\)"),
    ({"diloco.error_feedback": "false"}, r"^diloco.error_feedback = false .*cannot be off with diloco.compression = sparse"),
    ({"diloco.overlap": "eager"}, r"^diloco.compression = 'sparse' .*cannot combine with diloco.overlap = eager"),
    ({"diloco.sparse_average": "senders", "diloco.clip": "2"},
     r"^diloco.sparse_average = 'senders' .*cannot combine with diloco.clip yet.*set diloco.sparse_average = nodes"),
    ({"diloco.sparse_average": "mean"}, r"diloco.sparse_average"),
])
def test_sparse_settings_that_cannot_work_are_refused_in_one_line(flags, line):
    with pytest.raises(ConfigError, match=line):
        load_config([], {"diloco.compression": "sparse", **flags}, environ={})


def test_sparse_defaults_follow_the_paper_and_its_keys_alone_are_warned_about():
    """SparseLoCo's outer step: no outer momentum unless one is set, and the outer lr measured best for it; its keys
    without it do nothing."""
    from zb.config_checks import advisories

    sparse = load_config([], {"diloco.compression": "sparse"}, environ={})
    assert sparse.diloco.momentum() == 0.0 and (sparse.diloco.sparse_chunk, sparse.diloco.sparse_k) == (4096, 64)
    assert sparse.diloco.lr() == 4.0 and load_config([], {"diloco.inner_steps": "10"}, environ={}).diloco.lr() == 0.7
    assert load_config([], {"diloco.compression": "sparse", "diloco.sparse_average": "senders"},
                       environ={}).diloco.lr() == 2.5
    assert load_config([], {"diloco.compression": "sparse", "diloco.outer_lr": "1"}, environ={}).diloco.lr() == 1.0
    assert load_config([], {"diloco.compression": "sparse", "diloco.outer_momentum": "0.5"},
                       environ={}).diloco.momentum() == 0.5
    assert load_config([], {"diloco.inner_steps": "10"}, environ={}).diloco.momentum() == 0.9
    alone = load_config([], {"diloco.sparse_k": "32"}, environ={})
    assert [k for k, _ in advisories(alone)] == ["diloco.sparse_k"]
    assert sparse.diloco.sparse_average == "nodes"     # measured: BENCHMARKS.md, "Sparse pseudo-gradients"
    assert [k for k, _ in advisories(load_config([], {"diloco.sparse_average": "senders"}, environ={}))] == \
        ["diloco.sparse_average"]


@pytest.mark.parametrize("compression, exchange", [("none", "gloo"), ("sparse", "the sparse gather")])
def test_halving_without_a_quantized_width_is_refused_in_one_line(compression, exchange):
    with pytest.raises(ConfigError, match=rf"^diloco.reduce_shape = .halving. .*int8, int4 and int2 only.*{exchange}"):
        load_config([], {"diloco.compression": compression, "diloco.reduce_shape": "halving"}, environ={})
    assert load_config([], {"diloco.compression": compression, "diloco.reduce_shape": "auto"}, environ={})
