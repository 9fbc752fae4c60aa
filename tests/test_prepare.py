"""`pipeflow prepare`: JSONL, Parquet and a Hugging Face dataset folder give the token files
that the same documents give as text files (one document a file, today's path), byte by
byte, with the end-of-text token between documents; in several processes too; blocks of a
large text file tokenize as the whole; a missing field is named."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pipeflow.cli import main
from pipeflow.train import prepare as prep

DOCS = ["The first document.\nIt has two lines.\n", "Zweites Dokument: ünïcödé ✓",
        "a third, short one", "\n\nwith blank lines\n\n\nand more\n" * 20]


def bpe_tokenizer(tmp_path) -> str:
    """A small BPE `tokenizer.json` trained here (no download), with an end-of-text token."""
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers
                                             .ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 5, trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return f"hf:{path}"


def files_of(folder) -> tuple[bytes, bytes, dict]:
    meta = json.loads((folder / "meta.json").read_text())
    meta.pop("sources")
    return (folder / "train.bin").read_bytes(), (folder / "val.bin").read_bytes(), meta


def as_text_files(tmp_path) -> list[str]:
    paths = []
    for i, doc in enumerate(DOCS):
        path = tmp_path / f"doc{i}.txt"
        path.write_text(doc, encoding="utf-8")
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_jsonl_parquet_and_a_dataset_equal_the_same_text_files(tmp_path, tokenizer):
    spec = bpe_tokenizer(tmp_path) if tokenizer == "bpe" else "byte"
    prep.prepare(as_text_files(tmp_path), tmp_path / "text", spec, 0.2)
    want = files_of(tmp_path / "text")
    encode, _ = prep.load_tokenizer(spec)
    assert np.frombuffer(want[0] + want[1], np.uint16).tolist() == \
        [t for doc in DOCS for t in encode(doc)]
    if tokenizer == "bpe":             # the end-of-text token closes every document
        assert want[2]["eot"] == 0 and want[2]["documents"] == 4
        assert np.frombuffer(want[0] + want[1], np.uint16).tolist().count(0) == 4
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in
                             enumerate(DOCS)), encoding="utf-8")
    assert main(["prepare", str(jsonl), "--out", str(tmp_path / "jsonl"), "--tokenizer", spec,
                 "--val-fraction", "0.2", "--field", "body", "--workers", "2"]) == 0
    assert files_of(tmp_path / "jsonl") == want
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "docs.parquet", row_group_size=2)
    prep.prepare([tmp_path / "docs.parquet"], tmp_path / "parquet", spec, 0.2)
    assert files_of(tmp_path / "parquet") == want
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "ds"))
    prep.prepare([], tmp_path / "dataset", spec, 0.2, dataset=str(tmp_path / "ds"))
    assert files_of(tmp_path / "dataset") == want


def test_a_large_text_file_in_blocks_tokenizes_as_a_whole(tmp_path, monkeypatch, capsys):
    path = tmp_path / "big.txt"
    path.write_text("".join(DOCS) * 50, encoding="utf-8")
    prep.prepare([path], tmp_path / "whole", "byte", 0.1)
    monkeypatch.setattr(prep, "TEXT_BLOCK", 1000)
    monkeypatch.setattr(prep, "BATCH_CHARS", 3000)
    meta = prep.prepare([path], tmp_path / "blocks", "byte", 0.1, progress=True)
    assert files_of(tmp_path / "blocks") == files_of(tmp_path / "whole")
    assert meta["documents"] == 1 and "pipeflow prepare" in capsys.readouterr().err


def test_a_missing_field_is_named(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ValueError, match=r"docs.jsonl, line 2: no field 'text' \(found "
                                         r"\['body'\]\); choose the text's field with --field"):
        prep.prepare([jsonl], tmp_path / "out", "byte", 0.0)
    with pytest.raises(ValueError, match="nothing to prepare"):
        prep.prepare([], tmp_path / "out", "byte", 0.0)


def word_tokenizer(tmp_path, vocab: int) -> str:
    """A word-level `tokenizer.json` of `vocab` ids (`w0` ... `w{vocab-1}`), no end-of-text."""
    tokenizers = pytest.importorskip("tokenizers")
    words = {f"w{i}": i for i in range(vocab)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    path = tmp_path / f"words{vocab}.json"
    tok.save(str(path))
    return f"hf:{path}"


@pytest.mark.parametrize("vocab", [2**16, 100_277])
def test_every_token_id_of_the_vocabulary_reads_back_from_the_token_file(tmp_path, vocab):
    # Token files are uint16 while every id fits (vocabularies up to 65,536), uint32 past
    # that (GPT-4's 100k, Llama 3's 128k): ids past 65,535 must come back, not wrapped.
    spec = word_tokenizer(tmp_path, vocab)
    ids = [0, 1, 255, 65_535, vocab // 2, vocab - 2, vocab - 1] * 3
    text = tmp_path / "doc.txt"
    text.write_text(" ".join(f"w{i}" for i in ids), encoding="utf-8")
    meta = prep.prepare([text], tmp_path / "out", spec, 0.0)
    from pipeflow.train.data import token_file
    assert token_file(tmp_path / "out" / "train.bin", meta["dtype"]).tolist() == ids
    assert meta["dtype"] == ("uint16" if vocab <= 2**16 else "uint32")


def test_workers_write_the_documents_in_input_order(tmp_path, monkeypatch):
    # `--workers N` must write the token files one process writes, byte for byte, whatever
    # order the workers finish in: documents of very different sizes, a batch each, so a
    # small one sent after a large one is done first.
    monkeypatch.setattr(prep, "BATCH_CHARS", 1)
    docs = []
    for i in range(4):
        docs.append(f"large {i} " + "x" * 400_000)
        docs += [f"small {i}.{j}" for j in range(12)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    prep.prepare([jsonl], tmp_path / "one", "byte", 0.1)
    prep.prepare([jsonl], tmp_path / "two", "byte", 0.1, workers=2)
    assert files_of(tmp_path / "two") == files_of(tmp_path / "one")
    first = np.fromfile(tmp_path / "one" / "train.bin", np.uint16, count=7)
    assert bytes(first.tolist()) == b"large 0"


# -- issue 46: the same document gives the same tokens from every input kind -------------

CR_DOCS = ["windows line\r\nends here\r\n", "an old mac\rline", "mixed\r\n\rand\n"]


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_carriage_returns_reach_the_tokenizer_alike_from_text_jsonl_and_parquet(tmp_path,
                                                                               tokenizer):
    """Item 1: a text file is read as written (CR and CRLF kept), as JSONL and Parquet
    strings are; the docs promise the same token file from every input kind."""
    spec = bpe_tokenizer(tmp_path) if tokenizer == "bpe" else "byte"
    paths = []
    for i, doc in enumerate(CR_DOCS):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_bytes(doc.encode("utf-8"))
    meta = prep.prepare(paths, tmp_path / "text", spec, 0.0)
    want = files_of(tmp_path / "text")
    encode, _ = prep.load_tokenizer(spec)
    assert np.frombuffer(want[0], np.uint16).tolist() == [t for d in CR_DOCS for t in encode(d)]
    assert meta["newlines"] == "as written"
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\r\n" for d in CR_DOCS))
    prep.prepare([jsonl], tmp_path / "jsonl", spec, 0.0)
    assert files_of(tmp_path / "jsonl") == want
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    pq.write_table(pa.table({"text": CR_DOCS}), tmp_path / "docs.parquet")
    prep.prepare([tmp_path / "docs.parquet"], tmp_path / "parquet", spec, 0.0)
    assert files_of(tmp_path / "parquet") == want


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_bytes_that_are_not_utf8_are_refused_naming_the_file_and_offset(tmp_path, kind):
    """Item 6: invalid UTF-8 is refused (was: silently replaced, 5,000 random bytes became
    8,939 tokens), the same for text and JSONL, naming the file and the byte's offset."""
    good = "fine text\n" * 3
    path = tmp_path / f"bad.{kind}"
    body = good.encode() + b"caf\xe9\n"
    if kind == "jsonl":
        body = b'{"text": "ok"}\n{"text": "caf\xe9"}\n'
    path.write_bytes(body)
    offset = body.index(b"\xe9")
    with pytest.raises(ValueError, match=rf"bad\.{kind}: expected UTF-8 text, found the bytes "
                                         rf".*at byte offset {offset} .*convert the file"):
        prep.prepare([path], tmp_path / "out", "byte", 0.0)
    assert main(["prepare", str(path), "--out", str(tmp_path / "cli")]) == 2


