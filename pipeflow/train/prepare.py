"""`pipeflow prepare INPUT... --out DIR`: documents to flat token files (nanoGPT's format).

Inputs by suffix: `.jsonl` (one JSON record a line) and `.parquet` give one document a
record (its `--field`, default `text`); any other file is one document of text. `--dataset
NAME_OR_FOLDER` reads a Hugging Face dataset (a folder `save_to_disk` wrote, or a Hub name,
streamed) with the `datasets` library. Every document ends with the tokenizer's end-of-text
token where it has one (tiktoken, most `tokenizers` files; the byte tokenizer has none).

Nothing is read whole: records stream from their files, large text files in blocks of lines,
batches of documents are tokenized in `--workers` processes (in order), and the tokens go to
disk as they come, a progress bar on stderr. Writes `DIR/train.bin`, `DIR/val.bin` (the last
`val_fraction` of the tokens) and `DIR/meta.json` (tokenizer, vocabulary size, dtype, eot).
`tiktoken:NAME` and `hf:NAME_OR_tokenizer.json` are optional extras (`pipeflow[tokenizers]`);
Parquet and `--dataset` need `pipeflow[data]`.

Every input kind gives a document's text as written: a text file is read without newline
translation, so its CR and CRLF reach the tokenizer as a JSONL or Parquet string holding the
same characters does (the same document, the same tokens, whatever its container). Inputs
must be UTF-8: a file with bytes that are not is refused, naming the file and the byte's
offset (nothing is replaced behind the user's back). Hidden temporary files an interrupted
prepare left in `--out` are removed, and named, by the next prepare there.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import tempfile
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from pipeflow._io import atomic_write, atomic_write_bytes

__all__ = ["load_tokenizer", "prepare", "end_of_text", "documents", "hf_tokenizer",
           "clean_leftovers"]

Encode = Callable[[str], list[int]]
TEXT_BLOCK = 1 << 20          # a text file is read and tokenized this many bytes at a time
BATCH_CHARS = 1 << 20         # documents sent to a worker at once, by their characters


def _byte_tokenizer() -> tuple[Encode, int, int | None]:
    return (lambda text: list(text.encode("utf-8"))), 256, None


def _tiktoken(name: str) -> tuple[Encode, int, int | None]:
    import tiktoken
    enc = tiktoken.get_encoding(name)
    return enc.encode_ordinary, enc.n_vocab, int(enc.eot_token)


def _names_a_file(name: str) -> bool:
    """Whether `hf:NAME` names a tokenizer.json rather than a Hub repository: a path that
    exists, ends in .json, or starts as a path does (/, ./, ../, ~)."""
    return os.path.exists(name) or name.lower().endswith(".json") or \
        name.startswith(("/", "./", "../", "~", "." + os.sep))


def hf_tokenizer(name: str) -> Any:
    """The `tokenizers.Tokenizer` of `hf:NAME`: a tokenizer.json file, or a Hub repository
    (downloaded once, then cached); a ValueError naming the file or repository and what to do
    where neither loads (a moved file, no network)."""
    from tokenizers import Tokenizer
    if _names_a_file(name):
        path = os.path.expanduser(name)
        if not os.path.isfile(path):
            what = "is a folder" if os.path.isdir(path) else "does not exist"
            raise ValueError(f"tokenizer hf:{name}: expected a tokenizer.json file, the path "
                             f"{what}; give the file's path (hf:/path/to/tokenizer.json)")
        try:
            return Tokenizer.from_file(path)
        except Exception as exc:      # tokenizers raises a bare Exception for a bad file
            raise ValueError(f"tokenizer hf:{name}: not a readable tokenizer.json "
                             f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
                             f"; give a tokenizer.json that the tokenizers library wrote")
    try:
        return Tokenizer.from_pretrained(name)
    except Exception as exc:          # offline, a private or unknown repository
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"tokenizer hf:{name}: could not load it from the Hugging Face Hub "
                         f"({first}); where this machine is offline, download the "
                         f"repository's tokenizer.json elsewhere and pass "
                         f"hf:/path/to/tokenizer.json") from None


def _hf_tokenizers(name: str) -> tuple[Encode, int, int | None]:
    tok = hf_tokenizer(name)
    ids = [tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<|end_of_text|>")]
    eot = next((int(i) for i in ids if i is not None), None)
    return (lambda text: tok.encode(text, add_special_tokens=False).ids), \
        tok.get_vocab_size(), eot


_KINDS = {"tiktoken": (_tiktoken, "tiktoken"), "hf": (_hf_tokenizers, "tokenizers")}


def _codec(spec: str) -> tuple[Encode, int, int | None]:
    """(encode a text, vocabulary size, end-of-text id or None) of a tokenizer spec."""
    if spec == "byte":
        return _byte_tokenizer()
    kind, _, name = spec.partition(":")
    if kind not in _KINDS or not name:
        raise ValueError(f"--tokenizer must be 'byte', 'tiktoken:NAME' (e.g. tiktoken:gpt2) "
                         f"or 'hf:NAME_OR_FILE', found {spec!r}")
    make, package = _KINDS[kind]
    try:
        return make(name)
    except ImportError:
        raise ValueError(f"--tokenizer {spec} needs the {package!r} package: pip install "
                         f"'pipeflow[tokenizers]' (or use the built-in 'byte')") from None


def load_tokenizer(spec: str) -> tuple[Encode, int]:
    """`byte`, `tiktoken:NAME` or `hf:NAME`: a function encoding one document (its
    end-of-text token after it, where the tokenizer has one) and the vocabulary size."""
    encode, vocab, eot = _codec(spec)
    return (encode if eot is None else (lambda text: encode(text) + [eot])), vocab


def end_of_text(spec: str) -> int | None:
    """The tokenizer's end-of-text id (the document boundary `[data] packed` restarts
    positions after), None where it has none (the byte tokenizer)."""
    return _codec(spec)[2]


# -- documents ------------------------------------------------------------------------------

def documents(inputs: Sequence[str | os.PathLike], field: str = "text",
              dataset: str = "", split: str = "train") -> Iterator[tuple[str, bool]]:
    """(text, whether a document ends with it), in order: each input by its suffix, then the
    dataset. A text file comes in blocks of lines, its last block ending the document."""
    for path in inputs:
        path = os.fspath(path)
        suffix = os.path.splitext(path)[1].lower()
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no such file (inputs are text, .jsonl or .parquet "
                             f"files; a Hugging Face dataset goes with --dataset)")
        if suffix == ".jsonl":
            yield from ((t, True) for t in _jsonl(path, field))
        elif suffix == ".parquet":
            yield from ((t, True) for t in _parquet(path, field))
        else:
            yield from _text_blocks(path)
    if dataset:
        yield from ((t, True) for t in _dataset(dataset, field, split))


def _decoded(line: bytes, path: str, offset: int) -> str:
    """`line` (found at byte `offset` of `path`) as UTF-8; a ValueError naming the file and
    the first byte that is not UTF-8 otherwise."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = line[exc.start:exc.start + 4]
        raise ValueError(f"{path}: expected UTF-8 text, found the bytes {bad!r} at byte offset "
                         f"{offset + exc.start} ({exc.reason}); convert the file to UTF-8 "
                         f"(e.g. iconv -f LATIN1 -t UTF-8) or remove the bytes") from None


