"""Mixtures of sources (data.dataset_ratio): weights, exact resume (of the loader and of a `zb train`
run from its checkpoint), sources that run out, sharding per source, the config checks; and Prime's
split_by_data_rank and reverse_data_files."""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import replace
from itertools import islice

import pytest
from conftest import same_batch

from zb.config import ConfigError, load_config
from zb.config_schema import DataConfig
from zb.data import build_dataloader, build_tokenizer
from zb.data.prefetch import Prefetcher
from zb.errors import InvalidInput
from zb.testing.procs import zb_train

BYTES = build_tokenizer("bytes")


def _sources(tmp_path, sizes=(40, 40, 6)) -> str:
    """Source i is a directory of two .jsonl files; its documents read "<letter> <file> <index>"."""
    entries = []
    for s, size in enumerate(sizes):
        d = tmp_path / f"src{s}"
        d.mkdir()
        for f in range(2):
            lines = [json.dumps({"text": f"{'abc'[s]} {f} {i}"}) for i in range(size // 2)]
            (d / f"part{f}.jsonl").write_text("\n".join(lines) + "\n")
        entries.append(str(d))
    return ",".join(entries)


def _cfg(tmp_path, ratio="6:3:1", **kw) -> DataConfig:
    return DataConfig(dataset_name_or_paths=_sources(tmp_path), dataset_ratio=ratio, eval_fraction=0.0, **kw)


def _loader(cfg: DataConfig, data_rank=0, data_world_size=1, local_rank=0, local_world_size=1, split="train",
            seed=5):
    return build_dataloader(cfg, BYTES, micro_bs=2, seq_length=24, data_rank=data_rank,
                            data_world_size=data_world_size, local_rank=local_rank,
                            local_world_size=local_world_size, split=split, seed=seed)


def _texts(loader, n: int) -> list[str]:
    return [text for _, text in islice(loader.stream.documents(loader.stream.start()), n)]


def test_documents_are_drawn_with_the_ratio_and_small_sources_start_over(tmp_path):
    cfg = _cfg(tmp_path)
    loader = _loader(cfg)
    texts = _texts(loader, 3000)
    shares = Counter(t[0] for t in texts)
    assert abs(shares["a"] / 3000 - 0.6) < 0.03 and abs(shares["b"] / 3000 - 0.3) < 0.03
    assert abs(shares["c"] / 3000 - 0.1) < 0.02
    # Source c has 6 documents: it starts over, in the same order, while the others go on.
    c = [t for t in texts if t[0] == "c"]
    assert c[:12] == c[:6] * 2 and len(set(c)) == 6
    a = [t for t in texts if t[0] == "a"][:40]
    assert len(set(a)) == 40
    positions = [pos for pos, _ in islice(loader.stream.documents(loader.stream.start()), 3000)]
    assert positions[-1]["sources"][2]["epoch"] > positions[-1]["sources"][0]["epoch"] >= 1
    # Seeded: another loader draws the same, another seed other documents.
    assert _texts(_loader(cfg), 50) == texts[:50] != _texts(_loader(cfg, seed=6), 50)


def test_mixture_resumes_exactly_from_a_json_position(tmp_path):
    cfg = _cfg(tmp_path)
    loader = _loader(cfg)
    list(islice(loader, 11))
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["kind"] == "mixture" and len(state["sources"]) == 3 and isinstance(state["draws"], int)
    assert all(isinstance(v, int) for p in state["sources"] for v in p.values())
    # Mid-document, sources past their first epoch, and sources resumed after their last document.
    assert state["offset"] > 0 and state["sources"][2]["epoch"] >= 1 and any(p["skip"] for p in state["sources"])
    expected = list(islice(loader, 15))
    for fresh in (_loader(cfg), Prefetcher(_loader(cfg), depth=2)):
        fresh.load_state_dict(state)
        assert all(same_batch(x, y) for x, y in zip(expected, islice(fresh, 15)))
        if isinstance(fresh, Prefetcher):
            fresh.close()  # its thread would outlive the test
    # Another ratio is another mixture: resuming from this position is reported, not exact.
    other = _loader(replace(cfg, dataset_ratio="1:1:1"))
    assert other.version != loader.version


def test_each_source_is_sharded_over_data_and_local_ranks(tmp_path):
    cfg = _cfg(tmp_path)
    read: list[str] = []
    for data_rank in range(2):
        for local_rank in range(2):
            loader = _loader(cfg, data_rank, 2, local_rank, 2)
            read += [text for pos, text in islice(loader.stream.documents(loader.stream.start()), 400)
                     if all(p["epoch"] == 0 for p in pos["sources"])]
    counts = Counter(read)
    assert max(counts.values()) == 1  # no document read twice, by any rank, in the first epoch
    assert {t[0] for t in counts} == {"a", "b", "c"}


def test_split_by_data_rank_false_reads_the_sources_whole(tmp_path):
    cfg = _cfg(tmp_path, split_by_data_rank=False)
    one, other = _loader(cfg, 0, 4), _loader(cfg, 3, 4)
    assert _texts(one, 60) == _texts(other, 60) == _texts(_loader(replace(cfg, split_by_data_rank=True)), 60)
    assert _texts(_loader(replace(cfg, split_by_data_rank=True), 3, 4), 60) != _texts(other, 60)
    split_locally = _texts(_loader(cfg, 3, 4, 1, 2), 60)
    assert not set(split_locally) & set(_texts(_loader(cfg, 3, 4, 0, 2), 60))


def test_reverse_data_files_reads_each_source_from_its_last_file(tmp_path):
    spec = _sources(tmp_path)
    forward = _texts(_loader(DataConfig(dataset_name_or_paths=spec.split(",")[0], eval_fraction=0.0)), 40)
    backward = _texts(_loader(DataConfig(dataset_name_or_paths=spec.split(",")[0], eval_fraction=0.0,
                                         reverse_data_files=True)), 40)
    assert forward[:20] == backward[20:] and forward[20:] == backward[:20]
    assert backward[0] == "a 1 0"


def test_without_a_ratio_local_paths_stay_one_source(tmp_path):
    spec = _sources(tmp_path)
    texts = _texts(_loader(DataConfig(dataset_name_or_paths=spec, eval_fraction=0.0)), 86)
    assert [t[0] for t in texts] == ["a"] * 40 + ["b"] * 40 + ["c"] * 6  # the files in sorted order
    with pytest.raises(InvalidInput, match=r"'acme/stories' is not one; to mix several sources .*\(\"1:1\"\)"):
        _loader(DataConfig(dataset_name_or_paths=f"{spec.split(',')[0]},acme/stories"))


@pytest.mark.parametrize("ratio, message", [
    ("55:45", "has 2 weights but data.dataset_name_or_paths names 3 sources"),
    ("55:x:1", "'x' is not a number"),
    ("55:0:1", "weight 0 is not a positive number"),
    ("5:-1:1", "weight -1 is not a positive number"),
    ("1:inf:1", "weight inf is not a positive number"),
])
def test_bad_ratio_is_one_config_error(ratio, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config([], {"data.dataset_name_or_paths": "/a,/b,/c", "data.dataset_ratio": ratio}, environ={})
    assert str(e.value).startswith(f"data.dataset_ratio = {ratio!r} (from flag --data.dataset_ratio): ")
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_a_ratio_with_fake_data_is_warned_about(caplog):
    """Prime ran it (fake data skipped its datasets), so a Prime file with both must load."""
    with caplog.at_level(logging.WARNING, logger="zb.config"):
        load_config([], {"data.fake": "true", "data.dataset_ratio": "1"}, environ={})
    assert "data.dataset_ratio = '1' (from flag --data.dataset_ratio): has no effect with data.fake" in caplog.text


def test_a_saved_position_of_other_sources_is_refused(tmp_path):
    cfg = _cfg(tmp_path)
    mixed = _loader(cfg)
    next(mixed)
    single = _loader(DataConfig(dataset_name_or_paths=cfg.dataset_name_or_paths.split(",")[0], eval_fraction=0.0))
    with pytest.raises(InvalidInput, match="saved data position is for a mixture .* this run reads one source"):
        single.load_state_dict(mixed.state_dict())
    two = _loader(replace(cfg, dataset_name_or_paths=",".join(cfg.dataset_name_or_paths.split(",")[:2]),
                          dataset_ratio="1:1"))
    with pytest.raises(InvalidInput, match="mixes 3 sources but data.dataset_name_or_paths names 2"):
        two.load_state_dict(mixed.state_dict())


def test_eval_mixes_the_held_out_documents_deterministically(tmp_path):
    cfg = replace(_cfg(tmp_path), eval_fraction=0.3)
    first, second = _loader(cfg, split="eval"), _loader(cfg, split="eval")
    assert all(same_batch(x, y) for x, y in zip(islice(first, 4), islice(second, 4)))
    assert not set(_texts(_loader(cfg, split="eval"), 200)) & set(_texts(_loader(cfg), 200))


def test_zb_train_resumes_a_mixture_bit_for_bit(tmp_path):
    """The mixture's position goes through a checkpoint: resumed at step 4, steps 5-8 repeat exactly."""
    from zb.metrics import read_metrics

    run = ["--data.dataset_name_or_paths", f"builtin,{_sources(tmp_path).split(',')[2]}", "--data.dataset_ratio",
           "3:1", "--data.tokenizer", "bytes", "--optim.total_steps", "8", "--ckpt.path", str(tmp_path / "ck"),
           "--ckpt.interval", "4"]
    straight = zb_train(tmp_path, *run, "--log.dir", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr[-2000:]
    resumed = zb_train(tmp_path, *run, "--log.dir", str(tmp_path / "b"), "--ckpt.resume",
                       str(tmp_path / "ck" / "step-000000004"))
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-2000:]
    losses = [[e["loss"] for e in read_metrics(tmp_path / d / "metrics.jsonl", "step")] for d in "ab"]
    assert len(losses[0]) == 8 and losses[1] == losses[0][4:]


def test_file_settings_without_files_are_warned_about(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="zb.data"):
        _loader(DataConfig(dataset_name_or_paths=_sources(tmp_path).split(",")[0], dataset_config="en"))
        _loader(DataConfig(reverse_data_files=True))
        _loader(DataConfig(reverse_data_files=True), split="eval")
    assert "data.dataset_config = 'en' has no effect: no source is a Hugging Face dataset" in caplog.text
    assert caplog.text.count("data.reverse_data_files has no effect: builtin data has no files") == 1