def test_a_corrupt_parquet_file_is_named(tmp_path):
    """Item 11: "Parquet magic bytes not found in footer" with the file unnamed, before."""
    pytest.importorskip("pyarrow")
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(ValueError, match=r"broken\.parquet: expected a Parquet file, could not "
                                         r"read it .*convert it again"):
        prep.prepare([path], tmp_path / "out", "byte", 0.0)


def test_a_missing_tokenizer_file_is_named_as_missing(tmp_path):
    """Item 10: a missing hf:/path/tokenizer.json said "Repo id must be in the form ...";
    now the file is named as missing, in prepare and in sample's loader alike."""
    pytest.importorskip("tokenizers")
    from pipeflow.train.sample import load_tokenizer
    missing = tmp_path / "gone" / "tokenizer.json"
    for load in (prep.load_tokenizer, load_tokenizer):
        with pytest.raises(ValueError, match=rf"tokenizer hf:{missing}: expected a "
                                             rf"tokenizer.json file, the path does not exist"):
            load(f"hf:{missing}")


def test_an_unreachable_hub_tokenizer_is_named_with_the_offline_fix(monkeypatch):
    """Item 10: `--tokenizer hf:gpt2` offline gave the Hub library's generic cache message,
    the tokenizer unnamed."""
    tokenizers = pytest.importorskip("tokenizers")

    def offline(name, *args, **kwargs):
        raise Exception("We couldn't connect to 'https://huggingface.co' to load the files")
    monkeypatch.setattr(tokenizers.Tokenizer, "from_pretrained", staticmethod(offline))
    with pytest.raises(ValueError, match=r"tokenizer hf:gpt2: could not load it from the "
                                         r"Hugging Face Hub .*pass hf:/path/to/tokenizer.json"):
        prep.load_tokenizer("hf:gpt2")


