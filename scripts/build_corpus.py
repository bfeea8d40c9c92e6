"""An English corpus that needs no network at training time, built from documentation Debian ships.

Real text for convergence benchmarks (issue 43): the HTML manuals inside Debian's documentation
packages (the Python, PostgreSQL, Git and Linux kernel manuals by default), downloaded with
`apt-get download` (no install: nothing on the machine changes but the output folder), unpacked with
`dpkg-deb`, and turned into plain text with the standard library's HTML parser. One HTML page is one
document; navigation, scripts, styles and sidebars are left out, duplicates are dropped.

Writes into --out:
  corpus.jsonl.gz   one {"text": ..., "source": "package/path"} per document: `zb train --data.path` reads it
  tokenizer.json    a byte-level BPE of --vocab tokens trained on the corpus's train split, with
                    <|endoftext|> as its end-of-text token (zb's data.tokenizer takes the folder)
  tokens.npz        the corpus tokenized: `train` and `eval` (every 50th document) as uint16/int32 ids,
                    documents separated by <|endoftext|>, for the GPU study (scripts/bench_fidelity_gpu.py)
  corpus.json       what was built: packages and versions, documents, characters, tokens

    python scripts/build_corpus.py --out data/english          # needs `apt-get update` once, as root
    python scripts/build_corpus.py --out data/english --packages python3-doc --vocab 8192

A package whose .deb holds no HTML (a metapackage such as python3-doc or linux-doc) is followed to
the documentation packages it depends on. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

DEFAULT_PACKAGES = "python3-doc,postgresql-doc,git-doc,linux-doc"
EOS = "<|endoftext|>"
EVAL_EVERY = 50         # document i is held out when i % EVAL_EVERY == 0 (2%)
MIN_CHARS = 400         # shorter pages (redirects, empty indexes) are not documents
SKIPPED_PAGES = re.compile(r"(^|/)(genindex[^/]*|search|py-modindex|modindex|searchindex)\.html?$")

# Elements whose text is not prose: left out with everything inside them.
SKIP_TAGS = {"script", "style", "head", "nav", "footer", "noscript", "svg", "button", "form", "select"}
SKIP_CLASSES = {"sphinxsidebar", "related", "footer", "headerlink", "navigation", "navheader", "navfooter",
                "toc", "breadcrumbs", "wy-nav-side", "rst-footer-buttons", "searchbox"}
# Elements after which the text goes on on a new line.
BLOCK_TAGS = {"p", "div", "br", "li", "dt", "dd", "pre", "tr", "table", "ul", "ol", "dl", "section", "article",
              "blockquote", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "title", "figcaption"}
VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "param", "source",
             "track", "wbr"}


class TextOfPage(HTMLParser):
    """The prose of one HTML page: text outside SKIP_TAGS and SKIP_CLASSES, one line per block."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.stack: list[tuple[str, bool]] = []   # (tag, skipped) of each open element
        self.pre = 0

    @property
    def skipping(self) -> bool:
        return any(skipped for _, skipped in self.stack)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in BLOCK_TAGS:
            self.parts.append("\n")
        if tag in VOID_TAGS:
            return
        found = dict(attrs)
        classes = set((found.get("class") or "").split())
        skipped = tag in SKIP_TAGS or bool(classes & SKIP_CLASSES) or found.get("role") == "navigation"
        self.stack.append((tag, skipped))
        if tag == "pre":
            self.pre += 1

    def handle_endtag(self, tag: str) -> None:
        # HTML leaves some elements unclosed (<p>, <li>): close everything opened inside this one.
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                if tag == "pre" or any(t == "pre" for t, _ in self.stack[i:]):
                    self.pre = max(0, self.pre - sum(1 for t, _ in self.stack[i:] if t == "pre"))
                del self.stack[i:]
                break
        if tag in BLOCK_TAGS:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if not self.skipping:
            self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))

    def text(self) -> str:
        # Outside <pre> runs of whitespace are already one space: drop the one a line may start with.
        lines = [re.sub(r"^ (?=\S)", "", line.rstrip()) for line in "".join(self.parts).splitlines()]
        return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def page_text(html: str) -> str:
    parser = TextOfPage()
    parser.feed(html)
    parser.close()
    return parser.text()


def run(cmd: list[str], cwd: Path | None = None) -> str:
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        said = (out.stderr or out.stdout).strip().splitlines()
        raise RuntimeError(f"{' '.join(cmd)} failed: {said[-1] if said else f'exit {out.returncode}'}")
    return out.stdout


def doc_dependencies(package: str) -> list[str]:
    """The documentation packages a metapackage depends on (python3-doc -> python3.11-doc)."""
    text = run(["apt-cache", "depends", package])
    deps = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.strip().startswith("Depends:")]
    return [d for d in deps if d.endswith("-doc") or "-doc-" in d]


