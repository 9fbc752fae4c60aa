"""Helpers of the Hub-folder tests (`test_hf_cli.py`, `test_hf_cli_mpi.py`): a tiny saved
transformers model, a token file, a run TOML, and the trainer driven with its engine kept
open so a test can read its logits before and after training."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers

from pipeflow.train.loop import Preemption, _loop, _start
from pipeflow.train.run_config import load_run_config

VOCAB, SEQ = 128, 16


def hub_config(kind: str, layers: int = 2):
    if kind == "gpt2":     # tied embedding and head
        return transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB,
                                       n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    shape = dict(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                 max_position_embeddings=SEQ)
    if kind == "mixtral":   # per-expert tensors on disk, merged in memory
        return transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
    if kind == "gpt_neox":  # `embed_out` on disk, `lm_head` in memory
        return transformers.GPTNeoXConfig(**shape, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(**shape)


def save_hub(folder: str, kind: str, sharded: bool, layers: int = 2,
             dtype: torch.dtype = torch.float32):
    """A random transformers model saved with safetensors (sharded: many small files and
    the index), its weights in `dtype`; returns the model."""
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(hub_config(kind, layers),
                                                          attn_implementation="sdpa")
    model = model.to(dtype)
    model.save_pretrained(folder, max_shard_size="20KB" if sharded else "5GB")
    assert os.path.isfile(os.path.join(folder, "model.safetensors.index.json")) == sharded
    return model.eval()


def save_tokenizer(folder: str):
    """A small word-level tokenizer with special tokens and a chat template, saved into the
    Hub folder as `save_pretrained` writes one (tokenizer.json, tokenizer_config.json, the
    chat template); returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                                               bos_token="<s>", eos_token="</s>")
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    tok.save_pretrained(folder)
    return tok


def token_file(folder: str, n: int = 4000, eot: int | None = None) -> str:
    path = os.path.join(folder, "tokens.bin")
    rng = np.random.default_rng(0)
    np.asarray(rng.integers(1, VOCAB, n), dtype=np.uint16).tofile(path)
    if eot is not None:
        with open(os.path.join(folder, "meta.json"), "w") as f:
            json.dump({"dtype": "uint16", "vocab_size": VOCAB, "eot": eot}, f)
    return path


def run_toml(folder: str, model: str, *, pipeline: int = 1, steps: int = 3,
             train_extra: str = "", data_extra: str = "", tokens: str = "",
             engine_extra: str = "") -> str:
    path = os.path.join(folder, "run.toml")
    with open(path, "w") as f:
        f.write(f"""
[engine]
pipeline = {pipeline}
microbatches = 2
{engine_extra}
[model]
kind = "hf"
{model}
seq_len = {SEQ}
[train]
steps = {steps}
batch_size = 4
lr = 1e-2
warmup = 1
log_every = 1
eval_batches = 1
progress = false
{train_extra}
[data]
train = "{tokens or token_file(folder)}"
{data_extra}
""")
    return path


def train_keeping_engine(path: str, comm, before=None, after=None) -> list[float]:
    """`pipeflow train`'s own start and loop, with `before(engine)` called once the engine
    is built (weights loaded) and `after(engine)` once the run ended, before the close."""
    run = load_run_config(path)
    loop = _start(run, comm, lambda *a, **k: None)
    try:
        if before is not None:
            before(loop)
        with Preemption() as preemption:
            losses = _loop(loop, comm, preemption, None, None)
        if after is not None:
            after(loop)
    finally:
        loop.engine.close()
    return losses


def logits_of(loop, ids: torch.Tensor) -> torch.Tensor | None:
    """The engine's logits for `ids` (the whole batch, on rank 0; None elsewhere)."""
    engine = loop.engine
    feed = ids if engine.plan.holds_first(engine.stage.index) else None
    return engine.eval_step(feed, return_outputs=True)


def safetensors_of(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "model.safetensors"))


class CountingOpen:
    """`safetensors.safe_open`, recording every read as (key, bytes): a whole tensor
    (`get_tensor`) or a slice of one (`get_slice(key)[...]`, its bytes only)."""

    def __init__(self, real) -> None:
        self.real, self.reads = real, []

    @property
    def keys(self) -> list[str]:
        """The keys read, each once, sorted."""
        return sorted({key for key, _ in self.reads})

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.reads)

    def __call__(self, *args, **kwargs):
        counting, handle = self, self.real(*args, **kwargs)

        class Slice:
            def __init__(self, key, view):
                self.key, self.view = key, view

            def get_shape(self):
                return self.view.get_shape()

            def get_dtype(self):
                return self.view.get_dtype()

            def __getitem__(self, box):
                out = self.view[box]
                counting.reads.append((self.key, out.nbytes))
                return out

        class Handle:
            def __enter__(self):
                self.f = handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, key):
                out = self.f.get_tensor(key)
                counting.reads.append((key, out.nbytes))
                return out

            def get_slice(self, key):
                return Slice(key, self.f.get_slice(key))
        return Handle()
