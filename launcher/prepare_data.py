"""Turn text into token memmaps: ``python -m launcher.prepare_data [--source SRC] [--out DIR]``.

Sources (all offline):
  kjv (default)        the embedded corpus: the King James Bible (public domain), shipped as data/kjv.txt.xz and
                       read directly (no HF ``datasets`` needed)
  path(s)              local .txt / .json / .jsonl / .parquet files or folders of them, read with HF ``datasets``
  a dataset name       a Hugging Face dataset already in the local cache (HF_DATASETS_OFFLINE=1 is enforced)

Tokenizer: GPT-2 BPE through ``tiktoken`` when its two files are in tiktoken's local cache (``--tokenizer gpt2``;
``auto`` uses it when present), otherwise a byte-level BPE trained on the corpus with HF ``tokenizers``.
Nothing is downloaded.

Output: DIR/train.bin, DIR/val.bin (flat token ids; documents separated by an end-of-text token), DIR/meta.json,
and for a trained tokenizer DIR/tokenizer.json.
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import json
import lzma
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_CORPUS = REPO_ROOT / "data" / "kjv.txt.xz"
GPT2_FILES = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)
EOT = "<|endoftext|>"
EMBEDDED_DATA_DIR = "data/cache/kjv"  # where the main job prepares the embedded corpus on first use


class PrepareError(RuntimeError):
    """A problem with the user's input to prepare_data; printed without a traceback."""


def on_terminal() -> bool:
    """Progress bars only where a person watches them: in a log file their carriage-return updates pile up (each
    stage prints one line instead)."""
    return sys.stderr.isatty()


# ----------------------------------------------------------------------------------------------------------------
# Sources


def check_readable(path: Path, kind: str) -> None:
    """Stop with the file's name if it is empty, or (for text) not UTF-8."""
    if path.stat().st_size == 0:
        raise PrepareError(f"{path} is empty: remove it from --source (or from the folder)")
    if kind != "text":
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as f:
        try:
            while chunk := f.read(1 << 20):
                decoder.decode(chunk)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError as err:
            raise PrepareError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start} of a block): remove it "
                               "from --source or convert it to UTF-8") from None


def source_key(source: list[str]) -> list[str]:
    """The source as recorded in meta.json: paths made absolute, so that one source always compares equal."""
    return [str(Path(s).resolve()) if Path(s).exists() else s for s in source]


def default_out(source: list[str]) -> Path:
    """data/cache/<name of the first source>: the embedded corpus's folder for kjv, one folder per source otherwise."""
    first = source[0]
    if source == ["kjv"]:
        return Path(EMBEDDED_DATA_DIR)
    name = Path(first.rstrip("/")).stem if Path(first).exists() else first
    return Path(EMBEDDED_DATA_DIR).parent / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "data")


