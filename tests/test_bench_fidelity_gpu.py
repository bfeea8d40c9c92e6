"""scripts/bench_fidelity_gpu.py and scripts/build_corpus.py on the CPU: the study's model of the quantized
ring is zb's ring bit for bit (residuals included), a smoke-size study runs every variant on the same
tokens and writes its results, bad invocations are refused, and the corpus builder keeps a page's
prose and nothing else (the numbers themselves are in BENCHMARKS.md, "Fidelity at scale")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _allreduce_worker import make_input
from conftest import load_script
from test_allreduce import run_ranks


@pytest.mark.parametrize("compression", ["int4", "int2"])
def test_the_ring_model_is_zbs_ring_bit_for_bit(compression: str, tmp_path: Path) -> None:
    world, case = 3, {"numel": 20_001, "compression": compression, "heavy": True, "rounds": 2, "seed": 31,
                      "op": "avg", "piece": 2048}
    ranks = run_ranks(world, {"cases": [case]}, tmp_path)
    assert all(isinstance(r, list) for r in ranks), ranks
    ring = load_script("bench_fidelity_gpu").Ring(compression, world, case["numel"], torch.device("cpu"))
    outputs = [ring([make_input({**case, "seed": case["seed"] + 100 * r}, rank) for rank in range(world)])
               for r in range(case["rounds"])]
    assert torch.equal(outputs[-1], ranks[0][0]["last_output"])
    assert torch.equal(sum(outputs), ranks[0][0]["output"])
    for rank in range(world):
        assert torch.equal(ring.residuals[rank], ranks[rank][0]["residual"]), rank


def corpus(folder: Path, vocab: int = 300, tokens: int = 60_000) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(0)
    np.savez(folder / "tokens.npz", train=g.integers(0, vocab, tokens).astype(np.uint16),
             eval=g.integers(0, vocab, tokens // 10).astype(np.uint16), eos=np.asarray([0]), vocab=np.asarray([vocab]))
    return folder


def test_a_smoke_study_runs_every_variant_on_the_same_tokens(tmp_path: Path) -> None:
    out = tmp_path / "out"
    doc = load_script("bench_fidelity_gpu").main(
        ["--corpus", str(corpus(tmp_path / "c")), "--out", str(out), "--model", "debug", "--device", "cpu",
         "--nodes", "2", "--h", "6", "--steps", "12", "--batch", "2", "--seq", "16", "--eval-windows", "4",
         "--final-eval-windows", "8", "--variants", "blocking,delayed,eager,int2,streaming"])
    results = {r["variant"]: r for r in doc["results"]}
    assert list(results) == ["blocking", "delayed", "eager", "int2", "streaming"]
    assert {r["tokens"] for r in results.values()} == {12 * 2 * 2 * 16}
    for r in results.values():
        assert len(r["train_loss"]) == 12 and [s for s, _ in r["eval_curve"]] == [6, 12]
        assert all(np.isfinite(x) for x in [*r["train_loss"], r["final_eval"]])
    # every node reads the same tokens under every rule: the first round's first step is the same loss
    assert len({r["train_loss"][0] for r in results.values()}) == 1
    # and the rules differ after the first outer step (a lost rule or compression would make two equal)
    assert len({tuple(r["train_loss"][6:]) for r in results.values()}) == 5
    saved = json.loads((out / "fidelity.json").read_text())
    assert [r["variant"] for r in saved["results"]] == list(results)


@pytest.mark.parametrize("argv, needle", [
    (["--variants", "blocking,nope"], "unknown nope"),
    (["--steps", "31"], "multiple of --h"),
    (["--h", "10", "--variants", "streaming"], "fragments"),
])
def test_bad_invocations_are_refused(argv: list[str], needle: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        load_script("bench_fidelity_gpu").parse_args(["--corpus", str(corpus(tmp_path)), "--out", str(tmp_path), *argv])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_a_folder_without_tokens_is_refused(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        load_script("bench_fidelity_gpu").parse_args(["--corpus", str(tmp_path), "--out", str(tmp_path)])
    assert exc.value.code == 2 and "build_corpus.py" in capsys.readouterr().err


PAGE = """<html><head><title>T</title><style>p {color: red}</style><script>var x = 1;</script></head><body>
<div class="sphinxsidebar"><ul><li>Navigation link</li></ul></div>
<nav>Top menu</nav>
<h1>Snapshots<a class="headerlink" href="#s">¶</a></h1>
<p>Device-mapper   allows you,
without massive data copying, to <em>create</em> snapshots.<p>An unclosed paragraph &amp; an entity.
<pre>$ dmsetup create
    indented line</pre>
<div role="navigation">Next page</div><footer>Copyright</footer></body></html>"""


def test_a_page_keeps_its_prose_and_nothing_else() -> None:
    text = load_script("build_corpus").page_text(PAGE)
    assert text.splitlines() == ["Snapshots", "", "Device-mapper allows you, without massive data copying, to create "
                                 "snapshots.", "An unclosed paragraph & an entity.", "$ dmsetup create",
                                 "    indented line"]


def test_the_corpus_pages_tokenizer_and_split(tmp_path: Path) -> None:
    mod = load_script("build_corpus")
    root = tmp_path / "pkg"
    (root / "html" / "_static").mkdir(parents=True)
    prose = "<p>" + " ".join(f"word{i % 50} and more words" for i in range(40)) + "</p>"
    for i in range(120):
        (root / "html" / f"page{i}.html").write_text(f"<html><body><h1>Page {i}</h1>{prose}</body></html>")
    (root / "html" / "genindex.html").write_text(f"<html><body>{prose}</body></html>")
    (root / "html" / "_static" / "x.html").write_text(f"<html><body>{prose}</body></html>")
    (root / "html" / "short.html").write_text("<p>too short</p>")
    docs = mod.documents("pkg", root)
    assert len(docs) == 120 and all(d["source"].startswith("pkg/html/page") for d in docs)
    texts = [d["text"] for d in docs]
    mod.train_tokenizer(texts, 512, tmp_path / "tokenizer.json")
    train, held_out, eos = mod.tokenize(texts, tmp_path / "tokenizer.json")
    assert train.dtype == np.uint16 and int(train.max()) < 512
    assert int((held_out == eos).sum()) == len(range(0, 120, mod.EVAL_EVERY))   # every 50th document
    assert int((train == eos).sum()) == 120 - len(range(0, 120, mod.EVAL_EVERY))