def _lines(path: str) -> Iterator[str]:
    """The lines of `path` as written (CR and CRLF kept: no newline translation), UTF-8."""
    with open(path, "rb") as f:
        offset = 0
        for line in f:
            yield _decoded(line, path, offset)
            offset += len(line)


def _text_blocks(path: str) -> Iterator[tuple[str, bool]]:
    block: list[str] = []
    size = 0
    for line in _lines(path):
        block.append(line)
        size += len(line)
        if size >= TEXT_BLOCK:
            yield "".join(block), False
            block, size = [], 0
    yield "".join(block), True


def _field_of(record: Any, field: str, where: str) -> str:
    if not isinstance(record, dict) or field not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{where}: no field {field!r} (found {keys}); choose the text's "
                         f"field with --field NAME")
    value = record[field]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field {field!r} holds {type(value).__name__}, expected "
                         f"text; choose another --field")
    return value


def _jsonl(path: str, field: str) -> Iterator[str]:
    for n, line in enumerate(_lines(path), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}, line {n}: not JSON ({exc})") from None
        yield _field_of(record, field, f"{path}, line {n}")


def _parquet(path: str, field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs the 'pyarrow' package: pip install "
                         f"'pipeflow[data]'") from None
    import pyarrow as pa
    try:
        table = pq.ParquetFile(path)
        names = table.schema_arrow.names
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"{path}: expected a Parquet file, could not read it ({exc}); check "
                         f"the file (a copy cut short?) or convert it again") from None
    if field not in names:
        raise ValueError(f"{path}: no column {field!r} (found {names}); "
                         f"choose the text's column with --field NAME")
    row = 0
    batches = table.iter_batches(columns=[field], batch_size=1024)
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(f"{path}: expected a Parquet file, could not read it past row "
                             f"{row} ({exc}); check the file or convert it again") from None
        if batch is None:
            return
        for value in batch.column(0).to_pylist():
            yield _field_of({field: value}, field, f"{path}, row {row}")
            row += 1


def _dataset(name: str, field: str, split: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"--dataset {name}: needs the 'datasets' package: pip install "
                         f"'pipeflow[data]'") from None
    if os.path.isdir(name):
        data = datasets.load_from_disk(name)
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"--dataset {name}: no split {split!r} (found "
                                 f"{sorted(data)}); choose one with --split")
            data = data[split]
    else:
        data = datasets.load_dataset(name, split=split, streaming=True)
    for i, record in enumerate(data):
        yield _field_of(record, field, f"--dataset {name}, record {i}")


# -- tokenizing in workers ------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _start_worker(spec: str) -> None:
    _WORKER["codec"] = _codec(spec)


