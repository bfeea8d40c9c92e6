"""Hugging Face datasets against a local fake hub: listing, rank files, retries, resume, subset-data, offline."""

from __future__ import annotations

import io
import json
import re
from collections import Counter
from itertools import islice

import pytest
from hub_server import SHA, FakeHub

from zb.config import ConfigError
from zb.config_schema import DataConfig
from zb.data import build_dataloader, build_tokenizer
from zb.errors import EnvironmentFailure, InvalidInput
from zb.testing.procs import free_port, wait_until, zb_process

BYTES = build_tokenizer("bytes")
REPO = "acme/stories"
MULTI = "acme/tales"  # two configs, en and de


def _parquet(texts: list[str]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(pa.table({"text": texts}), buf, row_group_size=4)
    return buf.getvalue()


def _dataset() -> tuple[dict[str, bytes], list[str]]:
    """Four train parquet files, one test jsonl, and files that are not data."""
    files, docs = {}, []
    for f in range(4):
        texts = [f"story {f}-{i}: once upon a time" for i in range(10)]
        files[f"data/train-0000{f}-of-00004.parquet"] = _parquet(texts)
        docs += texts
    files["data/test-00000-of-00001.jsonl"] = b'{"text": "a test story"}\n'
    files["README.md"] = b"# stories"
    files[".gitattributes"] = b"*.parquet filter=lfs"
    return files, docs


def _configs() -> dict[str, bytes]:
    return {f"{lang}/train-0000{f}-of-00002.parquet": _parquet([f"{lang} tale {f}-{i}" for i in range(5)])
            for lang in ("en", "de") for f in range(2)}


@pytest.fixture
def hub(monkeypatch, tmp_path):
    files, docs = _dataset()
    with FakeHub({REPO: files, MULTI: _configs()}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("ZB_DATA_CACHE", str(tmp_path / "cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)  # read once, at import
        server.docs = docs
        yield server


def _loader(data_rank=0, data_world_size=1, local_rank=0, local_world_size=1, **cfg):
    cfg = DataConfig(**{"dataset_name_or_paths": REPO, "eval_fraction": 0.0, "retries": 3, **cfg})
    return build_dataloader(cfg, BYTES, micro_bs=2, seq_length=32, data_rank=data_rank,
                            data_world_size=data_world_size, local_rank=local_rank,
                            local_world_size=local_world_size)


def _docs(loader) -> list[str]:
    out = []
    for pos, text in loader.stream.documents({"epoch": 0, "part": 0, "doc": 0, "count": 0}):
        if pos["epoch"]:
            return out
        out.append(text)


def test_name_config_spelling_and_mixtures_of_hub_sources(hub, run_zb, tmp_path):
    german = [f"de tale {f}-{i}" for f in range(2) for i in range(5)]
    assert _docs(_loader(dataset_name_or_paths=f"{MULTI}:de")) == german
    assert _docs(_loader(dataset_name_or_paths=MULTI, dataset_config="de")) == german
    assert _docs(_loader(dataset_name_or_paths=f"{MULTI}:de", dataset_config="de")) == german
    with pytest.raises(ConfigError, match=f"= '{MULTI}:de' names config 'de' but data.dataset_config = 'en'; "
                                          "give the config once"):
        _loader(dataset_name_or_paths=f"{MULTI}:de", dataset_config="en")
    mixed = _loader(dataset_name_or_paths=f"{MULTI}:en, {MULTI}:de,{REPO}", dataset_ratio="2:1:1")
    texts = [t for _, t in islice(mixed.stream.documents(mixed.stream.start()), 200)]
    assert Counter(t.split()[0] for t in texts).keys() == {"en", "de", "story"}
    assert mixed.state_dict()["version"] == f"{MULTI}:en x2 ({MULTI}@{SHA}); {MULTI}:de x1 ({MULTI}@{SHA}); " \
                                           f"{REPO} x1 ({REPO}@{SHA})"
    result = run_zb("subset-data", "--dataset", f"{MULTI}:de", "--out", str(tmp_path / "de"), "--json")
    assert json.loads(result.stdout.strip().splitlines()[-1])["files"] == [
        "de/train-00000-of-00002.parquet", "de/train-00001-of-00002.parquet"]


def test_file_order_and_data_rank_split_knobs_on_hub_files(hub):
    by_file = {f: [d for d in hub.docs if d.startswith(f"story {f}-")] for f in range(4)}
    # Reversed before the files are dealt: data rank 0 of 2 reads files 3 and 1.
    assert _docs(_loader(0, 2, reverse_data_files=True)) == by_file[3] + by_file[1]
    assert _docs(_loader(1, 2, split_by_data_rank=False)) == hub.docs  # already split per node
    halves = [_docs(_loader(1, 2, local_rank, 2, split_by_data_rank=False)) for local_rank in range(2)]
    assert halves == [by_file[0] + by_file[2], by_file[1] + by_file[3]]  # still split over local ranks


def test_rank_reads_only_its_files_despite_transient_errors(hub):
    hub.fail(f"/api/datasets/{REPO}", 1, 429)
    hub.fail("train-00002", 2, 503, method="GET")  # huggingface_hub 2.x gives up on these: data.retries applies
    loader = _loader(data_rank=0, data_world_size=2)
    assert _docs(loader) == [d for d in hub.docs if d.startswith(("story 0-", "story 2-"))]
    fetched = sorted(p.rsplit("/", 1)[1] for p in hub.downloads())
    assert fetched == ["train-00000-of-00004.parquet", "train-00002-of-00004.parquet"]
    assert [(m, s) for m, p, s in hub.log if "train-00002" in p and m == "GET"] == [("GET", 503), ("GET", 503),
                                                                                   ("GET", 200)]
    assert all(f"/resolve/{SHA}/" in p for p in hub.downloads())  # pinned to one commit
    inputs, labels, _ = next(loader)
    assert inputs.shape == (2, 32)
    assert loader.state_dict()["version"] == f"{REPO}@{SHA}"


def test_retry_after_sets_the_least_wait(hub):
    import time

    from zb.data.hub import open_dataset

    hub.fail(f"/api/datasets/{REPO}", 1, 429, retry_after=2)  # zb's own backoff would wait about 0.5 s
    t0 = time.monotonic()
    open_dataset(REPO, key="test", retries=1)
    assert time.monotonic() - t0 >= 2.0


def test_files_live_in_the_shared_hub_cache(hub, tmp_path):
    from huggingface_hub import hf_hub_download, scan_cache_dir

    cache = tmp_path / "cache"
    first = "data/train-00000-of-00004.parquet"
    # Fetched by huggingface_hub itself (as `datasets` or `hf download` would): zb does not fetch it again.
    hf_hub_download(REPO, first, repo_type="dataset", revision=SHA, cache_dir=cache, endpoint=hub.url)
    assert hub.downloads() == [f"/datasets/{REPO}/resolve/{SHA}/{first}"]
    assert _docs(_loader(data_rank=0, data_world_size=4)) == [d for d in hub.docs if d.startswith("story 0-")]
    assert len(hub.downloads()) == 1
    _docs(_loader(data_rank=1, data_world_size=4))
    scan = scan_cache_dir(cache)  # zb's file list beside the files does not upset huggingface_hub
    assert not scan.warnings and [r.repo_id for r in scan.repos] == [REPO]
    assert {f.file_name for r in scan.repos for rev in r.revisions for f in rev.files} == {
        "train-00000-of-00004.parquet", "train-00001-of-00004.parquet"}


def test_ranks_and_local_ranks_split_the_dataset_without_overlap(hub):
    read = []
    for data_rank in range(2):
        for local_rank in range(3):  # 2 files per data rank, 3 local ranks: documents are dealt
            read += _docs(_loader(data_rank, 2, local_rank, 3))
    assert sorted(read) == sorted(hub.docs)


def test_truncated_download_resumes_with_range(hub, tmp_path):
    import os

    # Larger than huggingface_hub's 10 MB write chunk, so part of it is on disk when the link drops.
    big = [os.urandom(3_000_000).hex() for _ in range(4)]
    del hub.datasets[REPO]["data/train-00001-of-00004.parquet"]
    hub.datasets[REPO]["data/train-00001-of-00004.txt"] = "\n\n".join(big).encode()
    hub.truncate("train-00001", 1)
    docs = _docs(_loader(data_rank=1, data_world_size=4))
    assert docs == big
    # The cut download, then only the rest (huggingface_hub 2.x resumes by itself; 0.x when zb retries).
    assert [s for m, p, s in hub.log if "train-00001" in p and m == "GET"] == [200, 206]
    assert not list((tmp_path / "cache").rglob("*.incomplete"))


def test_streaming_fetches_lazily_and_split_selects_files(hub):
    loader = _loader(data_rank=0, data_world_size=1)
    assert hub.downloads() == []  # nothing fetched before the first batch
    next(loader)
    wait_until(lambda: len(hub.downloads()) >= 2, 10, "the next file prefetched in the background", poll=0.05)
    assert [p.rsplit("-of", 1)[0][-5:] for p in hub.downloads()] == ["00000", "00001"]
    _loader(data_rank=0, data_world_size=1, streaming=False)
    assert len(hub.downloads()) == 4  # not streaming: everything up front
    test_loader = _loader(split="test")
    assert _docs(test_loader) == ["a test story"]
    with pytest.raises(InvalidInput, match="data.split = 'validation'"):
        _loader(split="validation")


def test_unknown_dataset_and_unreachable_hub(hub, monkeypatch):
    with pytest.raises(InvalidInput, match="'acme/nothing': no such dataset"):
        build_dataloader(DataConfig(dataset_name_or_paths="acme/nothing"), BYTES, micro_bs=1, seq_length=8,
                         data_rank=0, data_world_size=1, local_rank=0, local_world_size=1)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(EnvironmentFailure, match="Connection refused"):
        _loader(retries=1)


def test_tokenizer_from_hub_model_repo(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.add_special_tokens(["</s>"])
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    with FakeHub({}, models={"acme/tok": {"tokenizer.json": path.read_bytes()}}) as server:
        _online_at(server.url, tmp_path, monkeypatch)
        server.fail("tokenizer.json", 1, 503)
        loaded = build_tokenizer("acme/tok")
        assert loaded.eos_id == tok.token_to_id("</s>")
        with pytest.raises(InvalidInput, match="data.tokenizer = 'acme/missing'"):
            build_tokenizer("acme/missing", retries=0)


def test_subset_data_cli_fetches_rank_files_resumably_then_trains_offline(hub, run_zb, tmp_path, monkeypatch):
    out = tmp_path / "subset"
    hub.fail("train-00003", 1, 503)
    result = run_zb("subset-data", "--dataset", REPO, "--data-rank", "1", "--data-world-size", "2",
                    "--out", str(out), "--retries", "2", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["files"] == ["data/train-00001-of-00004.parquet", "data/train-00003-of-00004.parquet"]
    assert len(report["downloaded"]) == 2 and report["revision"] == SHA
    assert "train-00001-of-00004.parquet (" in result.stderr  # plain lines when not on a terminal
    again = json.loads(run_zb("subset-data", "--dataset", REPO, "--data-rank", "1", "--data-world-size", "2",
                              "--out", str(out), "--json").stdout.strip().splitlines()[-1])
    assert again["downloaded"] == [] and len(again["skipped"]) == 2
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ZB_DATA_CACHE", str(out))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # nothing listens: truly offline
    docs = _docs(_loader(data_rank=1, data_world_size=2))
    assert docs == [d for d in hub.docs if d.startswith(("story 1-", "story 3-"))]


def test_subset_data_takes_prime_s_flags_filter_and_dry_run(hub, run_zb, tmp_path):
    """Prime's launch line (`--dataset_name ... --data_world_size 1 --data_rank 0 --max_shards N`) works;
    --filter picks files before they are dealt to ranks; --dry_run lists without downloading."""
    out = tmp_path / "subset"
    dry = run_zb("subset-data", "--dataset_name", REPO, "--data_world_size", "1", "--data_rank", "0",
                 "--filter", "00001,00002", "--dry_run", "--out", str(out), "--json")
    assert dry.exit_code == 0, dry.output
    listed = json.loads(dry.stdout.strip().splitlines()[-1])
    assert listed["files"] == ["data/train-00001-of-00004.parquet", "data/train-00002-of-00004.parquet"]
    assert listed["dry_run"] and listed["bytes"] > 0 and listed["downloaded"] == []
    assert hub.downloads() == []
    real = run_zb("subset-data", "--dataset_name", REPO, "--data_world_size", "2", "--data_rank", "1",
                  "--filter", "00001,00002", "--max_shards", "1", "--num_workers", "2", "--out", str(out), "--json")
    report = json.loads(real.stdout.strip().splitlines()[-1])
    assert report["downloaded"] == ["data/train-00002-of-00004.parquet"]  # rank 1 of the 2 filtered files
    # Training's file-order keys, given to subset-data too, fetch what training reads (test_hub's
    # rank-split test: reversed, data rank 0 of 2 reads files 3 and 1; unsplit, every file).
    reversed_rank0 = json.loads(run_zb("subset-data", "--dataset", REPO, "--data-world-size", "2", "--dry-run",
                                       "--reverse-data-files", "--out", str(out), "--json").stdout.splitlines()[-1])
    assert reversed_rank0["files"] == ["data/train-00003-of-00004.parquet", "data/train-00001-of-00004.parquet"]
    whole = json.loads(run_zb("subset-data", "--dataset", REPO, "--data-world-size", "2", "--data-rank", "1",
                              "--dry-run", "--no-split-by-data-rank", "--out", str(out), "--json").stdout.splitlines()[-1])
    assert len(whole["files"]) == 4
    with pytest.raises(InvalidInput, match="match --filter 'nomatch'") as e:
        run_zb("subset-data", "--dataset", REPO, "--filter", "nomatch", "--out", str(out))
    assert e.value.exit_code == 2


def test_subset_data_exit_codes(hub, tmp_path):
    bad = zb_process("subset-data", "--dataset", "acme/nothing", "--out", str(tmp_path), HF_ENDPOINT=hub.url)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().splitlines() == [
        f"error: --dataset = 'acme/nothing': no such dataset on {hub.url} (HTTP 404); check the name (owner/name), "
        "or set HF_TOKEN for a private or gated dataset"]
    down = zb_process("subset-data", "--dataset", REPO, "--out", str(tmp_path), "--retries", "1",
               HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    assert down.returncode == 1
    assert down.stderr.strip().splitlines()[-1].startswith("error: looking up dataset acme/stories")
    assert "Traceback" not in down.stderr


def test_concurrent_fetches_download_once(hub):
    import threading

    from zb.data.hub import open_dataset

    ds = open_dataset(REPO, key="test", retries=1)
    remote = next(f for f in ds.files if f.path.endswith("00002-of-00004.parquet"))
    threads = [threading.Thread(target=ds.fetch, args=(remote, 1)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(hub.downloads()) == 1 and ds.cached(remote).stat().st_size == remote.size


def test_unreachable_hub_falls_back_to_saved_file_list(hub, monkeypatch, caplog):
    first = _docs(_loader(data_rank=0, data_world_size=4))
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    assert _docs(_loader(data_rank=0, data_world_size=4, retries=0)) == first
    assert "unreachable; using the saved file list" in caplog.text


@pytest.mark.parametrize("endpoint", ["notaurl", "http://[::1", "ftp://mirror.example", "http://"])
def test_malformed_hf_endpoint_is_one_line_before_any_request(endpoint, monkeypatch, tmp_path):
    from zb.data.hub import open_dataset

    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    message = re.escape(f"HF_ENDPOINT = {endpoint!r} (from env HF_ENDPOINT): not an http(s) URL")
    with pytest.raises(InvalidInput, match=message):
        open_dataset(REPO, key="data.dataset_name_or_paths", retries=5, cache_dir=tmp_path)
    with pytest.raises(InvalidInput, match=message):
        build_tokenizer("acme/tok", retries=5)


def test_malformed_hf_endpoint_exits_2_from_the_cli(tmp_path):
    # huggingface_hub raises ValueError at import for this one: zb must look at it first.
    proc = zb_process("subset-data", "--dataset", REPO, "--out", str(tmp_path), HF_ENDPOINT="http://[::1")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: HF_ENDPOINT = 'http://[::1' (from env HF_ENDPOINT): not an http(s) URL (Invalid IPv6 URL); "
        "set it to the hub or mirror's URL (e.g. https://huggingface.co) or unset it"]


def _online_at(endpoint: str, tmp_path, monkeypatch) -> None:
    """The hub at `endpoint`, a cache of this test's own, offline mode off."""
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("ZB_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)


@pytest.fixture
def unresolvable_hub(monkeypatch, tmp_path):
    """A hub whose host name does not resolve, as on a machine without internet; nothing reached yet."""
    monkeypatch.setattr("zb.data.hub._reached", False)
    _online_at("http://no-such-hub.invalid", tmp_path, monkeypatch)


def test_a_hub_that_does_not_resolve_fails_at_once(unresolvable_hub, tmp_path, caplog):
    """Issue 30, defect 3: 2.5 minutes of retries (zb's around huggingface_hub's) on a name that does not
    resolve; now the first call fails, exit 1 (the environment), naming the way out."""
    from zb.data.hub import open_dataset

    with pytest.raises(EnvironmentFailure, match="no-such-hub.invalid does not resolve.*HF_HUB_OFFLINE=1"):
        build_tokenizer("acme/tok", retries=5)
    with pytest.raises(EnvironmentFailure, match="no-such-hub.invalid does not resolve"):
        open_dataset(REPO, key="data.dataset_name_or_paths", retries=5, cache_dir=tmp_path / "cache")
    assert "retry" not in caplog.text.lower()


def test_a_cached_tokenizer_serves_when_the_hub_does_not_resolve(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models

    path = tmp_path / "tokenizer.json"
    tok = Tokenizer(models.BPE())
    tok.add_special_tokens(["</s>"])
    tok.save(str(path))
    with FakeHub({}, models={"acme/tok": {"tokenizer.json": path.read_bytes()}}) as server:
        _online_at(server.url, tmp_path, monkeypatch)
        build_tokenizer("acme/tok")
    monkeypatch.setattr("zb.data.hub._reached", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://no-such-hub.invalid")
    assert build_tokenizer("acme/tok").eos_id == tok.token_to_id("</s>")


@pytest.mark.parametrize("env, message", [({"HF_ENDPOINT": "http://no-such-hub.invalid"}, "does not resolve"),
                                          ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set")])
def test_train_on_local_files_offline_is_one_line_and_exit_1(tmp_path, env, message):
    """Local data with the default tokenizer (a hub name): at once, exit 1 as docs/data.md says for an
    unreachable hub (it was exit 2 after 2.5 minutes)."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello world"}\n' * 20)
    proc = zb_process("train", "--data.dataset_name_or_paths", str(data), "--optim.total_steps", "2",
                      "--train.device", "cpu", timeout=120, ZB_DATA_CACHE=str(tmp_path / "cache"), **env)
    assert proc.returncode == 1, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and message in errors[0] and "data.tokenizer = 'mistralai/Mistral-7B-v0.1'" in errors[0]
    assert "Retry" not in proc.stderr and "retry" not in proc.stderr


def test_subset_data_offline_says_offline_forbids_its_download(tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 and no saved file list: `zb subset-data` is the download, so it is told to unset
    HF_HUB_OFFLINE, not to "fetch the files first with `zb subset-data`" (itself); training still is."""
    proc = zb_process("subset-data", "--dataset", "x/y", "--out", str(tmp_path / "out"), timeout=120,
                      HF_HUB_OFFLINE="1")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "HF_HUB_OFFLINE is set, which forbids the downloads zb subset-data makes" in lines[0] \
        and "unset HF_HUB_OFFLINE" in lines[0] and "with `zb subset-data`" not in lines[0], proc.stderr
    from zb.data.hub import open_dataset

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InvalidInput, match="fetch the files first with `zb subset-data`"):
        open_dataset("x/y", key="data.dataset_name_or_paths", retries=0, cache_dir=tmp_path / "cache")