def test_leftovers_of_an_interrupted_prepare_are_removed_and_named(tmp_path, capsys):
    """Item 18: a SIGTERM during prepare left a hidden `.tokens.*.tmp` that no later run
    named or removed; the next prepare into the folder removes and names it."""
    out = tmp_path / "out"
    out.mkdir()
    for name in (".tokens.abc123.tmp", "train.bin.x1y2.tmp", "notes.tmp", ".other.tmp"):
        (out / name).write_bytes(b"\0" * 10)
    text = tmp_path / "doc.txt"
    text.write_text("some text to tokenize\n" * 4)
    assert main(["prepare", str(text), "--out", str(out), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "removed the leftovers of an interrupted prepare" in said
    assert ".tokens.abc123.tmp" in said and "train.bin.x1y2.tmp" in said
    assert "newlines as written" in said
    assert sorted(os.listdir(out)) == [".other.tmp", "meta.json", "notes.tmp", "train.bin",
                                       "val.bin"]


def test_a_sigterm_during_prepare_leaves_no_temporary_file(tmp_path):
    """Item 18: `pipeflow prepare` ends on SIGTERM through its cleanup, not mid-write."""
    import signal
    import subprocess
    import sys
    import time
    text = tmp_path / "big.txt"
    text.write_text("a line of text to tokenize slowly\n" * 200000)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "pipeflow", "prepare", str(text), "--out",
                             str(out), "--no-progress"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while time.time() < deadline and not (out.is_dir() and any(
            n.startswith(".tokens.") for n in os.listdir(out))):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert out.is_dir() and not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_token_files_follow_the_umask(tmp_path):
    """Item 17: token files were 0600 (tempfile's mode); they follow the umask as `open`."""
    text = tmp_path / "doc.txt"
    text.write_text("some text to tokenize\n" * 4)
    old = os.umask(0o022)
    try:
        prep.prepare([text], tmp_path / "out", "byte", 0.1)
    finally:
        os.umask(old)
    modes = {n: os.stat(tmp_path / "out" / n).st_mode & 0o777 for n in
             ("train.bin", "val.bin", "meta.json")}
    assert modes == {"train.bin": 0o644, "val.bin": 0o644, "meta.json": 0o644}
