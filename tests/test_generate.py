"""`engine.generate` in one process: greedy equals `build_sequential`'s greedy loop token for
token (with and without the key/value cache, cropping past the positions), sampling is
repeatable and restricted as asked, `eos` stops a prompt, bad arguments are named; a
random-weights Llama and GPT-2 generate what `transformers.generate` does; each key/value
cache is allocated once at the call's positions, and the host reads the tokens once a call
(once a token only for an `eos`)."""

from __future__ import annotations

import pytest
import torch

import pipeflow as pf
from pipeflow.models import GPTConfig, gpt_layers, gpt_loss
from pipeflow.runtime import kv_cache
from pipeflow.runtime.generate import Decoding, Request, prompt_generator, sample_next

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def random_state(model: torch.nn.Module, seed: int = 1, std: float = 0.3) -> dict:
    """Weights far from the initialisation (which repeats the last token): varied text."""
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=gen) * std for k, v in model.state_dict().items()}


def gpt_model(seq_len: int = 24):
    """A small GPT's layers, random weights for them and `build_sequential` holding them."""
    cfg = GPTConfig(n_layers=2, d_model=32, n_heads=2, seq_len=seq_len, vocab_size=40,
                    tie_embeddings=False)
    layers = gpt_layers(cfg)
    ref = pf.build_sequential(layers, seed=0).eval()
    state = random_state(ref)
    ref.load_state_dict(state)
    return layers, state, ref


def gpt_engine(seq_len: int = 24, comm=None, **config):
    layers, state, ref = gpt_model(seq_len)
    engine = pf.Engine(layers, gpt_loss, sgd, pf.Config(**config), comm=comm)
    engine.load_state_dict(state)
    return engine, ref


class Caches:
    """The key/value caches made while it is entered (`KeyValues`, which the GPT's blocks
    and the HF blocks' caches both keep): each one's keys buffer shape, whole."""

    def __enter__(self) -> "Caches":
        self.shapes: list[tuple[int, ...]] = []
        real = self.real = kv_cache.KeyValues.extend

        def extend(kv, keys, values):
            new = kv.keys is None
            out = real(kv, keys, values)
            if new:
                self.shapes.append(tuple(kv.keys.shape))
            return out
        kv_cache.KeyValues.extend = extend
        return self

    def __exit__(self, *exc) -> None:
        kv_cache.KeyValues.extend = self.real


def greedy_reference(model, prompt, n, window=None):
    """The plainest greedy loop: the whole (cropped) sequence through the model each step."""
    ids, out = list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids[-window:] if window else ids]))
        out.append(int(logits[0, -1].argmax()))
        ids.append(out[-1])
    return out


@pytest.mark.parametrize("use_cache", [None, True, False])
def test_greedy_equals_build_sequential(use_cache):
    engine, ref = gpt_engine()
    expected = [greedy_reference(ref, p, 12) for p in PROMPTS]
    assert len({t for e in expected for t in e}) > 3             # varied text, not a repeat
    assert engine.generate(PROMPTS, 12, use_cache=use_cache) == expected
    engine.close()


def test_past_the_positions_the_context_is_cropped_as_nanogpt_does():
    engine, ref = gpt_engine(seq_len=8)
    expected = [greedy_reference(ref, p, 14, window=8) for p in PROMPTS]
    assert engine.generate(PROMPTS, 14) == expected          # None: falls back, crops
    with pytest.raises(pf.ConfigError, match="need 18 positions, the model has 8"):
        engine.generate(PROMPTS, 14, use_cache=True)
    engine.close()


def test_sampling_is_repeatable_and_the_same_with_and_without_cache():
    engine, _ = gpt_engine()
    args = dict(temperature=0.8, top_k=8, top_p=0.9, seed=5)
    a = engine.generate(PROMPTS, 10, **args)
    assert a == engine.generate(PROMPTS, 10, use_cache=False, **args)
    assert a != engine.generate(PROMPTS, 10, **{**args, "seed": 6})
    # A prompt's tokens do not depend on the prompts after it (its own random stream).
    assert engine.generate(PROMPTS[:2], 10, **args) == a[:2]
    engine.close()


def test_eos_stops_a_prompt_and_is_kept():
    engine, ref = gpt_engine()
    full = [greedy_reference(ref, p, 10) for p in PROMPTS]
    stop = full[0][3]
    got = engine.generate(PROMPTS, 10, eos=stop)
    for want, have in zip(full, got):
        cut = want.index(stop) + 1 if stop in want else len(want)
        assert have == want[:cut]
    engine.close()


