"""`pipeflow prepare TEXT... --out DIR`: text files to flat token files (nanoGPT's format).

Writes `DIR/train.bin`, `DIR/val.bin` (the last `val_fraction` of the tokens) and
`DIR/meta.json` (tokenizer, vocabulary size, dtype). The byte tokenizer needs nothing;
`tiktoken:NAME` (e.g. `tiktoken:gpt2`) and `hf:NAME_OR_tokenizer.json` (Hugging Face
`tokenizers`) are optional extras: `pip install "pipeflow[tokenizers]"`.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

import numpy as np

from pipeflow._io import atomic_write_bytes

__all__ = ["load_tokenizer", "prepare", "end_of_text"]

Encode = Callable[[str], list[int]]


def _byte_tokenizer() -> tuple[Encode, int]:
    return (lambda text: list(text.encode("utf-8"))), 256


def _tiktoken(name: str) -> tuple[Encode, int]:
    import tiktoken
    enc = tiktoken.get_encoding(name)
    eot = enc.eot_token
    # A document boundary token after each file, as nanoGPT's prepare scripts do.
    return (lambda text: enc.encode_ordinary(text) + [eot]), enc.n_vocab


def _hf_tokenizers(name: str) -> tuple[Encode, int]:
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(name) if os.path.isfile(name) else Tokenizer.from_pretrained(name)
    return (lambda text: tok.encode(text).ids), tok.get_vocab_size()


_KINDS = {"tiktoken": (_tiktoken, "tiktoken"), "hf": (_hf_tokenizers, "tokenizers")}


def load_tokenizer(spec: str) -> tuple[Encode, int]:
    """`byte`, `tiktoken:NAME` or `hf:NAME`: an encode function and the vocabulary size."""
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


def end_of_text(spec: str) -> int | None:
    """The tokenizer's end-of-text id (the document boundary `[data] packed` restarts
    positions after), None where it has none (the byte tokenizer)."""
    kind, _, name = spec.partition(":")
    if kind == "tiktoken":
        import tiktoken
        return int(tiktoken.get_encoding(name).eot_token)
    if kind == "hf":
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(name) if os.path.isfile(name) else \
            Tokenizer.from_pretrained(name)
        ids = [tok.token_to_id(t) for t in ("<|endoftext|>", "</s>", "<|end_of_text|>")]
        return next((int(i) for i in ids if i is not None), None)
    return None


def prepare(texts: Sequence[str | os.PathLike], out: str | os.PathLike,
            tokenizer: str = "byte", val_fraction: float = 0.05) -> dict:
    """Tokenize `texts` (files, concatenated in order) into `out`; returns the meta record."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in [0, 1), found {val_fraction}")
    encode, vocab = load_tokenizer(tokenizer)
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    ids: list[int] = []
    for path in texts:
        with open(path, encoding="utf-8", errors="replace") as f:
            ids += encode(f.read())
    tokens = np.asarray(ids, dtype=dtype)
    n_val = int(len(tokens) * val_fraction)
    if len(tokens) - n_val < 2:
        raise ValueError(f"{len(tokens)} tokens from {len(texts)} file(s): too few to train on")
    os.makedirs(out, exist_ok=True)
    atomic_write_bytes(os.path.join(out, "train.bin"), tokens[:len(tokens) - n_val].tobytes())
    atomic_write_bytes(os.path.join(out, "val.bin"), tokens[len(tokens) - n_val:].tobytes())
    meta = {"tokenizer": tokenizer, "vocab_size": vocab, "dtype": np.dtype(dtype).name,
            "train_tokens": len(tokens) - n_val, "val_tokens": n_val,
            "sources": [os.fspath(p) for p in texts]}
    eot = end_of_text(tokenizer)
    if eot is not None:
        meta["eot"] = eot
    atomic_write_bytes(os.path.join(out, "meta.json"), json.dumps(meta, indent=1).encode())
    return meta