def unpack(package: str, work: Path, seen: set[str]) -> list[tuple[str, str, Path]]:
    """(package, version, unpacked root) of `package`, or of the doc packages it depends on when it has no HTML."""
    if package in seen:
        return []
    seen.add(package)
    run(["apt-get", "download", package], cwd=work)
    debs = sorted(work.glob(f"{package}_*.deb"))
    if not debs:
        raise RuntimeError(f"apt-get download {package} left no .deb")
    version = unquote(debs[-1].name.split("_")[1])   # an epoch is saved as %3a
    root = work / package
    run(["dpkg-deb", "-x", str(debs[-1]), str(root)])
    debs[-1].unlink()
    if any(root.rglob("*.html")):
        return [(package, version, root)]
    found = [u for dep in doc_dependencies(package) for u in unpack(dep, work, seen)]
    if not found:
        raise RuntimeError(f"{package} holds no HTML and depends on no documentation package")
    return found


def documents(package: str, root: Path) -> list[dict]:
    docs = []
    for path in sorted(root.rglob("*.htm*")):
        rel = path.relative_to(root).as_posix()
        if SKIPPED_PAGES.search(rel) or "/_static/" in rel or path.is_symlink():
            continue
        text = page_text(path.read_text(encoding="utf-8", errors="replace"))
        if len(text) >= MIN_CHARS:
            docs.append({"text": text, "source": f"{package}/{rel}"})
    return docs


def train_tokenizer(texts: list[str], vocab: int, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out))


def tokenize(texts: list[str], tokenizer: Path) -> tuple:
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id(EOS)
    dtype = np.uint16 if tok.get_vocab_size() <= 65536 else np.int32
    splits: dict[str, list[int]] = {"train": [], "eval": []}
    for start in range(0, len(texts), 256):
        batch = tok.encode_batch(texts[start:start + 256], add_special_tokens=False)
        for i, enc in enumerate(batch, start):
            ids = splits["eval" if i % EVAL_EVERY == 0 else "train"]
            ids.extend(enc.ids)
            ids.append(eos)
    return np.asarray(splits["train"], dtype=dtype), np.asarray(splits["eval"], dtype=dtype), eos


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="Folder to write the corpus, tokenizer and tokens into.")
    p.add_argument("--packages", default=DEFAULT_PACKAGES, help="Comma-separated Debian package names.")
    p.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary size (0: no tokenizer, no tokens).")
    p.add_argument("--json", action="store_true", help="Only the JSON line on stdout.")
    args = p.parse_args(argv)
    packages = [x.strip() for x in args.packages.split(",") if x.strip()]
    if not packages:
        p.error("--packages: name at least one Debian package")
    if args.vocab and not 512 <= args.vocab <= 1 << 20:
        p.error("--vocab must be 0 or between 512 and 1048576")
    args.out.mkdir(parents=True, exist_ok=True)
    docs: list[dict] = []
    built: list[dict] = []
    seen_hashes: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="zb-corpus-") as tmp:
        seen: set[str] = set()
        for name in packages:
            try:
                unpacked = unpack(name, Path(tmp), seen)
            except RuntimeError as e:
                print(f"error: {e} (is the package name right for this Debian release, and has "
                      f"`apt-get update` run?)", file=sys.stderr)
                raise SystemExit(1) from None
            for package, version, root in unpacked:
                kept = 0
                for doc in documents(package, root):
                    digest = hashlib.sha1(doc["text"].encode()).hexdigest()
                    if digest not in seen_hashes:
                        seen_hashes.add(digest)
                        docs.append(doc)
                        kept += 1
                built.append({"package": package, "version": version, "documents": kept,
                              "chars": sum(len(d["text"]) for d in docs[len(docs) - kept:])})
                if not args.json:
                    print(f"{package} {version}: {kept} documents, {built[-1]['chars'] / 1e6:.1f}M characters",
                          file=sys.stderr)
    with gzip.open(args.out / "corpus.jsonl.gz", "wt", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    summary: dict = {"bench": "corpus", "packages": built, "documents": len(docs),
                     "chars": sum(len(d["text"]) for d in docs), "eval_every": EVAL_EVERY}
    if args.vocab:
        texts = [d["text"] for d in docs]
        tokenizer = args.out / "tokenizer.json"
        train_tokenizer([t for i, t in enumerate(texts) if i % EVAL_EVERY], args.vocab, tokenizer)
        import numpy as np

        train, held_out, eos = tokenize(texts, tokenizer)
        np.savez(args.out / "tokens.npz", train=train, eval=held_out, eos=np.asarray([eos]), vocab=np.asarray([args.vocab]))
        summary.update(vocab=args.vocab, train_tokens=int(train.size), eval_tokens=int(held_out.size),
                       chars_per_token=round(summary["chars"] / max(1, train.size + held_out.size), 2))
    (args.out / "corpus.json").write_text(json.dumps(summary, indent=1) + "\n")
    if not args.json:
        print(f"{'package':>22} {'version':>16} {'documents':>9} {'chars':>12}")
        for b in built:
            print(f"{b['package']:>22} {b['version']:>16} {b['documents']:>9} {b['chars']:>12,}")
        extra = (f", {summary['train_tokens']:,} train + {summary['eval_tokens']:,} held-out tokens "
                 f"({summary['chars_per_token']} characters a token)") if args.vocab else ""
        print(f"{summary['documents']} documents, {summary['chars']:,} characters{extra} in {args.out}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