def check_out_dir(out_dir: Path, source: list[str], force: bool) -> None:
    """Refuse a folder prepared from another source (unless ``force``) and one that cannot be written."""
    meta = out_dir / "meta.json"
    if meta.is_file() and not force:
        try:
            previous = json.loads(meta.read_text()).get("source_key") or json.loads(meta.read_text()).get("source")
        except (OSError, ValueError):
            previous = None
        if previous != source_key(source):
            raise PrepareError(f"{out_dir} already holds data prepared from {previous}; runs and checkpoints may "
                               "depend on it. Choose another --out, or pass --force to replace it")
    existing = next(p for p in (out_dir.absolute(), *out_dir.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise PrepareError(f"--out {out_dir}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK):
        raise PrepareError(f"--out {out_dir}: {existing} is not writable")


def kjv_chapters() -> list[str]:
    """The embedded corpus, one string per chapter (its verses joined by spaces, verse numbers removed)."""
    verse = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")
    chapters: list[list[str]] = []
    current = None
    with lzma.open(EMBEDDED_CORPUS, "rt", encoding="utf-8") as lines:
        for line in lines:
            match = verse.match(line.rstrip("\n"))
            if not match:
                continue
            key = (match.group(1), match.group(2))
            if key != current:
                chapters.append([])
                current = key
            chapters[-1].append(match.group(4).strip())
    return [" ".join(ch) for ch in chapters]


def embedded_documents() -> list[str]:
    """The embedded corpus's non-empty documents, one per chapter, read without HF ``datasets``: the file is our own,
    so it needs no general reader, and the GPU machine has no ``datasets``.

    They are exactly the documents that ``datasets``' paragraph reader made of the chapters written as one file (a
    blank line between chapters, a newline at the end), the way this corpus was prepared before: so a folder
    prepared now is byte-identical to one prepared then."""
    docs = kjv_chapters()
    docs[-1] += "\n"  # the file's final newline, which that reader left on the last document
    return [d for d in docs if d.strip()]


def split_documents(docs: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """(train, val) as ``datasets.Dataset.train_test_split(test_size=val_fraction, seed=seed)`` splits them: the
    first ceil(val_fraction * n) of numpy's ``default_rng(seed).permutation(n)`` are validation, the rest train."""
    n_val = math.ceil(val_fraction * len(docs))
    if n_val >= len(docs):
        raise PrepareError(f"--val-fraction={val_fraction} leaves no training document of {len(docs)}")
    order = np.random.default_rng(seed).permutation(len(docs))
    return [docs[i] for i in order[n_val:]], [docs[i] for i in order[:n_val]]


def load_source(source: list[str], text_field: str):
    """A ``datasets.Dataset`` with one document per row in column 'text', from the user's files or a cached dataset
    (the embedded corpus does not come through here: ``embedded_documents``)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # never reach the hub, even for a dataset name
    import datasets

    datasets.disable_caching()
    if not on_terminal():
        datasets.disable_progress_bars()
    paths = [Path(s) for s in source]
    if all(p.exists() for p in paths):
        files: list[str] = []
        for p in paths:
            files += [str(f) for f in sorted(p.rglob("*")) if f.is_file()] if p.is_dir() else [str(p)]
        kinds = {Path(f).suffix.lower() for f in files}
        builder = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
        unknown = kinds - set(builder)
        if not files or unknown or len({builder[k] for k in kinds}) != 1:
            raise PrepareError(f"--source files must all be .txt, all .json/.jsonl or all .parquet; found {sorted(kinds)}")
        kind = builder[kinds.pop()]
        for f in files:
            check_readable(Path(f), kind)
        kwargs = {"sample_by": "paragraph"} if kind == "text" else {}
        try:
            ds = datasets.load_dataset(kind, data_files=files, split="train", **kwargs)
        except Exception as err:  # datasets wraps parser errors in several types
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise PrepareError(f"could not read the {kind} files of --source ({first}); check that they are valid "
                               f"{kind}") from None
    elif len(source) == 1 and not any(sep in source[0] for sep in ("./", ".txt", ".json")):
        try:
            ds = datasets.load_dataset(source[0], split="train")
        except Exception as err:  # datasets raises several types for "not cached offline"
            raise PrepareError(f"dataset '{source[0]}' could not be loaded offline ({type(err).__name__}: {err}). "
                               "Only datasets already in the local Hugging Face cache work; otherwise pass local files.") from None
    else:
        missing = [str(p) for p in paths if not p.exists()]
        raise PrepareError(f"--source: no such file or folder: {', '.join(missing)}")
    if text_field not in ds.column_names:
        raise PrepareError(f"the source has no column '{text_field}'; its columns are {ds.column_names}: pass --text-field")
    if text_field != "text":
        ds = ds.rename_column(text_field, "text")
    return ds.select_columns(["text"])


# ----------------------------------------------------------------------------------------------------------------
# Tokenizers


def gpt2_cached() -> bool:
    """True when tiktoken's GPT-2 files are in its local cache (so loading them needs no network)."""
    cache = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or \
        os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return all(os.path.isfile(os.path.join(cache, hashlib.sha1(url.encode()).hexdigest())) for url in GPT2_FILES)


class Gpt2Tokenizer:
    name = "gpt2 (tiktoken)"

    def __init__(self):
        import tiktoken

        self.enc = tiktoken.get_encoding("gpt2")
        self.eot_id = self.enc.eot_token
        self.vocab_size = self.enc.n_vocab

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts)


class TrainedBpeTokenizer:
    name = "byte-level BPE (HF tokenizers, trained on the corpus)"

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.eot_id = tokenizer.token_to_id(EOT)
        self.vocab_size = tokenizer.get_vocab_size()

    @classmethod
    def train(cls, docs, vocab_size: int, out_dir: Path) -> "TrainedBpeTokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        print(f"[prepare] training a byte-level BPE of {vocab_size} tokens on {len(docs):,} documents", flush=True)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT], show_progress=on_terminal(),
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(texts(docs), trainer=trainer, length=len(docs))
        tok.save(str(out_dir / "tokenizer.json"))
        return cls(tok)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]


def choose_tokenizer(kind: str, docs, vocab_size: int, out_dir: Path):
    if kind == "gpt2" or (kind == "auto" and gpt2_cached()):
        if not gpt2_cached():
            raise PrepareError("--tokenizer gpt2 needs tiktoken's GPT-2 files in its local cache (TIKTOKEN_CACHE_DIR); "
                               "they are not there and nothing is downloaded. Use --tokenizer bpe (or auto).")
        return Gpt2Tokenizer()
    return TrainedBpeTokenizer.train(docs, vocab_size, out_dir)


# ----------------------------------------------------------------------------------------------------------------
# Writing


def texts(docs):
    """The documents' texts in order: ``docs`` is a list of strings (the embedded corpus) or a ``datasets.Dataset``
    with column 'text' (the user's data)."""
    return docs if isinstance(docs, list) else (row["text"] for row in docs)


def write_split(docs, tokenizer, path: Path, num_proc: int) -> int:
    """Tokenize ``docs`` (see ``texts``) and write their ids, each document followed by EOT, to ``path``; returns
    the number of tokens. A Dataset is tokenized by its ``map`` (``num_proc`` processes, progress bar)."""
    eot = tokenizer.eot_id
    print(f"[prepare] tokenizing and writing {path.name}", flush=True)
    if isinstance(docs, list):  # the embedded corpus, a few MB: one batch in this process
        ids = [x + [eot] for x in tokenizer.encode_batch(docs)]
        return _write_ids([ids], sum(len(x) for x in ids), tokenizer.vocab_size, path)

    def encode(batch):
        ids = tokenizer.encode_batch(batch["text"])
        return {"ids": [x + [eot] for x in ids], "n": [len(x) + 1 for x in ids]}

    tokenized = docs.map(encode, batched=True, batch_size=256, remove_columns=["text"], num_proc=num_proc,
                         desc=f"tokenizing {path.stem}")
    total = int(np.sum(tokenized["n"], dtype=np.int64))
    from tqdm import tqdm

    batches = tqdm((row["ids"] for row in tokenized.iter(batch_size=1024)), total=(len(tokenized) + 1023) // 1024,
                   desc=f"writing {path.name}", disable=not on_terminal())
    return _write_ids(batches, total, tokenizer.vocab_size, path)


def _write_ids(batches, total: int, vocab_size: int, path: Path) -> int:
    """Write ``total`` token ids, given as batches of per-document id lists, to ``path`` (via a .tmp file)."""
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    tmp = path.with_suffix(".tmp")
    out = np.memmap(tmp, dtype=dtype, mode="w+", shape=(max(total, 1),))
    pos = 0
    for batch in batches:
        flat = np.fromiter((t for ids in batch for t in ids), dtype=dtype)
        out[pos:pos + len(flat)] = flat
        pos += len(flat)
    out.flush()
    del out
    tmp.replace(path)
    return total


def prepare(source: list[str], out_dir: Path, tokenizer: str = "auto", vocab_size: int = 8192,
            val_fraction: float = 0.05, text_field: str = "text", seed: int = 0, num_proc: int = 1,
            force: bool = False) -> dict:
    """Prepare ``out_dir`` from ``source``; returns the meta dict written to meta.json. A folder prepared from another
    source is replaced only with ``force``."""
    check_out_dir(out_dir, source, force)
    if not 0 < val_fraction < 1:
        raise PrepareError(f"--val-fraction={val_fraction} must be between 0 and 1")
    if vocab_size < 512:
        raise PrepareError(f"--vocab-size={vocab_size} is too small for a byte-level BPE; use at least 512")
    started = time.time()
    if source == ["kjv"]:
        docs = embedded_documents()
    else:
        docs = load_source(source, text_field)
        docs = docs.filter(lambda row: bool(row["text"].strip()), desc="dropping empty documents")
    if len(docs) < 2:
        raise PrepareError(f"the source holds {len(docs)} non-empty documents; need at least 2 (one for validation)")
    print(f"[prepare] {len(docs)} documents from {' '.join(source)}", flush=True)
    if isinstance(docs, list):
        split = dict(zip(("train", "test"), split_documents(docs, val_fraction, seed)))
    else:
        split = docs.train_test_split(test_size=val_fraction, seed=seed)
    made = [p for p in (out_dir, *out_dir.parents) if not p.exists()]  # made here: removed again if refused
    out_dir.mkdir(parents=True, exist_ok=True)  # only now: a refused source leaves no empty folder behind
    try:
        tok = choose_tokenizer(tokenizer, split["train"], vocab_size, out_dir)
    except PrepareError:
        for folder in made:
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise
    print(f"[prepare] tokenizer: {tok.name}, vocabulary {tok.vocab_size}", flush=True)
    counts = {name: write_split(split[key], tok, out_dir / f"{name}.bin", num_proc)
              for name, key in (("train", "train"), ("val", "test"))}
    meta = {
        "source": source,
        "source_key": source_key(source),
        "tokenizer": tok.name,
        "tokenizer_file": "tokenizer.json" if isinstance(tok, TrainedBpeTokenizer) else None,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": "uint16" if tok.vocab_size <= 2**16 else "uint32",
        "tokens": counts,
        "documents": {"train": len(split["train"]), "val": len(split["test"])},
        "seed": seed,
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    print(f"[prepare] wrote {counts['train']:,} train and {counts['val']:,} val tokens to {out_dir} "
          f"in {time.time() - started:.0f}s", flush=True)
    return meta


def ensure_prepared(data_dir: str | Path) -> None:
    """Prepare the embedded corpus into ``data_dir`` if nothing is there yet (used by the main job)."""
    data_dir = Path(data_dir)
    if not (data_dir / "meta.json").is_file():
        print(f"[prepare] {data_dir} has no prepared data: preparing the embedded corpus (kjv) once", flush=True)
        prepare(["kjv"], data_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.prepare_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", nargs="+", default=["kjv"], help="kjv, local files/folders, or a cached HF dataset name")
    parser.add_argument("--out", help="output folder (default: data/cache/<source name>; data/cache/kjv for kjv)")
    parser.add_argument("--force", action="store_true", help="replace a folder prepared from another source")
    parser.add_argument("--tokenizer", choices=("auto", "gpt2", "bpe"), default="auto",
                        help="gpt2 (tiktoken, needs its cached files), bpe (train one), auto (gpt2 if cached)")
    parser.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of a trained BPE (default: %(default)s)")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="share of documents held out (default: %(default)s)")
    parser.add_argument("--text-field", default="text", help="column holding the text in json/parquet sources")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    parser.add_argument("--num-proc", type=int, default=1, help="processes for tokenization")
    args = parser.parse_args(argv)
    try:
        out = Path(args.out) if args.out else default_out(args.source)
        prepare(args.source, out, args.tokenizer, args.vocab_size, args.val_fraction, args.text_field, args.seed,
                args.num_proc, args.force)
    except PrepareError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: nothing was left half-written (files are written under .tmp names and renamed)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