def test_top_k_one_is_greedy_and_top_p_keeps_the_nucleus():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    gen = prompt_generator(0, 0)
    k1 = Request.make([[1]], 1, temperature=5.0, top_k=1)
    assert {sample_next(logits, k1, gen) for _ in range(50)} == {1}
    # Probabilities at temperature 1: about .02, .46, .06, .42: top_p 0.5 keeps tokens 1, 3.
    nucleus = Request.make([[1]], 1, temperature=1.0, top_p=0.5)
    assert {sample_next(logits, nucleus, gen) for _ in range(200)} == {1, 3}
    anything = Request.make([[1]], 1, temperature=1.0)
    assert {sample_next(logits, anything, gen) for _ in range(400)} == {0, 1, 2, 3}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_a_temperature_samples_from_softmax_of_the_logits_divided_by_it(temperature):
    # The rule a user sets `temperature` by: below 1 sharper than the model, above 1 flatter.
    # Each token's frequency over 4000 draws within 4.5 standard deviations of
    # softmax(logits / T) (multiplying instead: 0.5 as hot as 2.0, off by 10 and more).
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    gen, n = prompt_generator(7, 0), 4000
    request = Request.make([[1]], 1, temperature=temperature)
    counts = torch.bincount(torch.tensor([sample_next(logits, request, gen) for _ in range(n)]),
                            minlength=len(logits)).double()
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((counts / n - expected).abs() <= 4.5 * sigma + 1e-3).all(), \
        f"at T={temperature}: drew {(counts / n).tolist()}, expected {expected.tolist()}"


@pytest.mark.parametrize("kwargs,match", [
    (dict(prompt_ids=[]), "prompt_ids: expected token ids"),
    (dict(prompt_ids=[[1], []]), "prompt 1 must be a non-empty list"),
    (dict(prompt_ids=[[1, -2]]), "prompt 0 must be a non-empty list of token ids"),
    (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
    (dict(temperature=-0.5), "temperature must be a number >= 0"),
    (dict(top_k=0), "top_k must be None or an integer >= 1"),
    (dict(top_p=1.5), r"top_p must be None or a number in \(0, 1\]"),
    (dict(eos="x"), "eos must be None, a token id"),
])
def test_bad_arguments_are_named(kwargs, match):
    engine, _ = gpt_engine()
    args = {"prompt_ids": [[1, 2]], "max_new_tokens": 3, **kwargs}
    with pytest.raises(pf.ConfigError, match=match):
        engine.generate(**args)
    engine.close()


def test_a_model_without_decode_generates_without_cache():
    from toy import toy_layers
    layers = toy_layers(blocks=2)
    engine = pf.Engine(layers, lambda o, t: o.sum(), sgd, pf.Config())
    with pytest.raises(pf.ConfigError, match=r"layer 0 \(\w+\).* no decode"):
        engine.generate([[1]], 2, use_cache=True)
    engine.close()


# -- Hugging Face families against transformers' own generate ------------------------------

def _hf_families():
    pytest.importorskip("transformers")
    from pipeflow.models import hf
    return hf.supported_model_types()


def _hf_pair(kind: str):
    from test_hf import hf_model, make_config
    from pipeflow.models import hf
    config = make_config(kind, initializer_range=0.3)    # wide weights: varied greedy text
    model = hf_model(config).eval()
    engine = pf.Engine(hf.causal_lm_layers(config), gpt_loss, sgd, pf.Config())
    engine.load_state_dict(hf.from_hf_state_dict(model.state_dict(), config))
    return engine, model


def _transformers_greedy(model, prompts, n):
    out = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0, eos_token_id=None)
        out.append(ids[0, len(prompt):].tolist())
    return out


@pytest.mark.parametrize("kind,use_cache", [*((k, True) for k in _hf_families()),
                                            ("llama", False), ("gpt2", False)])
def test_hf_greedy_equals_transformers_generate(kind, use_cache):
    """Every family's key/value cache (`DecoderLayer.decode`), and the recomputing path."""
    engine, model = _hf_pair(kind)
    expected = _transformers_greedy(model, PROMPTS[:2], 8)
    assert len({t for e in expected for t in e}) > 1
    assert engine.generate(PROMPTS[:2], 8, use_cache=use_cache) == expected
    engine.close()