def _encode_batch(batch: list[tuple[str, bool]]) -> np.ndarray:
    encode, _, eot = _WORKER["codec"]
    ids: list[int] = []
    for text, ends in batch:
        ids += encode(text)
        if ends and eot is not None:
            ids.append(eot)
    return np.asarray(ids, dtype=np.int64)


def _batches(docs: Iterable[tuple[str, bool]], counter: list[int]) -> Iterator[list]:
    batch: list[tuple[str, bool]] = []
    size = 0
    for doc in docs:
        batch.append(doc)
        size += len(doc[0])
        counter[0] += doc[1]
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _tokenized(docs: Iterable[tuple[str, bool]], spec: str, workers: int,
               counter: list[int]) -> Iterator[np.ndarray]:
    """Each batch's tokens, in input order, from `workers` processes (or this one)."""
    if workers <= 1:
        _start_worker(spec)
        yield from map(_encode_batch, _batches(docs, counter))
        return
    context = multiprocessing.get_context("spawn")    # no fork of an MPI or torch process
    with context.Pool(workers, _start_worker, (spec,)) as pool:
        yield from pool.imap(_encode_batch, _batches(docs, counter))


def _progress(enabled: bool) -> Any:
    """A tqdm bar on stderr (documents and tokens), or None without tqdm or when off."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(unit=" docs", desc="pipeflow prepare", mininterval=0.5)


def prepare(texts: Sequence[str | os.PathLike], out: str | os.PathLike,
            tokenizer: str = "byte", val_fraction: float = 0.05, *, field: str = "text",
            dataset: str = "", split: str = "train", workers: int = 1,
            progress: bool = False) -> dict:
    """Tokenize the documents of `texts` (files, in order; see the module's docstring) and
    of `dataset` into `out`; returns the meta record."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), found {val_fraction}")
    if not texts and not dataset:
        raise ValueError("nothing to prepare: give input files (text, .jsonl, .parquet) or "
                         "--dataset NAME_OR_FOLDER")
    if workers < 1:
        raise ValueError(f"--workers must be a positive integer, found {workers}")
    _, vocab, eot = _codec(tokenizer)
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    os.makedirs(out, exist_ok=True)
    cleaned = clean_leftovers(out)
    fd, stream = tempfile.mkstemp(prefix=".tokens.", suffix=".tmp", dir=os.fspath(out))
    counter, total, bar = [0], 0, None
    try:
        with os.fdopen(fd, "wb") as f:
            docs = documents(texts, field, dataset, split)
            for ids in _tokenized(docs, tokenizer, workers, counter):
                f.write(ids.astype(dtype).tobytes())
                total += len(ids)
                if bar is None:              # from the first batch: no bar before an error
                    bar = _progress(progress)
                if bar is not None:
                    bar.n = counter[0]
                    bar.set_postfix_str(f"{total / 1e6:.2f}M tokens", refresh=True)
        meta = _split(stream, out, dtype, total, val_fraction, counter[0])
    finally:
        if bar is not None:
            bar.close()
        if os.path.exists(stream):
            os.unlink(stream)
    meta.update({"tokenizer": tokenizer, "vocab_size": vocab,
                 "sources": [os.fspath(p) for p in texts] + ([dataset] if dataset else [])})
    if eot is not None:
        meta["eot"] = eot
    meta["newlines"] = "as written"
    atomic_write_bytes(os.path.join(out, "meta.json"), json.dumps(meta, indent=1).encode())
    return {**meta, "cleaned": cleaned} if cleaned else meta


_OUTPUTS = ("train.bin", "val.bin", "meta.json")


def clean_leftovers(out: str | os.PathLike) -> list[str]:
    """Remove the hidden temporary files an interrupted prepare left in `out` (the token
    stream `.tokens.*.tmp`, and each output's `NAME.*.tmp` of an atomic write); their names."""
    names = []
    for entry in sorted(os.listdir(out)):
        if entry.endswith(".tmp") and (entry.startswith(".tokens.") or
                                       any(entry.startswith(o + ".") for o in _OUTPUTS)):
            try:
                os.unlink(os.path.join(out, entry))
            except FileNotFoundError:
                continue
            names.append(entry)
    return names


def _split(stream: str, out: str | os.PathLike, dtype: Any, total: int, val_fraction: float,
           docs: int) -> dict:
    """The token stream's head into train.bin and its last `val_fraction` into val.bin."""
    n_val = int(total * val_fraction)
    if total - n_val < 2:
        raise ValueError(f"{total} tokens from {docs} document(s): too few to train on")
    tokens = np.memmap(stream, dtype=dtype, mode="r") if total else np.zeros(0, dtype)
    step = 1 << 24
    for name, lo, hi in (("train.bin", 0, total - n_val), ("val.bin", total - n_val, total)):
        atomic_write(os.path.join(out, name), lambda f, lo=lo, hi=hi: [
            f.write(tokens[i:min(i + step, hi)].tobytes()) for i in range(lo, hi, step)])
    del tokens
    return {"dtype": np.dtype(dtype).name, "train_tokens": total - n_val, "val_tokens": n_val,
            "documents": docs}
