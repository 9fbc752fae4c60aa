"""`pipeflow prepare`: JSONL, Parquet and a Hugging Face dataset folder give the token files
that the same documents give as text files (one document a file, today's path), byte by
byte, with the end-of-text token between documents; in several processes too; blocks of a
large text file tokenize as the whole; a missing field is named."""

from __future__ import annotations

import json

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