def test_a_prompt_id_outside_the_vocabulary_names_the_vocabulary():
    """Issue 46 item 7: an id past the vocabulary gave torch's "IndexError: index out of range
    in self", the vocabulary never named."""
    engine, _ = gpt_engine()
    with pytest.raises(pf.ConfigError, match=r"generate: prompt 1 holds token id 40, outside "
                                             r"the model's vocabulary of 40 ids \(0 to 39, "
                                             r"the rows of layer 0's embedding\); encode"):
        engine.generate([[1, 2], [3, 40, 41]], 2)
    assert len(engine.generate([[1, 39]], 2)[0]) == 2          # the last id is one
    engine.close()


@pytest.mark.parametrize("temperature", [1e-320, 1e-30, 5e-324])
def test_a_tiny_temperature_samples_the_most_likely_token(temperature):
    """Issue 46 item 8: temperature = 1e-320 passed the check, then failed in sampling on an
    inf/nan probability (logits / 1e-320 overflow; softmax of inf - inf)."""
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    request = Request.make([[1]], 1, temperature=temperature)
    gen = prompt_generator(0, 0)
    assert {sample_next(logits, request, gen) for _ in range(20)} == {1}
    engine, ref = gpt_engine()
    assert engine.generate([[1, 2]], 3, temperature=temperature) == \
        engine.generate([[1, 2]], 3, temperature=0.0)
    engine.close()


# -- what the host does per token (issue 45 item 7) ----------------------------------------

class _Concatenations:
    """`torch.cat` calls from pipeflow's own files while it is entered."""

    def __enter__(self) -> "_Concatenations":
        import os
        import sys
        package = os.path.dirname(os.path.abspath(pf.__file__)) + os.sep
        self.count, real = 0, torch.cat
        self.real = real

        def cat(*args, **kwargs):
            if sys._getframe(1).f_code.co_filename.startswith(package):
                self.count += 1
            return real(*args, **kwargs)
        torch.cat = cat
        return self

    def __exit__(self, *exc) -> None:
        torch.cat = self.real


@pytest.mark.parametrize("preallocate", [True, False], ids=["preallocated", "concatenated"])
def test_each_cache_is_allocated_once_at_the_calls_positions(preallocate, monkeypatch):
    """A key/value buffer per prompt and block, of the prompt's positions for the call,
    written in place: no `torch.cat` a token (the old path, kept for the benchmark, grows by
    one a token and layer)."""
    monkeypatch.setattr(Decoding, "preallocate", preallocate)
    engine, ref = gpt_engine()
    with Caches() as caches, _Concatenations() as cats:
        got = engine.generate(PROMPTS, 12)
    assert got == [greedy_reference(ref, p, 12) for p in PROMPTS]
    extra = 11 if preallocate else 0          # positions held beyond the prompt's at first
    assert sorted(caches.shapes) == sorted((1, 2, len(p) + extra, 16) for p in PROMPTS
                                           for _block in range(2))
    # Concatenated: keys and values, of 2 blocks, for each of 11 tokens after the prompt.
    assert cats.count == (0 if preallocate else 2 * 2 * 11 * len(PROMPTS))
    engine.close()


def test_a_cache_refuses_positions_past_its_allocation():
    kv = kv_cache.KeyValues(4)
    k = torch.ones(1, 2, 3, 8)
    keys, _ = kv.extend(k, k)
    assert keys.shape == (1, 2, 3, 8) and kv.keys.shape == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="3 positions held and 3 more asked, past the 4"):
        kv.extend(k, k)


def test_one_process_reads_the_device_once_a_call_and_a_token_only_for_an_eos():
    """Greedy tokens stay on the device until the call ends (one read of them all); an eos
    that may stop a prompt needs each token's value (one read a token)."""
    from test_data_parallel_mpi import _HostSyncs
    engine, ref = gpt_engine()
    never = next(t for t in range(40) if all(t not in greedy_reference(ref, p, 12)
                                             for p in PROMPTS))
    reads = {}
    for eos in (None, never):
        for n in (4, 12):
            with _HostSyncs() as syncs:
                engine.generate(PROMPTS, n, eos=eos)
            reads[eos, n] = syncs.count
    assert reads[None, 4] == reads[None, 12] == 1, reads
    assert reads[never, 12] - reads[never, 4] == 8 * len(PROMPTS), reads
    engine.close()
