"""Data: tokenizers, packing, sharding, the held-out split, exact resume, the builtin source, local files."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from itertools import islice

import pytest
import torch
from conftest import same_batch

from zb.config_schema import DataConfig
from zb.data import build_dataloader, build_tokenizer, entropy_floor
from zb.data.grammar import GRAMMAR
from zb.errors import EnvironmentFailure, InvalidInput

BYTES = build_tokenizer("bytes")


def _loader(cfg: DataConfig, *, data_rank=0, data_world_size=1, local_rank=0, local_world_size=1, split="train",
            micro_bs=2, seq_length=16, tokenizer=BYTES, seed=0):
    return build_dataloader(cfg, tokenizer, micro_bs=micro_bs, seq_length=seq_length, data_rank=data_rank,
                            data_world_size=data_world_size, local_rank=local_rank,
                            local_world_size=local_world_size, split=split, seed=seed)


def _write_corpus(tmp_path, n_docs=60):
    """The same numbered documents as .txt, .jsonl and .parquet (20 documents per file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [f"document {'x' * (i % 7)} number {i} says hello" for i in range(n_docs)]
    (tmp_path / "a.txt").write_text("\n\n".join(docs[:20]) + "\n")
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in
                                              enumerate(docs[20:40])))
    pq.write_table(pa.table({"body": docs[40:], "n": list(range(40, n_docs))}), tmp_path / "c.parquet",
                   row_group_size=6)
    return docs


def _stream_docs(loader, epochs=1):
    """Texts the loader's document stream yields in its first `epochs` epochs."""
    out = []
    for pos, text in loader.stream.documents({"epoch": 0, "part": 0, "doc": 0, "count": 0}):
        if pos["epoch"] >= epochs:
            return out
        out.append(text)
    return out


def test_byte_tokenizer_round_trip():
    text = "héllo wörld ✓\nline two"
    ids = BYTES.encode(text)
    assert max(ids) < 256 and BYTES.decode(ids) == text
    assert BYTES.vocab_size == 259 and {BYTES.bos_id, BYTES.eos_id} == {256, 257}


