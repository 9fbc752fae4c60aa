"""The default corpus and the batch sampler: deterministic, shifted targets, same on every rank."""

import pytest
import torch

from pipeflow.train.data import DEFAULT_MAX_BYTES, Batches, Corpus, load_corpus, stdlib_source


def test_default_corpus_is_deterministic_capped_and_split():
    corpus = load_corpus()
    assert len(corpus) == DEFAULT_MAX_BYTES
    assert corpus.train.dtype == torch.uint8
    assert len(corpus.val) == int(DEFAULT_MAX_BYTES * 0.05)
    assert stdlib_source() is stdlib_source()  # cached in-process
    again = stdlib_source.__wrapped__()  # read from disk again, bypassing the cache
    assert again == stdlib_source()
    assert b"def " in stdlib_source()[:100_000]


def test_small_cap(tmp_path):
    corpus = load_corpus(max_bytes=1000, val_fraction=0.1)
    assert (len(corpus.train), len(corpus.val)) == (900, 100)


def test_corpus_from_a_file(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_bytes(bytes(range(256)) * 4)
    corpus = load_corpus(path)
    assert len(corpus) == 1024
    assert corpus.source == str(path)
    assert corpus.val.tolist() == list(range(256))[-51:]
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        load_corpus(empty)


def test_targets_are_inputs_shifted_by_one():
    data = torch.arange(200, dtype=torch.uint8)
    x, y = Batches(data, batch_size=5, seq_len=16, seed=0).batch(0)
    assert x.shape == y.shape == (5, 16)
    assert x.dtype == y.dtype == torch.int64
    assert x.is_contiguous() and y.is_contiguous()
    # In an arange corpus each window is consecutive, so shifted means +1.
    assert torch.equal(y, x + 1)
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_same_seed_gives_the_same_batches():
    corpus = load_corpus(max_bytes=100_000)
    a = Batches(corpus, 4, 32, seed=7)
    b = Batches(corpus, 4, 32, seed=7)
    for (xa, ya), (xb, yb), _ in zip(a, b, range(5)):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(a.batch(3)[0], next(x for i, (x, _) in enumerate(b) if i == 3))
    other = Batches(corpus, 4, 32, seed=8)
    assert not torch.equal(a.batch(0)[0], other.batch(0)[0])
    assert not torch.equal(a.batch(0)[0], a.batch(1)[0])


def test_sampling_leaves_the_global_random_state_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    Batches(load_corpus(max_bytes=10_000), 2, 8).batch(0)
    assert torch.equal(torch.rand(3), expected)


def test_validation_split_and_windows_stay_inside():
    corpus = Corpus(train=torch.zeros(50, dtype=torch.uint8),
                    val=torch.ones(20, dtype=torch.uint8), source="test")
    x, y = Batches(corpus, 64, 19, seed=0, split="val").batch(0)
    assert bool((x == 1).all()) and bool((y == 1).all())
    with pytest.raises(ValueError, match="fewer than seq_len"):
        Batches(corpus, 2, 20, split="val")
    with pytest.raises(ValueError, match="'train' or 'val'"):
        Batches(corpus, 2, 4, split="test")


def test_a_token_file_truncated_under_a_run_is_named_not_a_bus_error(tmp_path):
    import numpy as np

    from pipeflow.train.data import token_file
    path = tmp_path / "train.bin"
    np.arange(5000, dtype=np.uint16).tofile(path)
    batches = Batches(token_file(str(path)), 4, 16, seed=0)
    batches.batch(0)
    with open(path, "r+b") as f:
        f.truncate(100)                      # rewritten by another job, a full disk...
    with pytest.raises(ValueError, match=r"train.bin' shrank to 100 bytes while in use"):
        batches.batch(1)