def test_hf_tokenizer_from_file_round_trip(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([GRAMMAR.document(0, i)[0] for i in range(300)], trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    loaded = build_tokenizer(str(tmp_path))
    text = "# farm\nThe small dog sees Anna."
    assert loaded.decode(loaded.encode(text)) == text
    assert loaded.eos_id == tok.token_to_id("<|endoftext|>") and loaded.vocab_size == tok.get_vocab_size()
    batch = next(_loader(DataConfig(), tokenizer=loaded))
    assert batch[0].max() < loaded.vocab_size


def test_bad_tokenizer_names_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ZB_DATA_CACHE", str(tmp_path))
    with pytest.raises(EnvironmentFailure, match="data.tokenizer = 'someone/tok'.*HF_HUB_OFFLINE is set"):
        build_tokenizer("someone/tok")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(InvalidInput, match="not a valid tokenizer.json"):
        build_tokenizer(str(tmp_path / "tokenizer.json"))


def test_packing_joins_documents_with_eos_and_shifts_labels(tmp_path):
    docs = _write_corpus(tmp_path)
    cfg = DataConfig(dataset_name_or_paths=str(tmp_path / "a.txt"), eval_fraction=0.0, text_column="body")
    loader = _loader(cfg, micro_bs=3, seq_length=20)
    expected = [t for d in docs[:20] for t in BYTES.encode(d) + [BYTES.eos_id]]
    got = []
    for inputs, labels, _ in islice(loader, 4):
        assert inputs.shape == labels.shape == (3, 20) and inputs.dtype == torch.long
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
        for row_in, row_lab in zip(inputs, labels):
            got += row_in.tolist() + [row_lab[-1].item()]
    assert got == expected[:len(got)]


def test_local_txt_jsonl_parquet_read_every_document(tmp_path):
    docs = _write_corpus(tmp_path)
    cfg = DataConfig(dataset_name_or_paths=f"{tmp_path}/*.txt,{tmp_path}/b.jsonl,{tmp_path}/*.parquet",
                     text_column="body", eval_fraction=0.0)
    assert _stream_docs(_loader(cfg)) == docs
    with pytest.raises(InvalidInput, match="data.text_column = 'text'"):
        _stream_docs(_loader(replace(cfg, dataset_name_or_paths=str(tmp_path / "c.parquet"), text_column="text")))
    with pytest.raises(InvalidInput, match="does not exist"):
        _loader(replace(cfg, dataset_name_or_paths=str(tmp_path / "missing.jsonl")))


def test_shards_are_disjoint_and_eval_is_held_out(tmp_path):
    docs = _write_corpus(tmp_path, n_docs=200)
    cfg = DataConfig(dataset_name_or_paths=str(tmp_path), text_column="body", eval_fraction=0.2)
    seen: dict[str, list[str]] = {}
    for data_rank in range(2):
        for local_rank in range(2):
            for split in ("train", "eval"):
                loader = _loader(cfg, data_rank=data_rank, data_world_size=2, local_rank=local_rank,
                                 local_world_size=2, split=split)
                seen[f"{data_rank}{local_rank}{split}"] = _stream_docs(loader)
    all_read = [d for texts in seen.values() for d in texts]
    assert sorted(all_read) == sorted(docs)  # every document read once, by one rank, in one split
    held_out = [d for k, texts in seen.items() if k.endswith("eval") for d in texts]
    assert 20 <= len(held_out) <= 60  # ~20% of 200


def test_builtin_shards_disjoint():
    cfg = DataConfig()
    counts = []
    for rank in range(3):
        loader = _loader(cfg, data_rank=rank, data_world_size=3)
        counts.append({pos["count"] for pos, _ in islice(loader.stream.documents(
            {"epoch": 0, "part": 0, "doc": 0, "count": 0}), 200)})
    assert not (counts[0] & counts[1]) and not (counts[1] & counts[2]) and not (counts[0] & counts[2])


@pytest.mark.parametrize("source", ["builtin", "fake", "txt", "jsonl", "parquet"])
def test_resume_yields_exactly_the_same_batches(tmp_path, source):
    _write_corpus(tmp_path)
    path = {"txt": "a.txt", "jsonl": "b.jsonl", "parquet": "c.parquet"}.get(source)
    cfg = DataConfig(fake=source == "fake", text_column="body",
                     dataset_name_or_paths=str(tmp_path / path) if path else "builtin")
    loader = _loader(cfg, data_rank=1, data_world_size=2, micro_bs=3, seq_length=32)
    list(islice(loader, 7))  # small files wrap around epochs within these batches
    state = json.loads(json.dumps(loader.state_dict()))
    expected = list(islice(loader, 9))
    fresh = _loader(cfg, data_rank=1, data_world_size=2, micro_bs=3, seq_length=32)
    fresh.load_state_dict(state)
    assert fresh.exact_resume
    for x, y in zip(expected, islice(fresh, 9)):
        assert same_batch(x, y)
    if path:
        assert state["epoch"] >= 1


def test_eval_loader_is_deterministic_and_differs_from_train():
    cfg = DataConfig()
    first = [b[0] for b in islice(_loader(cfg, split="eval"), 3)]
    second = [b[0] for b in islice(_loader(cfg, split="eval"), 3)]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    train = next(_loader(cfg))[0]
    assert not torch.equal(first[0], train)
    with pytest.raises(InvalidInput, match="data.eval_fraction = 0"):
        _loader(replace(cfg, eval_fraction=0.0), split="eval")


def test_shuffle_buffer_reports_inexact_resume(tmp_path):
    _write_corpus(tmp_path)
    cfg = DataConfig(dataset_name_or_paths=str(tmp_path / "b.jsonl"), text_column="body", shuffle_buffer=4)
    loader = _loader(cfg)
    assert not loader.exact_resume and "shuffle" in loader.resume_note
    plain = _stream_docs(_loader(replace(cfg, shuffle_buffer=0)))
    shuffled = BYTES.decode(torch.cat([x.flatten() for x, *_ in islice(loader, 20)]).tolist())
    assert shuffled[:40] != BYTES.decode(BYTES.encode("".join(plain)))[:40]
    loader.load_state_dict(loader.state_dict())
    next(loader)


def test_builtin_grammar_entropy_floor_is_sane():
    floor = entropy_floor(DataConfig(tokenizer="bytes"))
    assert entropy_floor(DataConfig()) == floor  # tokenizer auto means bytes on builtin data
    assert 0.3 < floor < 1.0 < math.log(BYTES.vocab_size)
    assert entropy_floor(DataConfig(fake=True)) is None
    text, nats = GRAMMAR.document(3, 14)
    assert GRAMMAR.document(3, 14) == (text, nats) and text.startswith("# ") and nats > 0
    # A byte-unigram model of the stream is far worse than the floor: there is structure to learn.
    counts = torch.bincount(next(_loader(DataConfig(), micro_bs=64, seq_length=256))[0].flatten(), minlength=259)
    probs = counts[counts > 0].double() / counts.sum()
    assert -(probs * probs.log()).sum().item() > 2 * floor


def test_builtin_is_learnable_by_a_debug_model():
    from zb.config_schema import ModelConfig
    from zb.models import Transformer, model_args
    from zb.models.loss import cross_entropy

    torch.manual_seed(0)
    model = Transformer(model_args(ModelConfig(name="debug"), BYTES.vocab_size, 64))
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    loader = _loader(DataConfig(), micro_bs=8, seq_length=64)
    for inputs, labels, cu_seqlens in islice(loader, 40):
        loss, _ = cross_entropy(model(inputs, cu_seqlens), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.6 * math.log(BYTES.vocab_size)


@pytest.mark.perf
def test_builtin_loader_is_fast():
    import time

    loader = _loader(DataConfig(), micro_bs=8, seq_length=256)
    next(loader)
    start = time.perf_counter()
    tokens = sum(x.inputs.numel() for x in islice(loader, 40))
    assert tokens / (time.perf_counter() - start) > 100_000  # >> what a tiny model trains on 2 cores


@pytest.mark.parametrize("source", ["builtin", "fake", "jsonl"])
def test_prefetched_batches_and_resume_equal_the_plain_loader(tmp_path, source):
    """Batches made ahead in a thread: the same batches, contiguous, and a state that resumes after the
    batches taken (not the ones made), both into a plain loader and into another prefetcher."""
    from zb.data.prefetch import Prefetcher

    _write_corpus(tmp_path)
    cfg = DataConfig(fake=source == "fake", text_column="body",
                     dataset_name_or_paths=str(tmp_path / "b.jsonl") if source == "jsonl" else "builtin")

    def make():
        return _loader(cfg, data_rank=1, data_world_size=2, micro_bs=3, seq_length=32)

    plain, ahead = make(), Prefetcher(make(), depth=3)
    for _ in range(7):
        x, y = next(plain), next(ahead)
        assert same_batch(x, y)
        assert all(t is None or t.is_contiguous() for t in y)
        assert ahead.state_dict() == plain.state_dict()  # although the thread is ahead by up to 3
    state = json.loads(json.dumps(ahead.state_dict()))
    expected = list(islice(plain, 5))
    for fresh in (make(), Prefetcher(make(), depth=2)):
        fresh.load_state_dict(state)
        for x, y in zip(expected, islice(fresh, 5)):
            assert same_batch(x, y)
        if isinstance(fresh, Prefetcher):
            fresh.close()  # its thread would outlive the test
    ahead.load_state_dict(state)  # rewinding a running prefetcher drops what it made ahead
    for x, y in zip(expected, islice(ahead, 5)):
        assert same_batch(x, y)
    ahead.close()


def test_prefetcher_raises_the_loaders_error_in_the_consumer():
    from zb.data.prefetch import Prefetcher

    class Broken:
        exact_resume, resume_note = True, ""

        def __next__(self):
            raise OSError("disk gone")

        def state_dict(self):
            return {}

    with pytest.raises(OSError, match="disk gone"):
        next(Prefetcher(Broken()))
