"""Any structure between stages, side inputs, frozen parameters, ragged shapes: each trains
exactly like the one-process model (SGD, so a gradient of the wrong size shows).

Run under `mpirun -n 2` (and -n 4, as two 2-stage pipelines side by side) with `--with-mpi`.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipeflow as pf
from pipeflow.tree import tensors as tree_tensors

from toy import pair, sgd
from toy import allgather, bcast

VOCAB, WIDTH, SEQ, BATCH, M = 11, 6, 7, 8, 4


class Embed(nn.Module):
    """Emits the activation in one of several structures."""

    def __init__(self, form: str, frozen: bool = False) -> None:
        super().__init__()
        self.form = form
        self.emb = nn.Embedding(VOCAB, WIDTH)
        if frozen:
            self.emb.weight.requires_grad_(False)

    def forward(self, tokens):
        h = self.emb(tokens)
        if self.form == "int-first":
            return tokens, h
        if self.form == "dict":
            return {"tokens": tokens, "h": h, "nothing": None, "k": 3}
        if self.form == "mask":           # a float mask from constants: it needs no gradient
            return h, (tokens % 3 != 0).to(h.dtype)
        if self.form == "ragged":         # trimmed to the micro-batch's longest non-pad row
            length = int((tokens != 0).sum(1).max())
            return h[:, :max(length, 1)]
        return h


def _unpack(form: str, x):
    if form == "int-first":
        tokens, h = x
        return h, (tokens % 3 != 0).unsqueeze(-1).to(h.dtype)
    if form == "dict":
        assert x["nothing"] is None and x["k"] == 3
        return x["h"], (x["tokens"] % 3 != 0).unsqueeze(-1).to(x["h"].dtype)
    if form == "mask":
        return x[0], x[1].unsqueeze(-1)
    return x, torch.ones_like(x[..., :1])


def _pack(form: str, x, h):
    if form == "int-first":
        return x[0], h
    if form == "dict":
        return {**x, "h": h}
    if form == "mask":
        return h, x[1]
    return h


class Block(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, *, attention_mask=None):
        h, keep = _unpack(self.form, x)
        if attention_mask is not None:
            keep = keep * attention_mask[:, :h.shape[1]].unsqueeze(-1).to(h.dtype)
        return _pack(self.form, x, h + torch.tanh(self.lin(h)) * keep)


class Head(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, x):
        return self.out(_unpack(self.form, x)[0])


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1),
                                       targets[:, :logits.shape[1]].flatten())


def layers_for(form: str, frozen: bool = False) -> list[pf.LayerSpec]:
    return [pf.LayerSpec(Embed, form, frozen), pf.LayerSpec(Block, form),
            pf.LayerSpec(Block, form), pf.LayerSpec(Head, form)]


def data(steps: int = 3, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        lengths = torch.randint(1, SEQ + 1, (BATCH,), generator=g)
        x[torch.arange(SEQ)[None, :] >= lengths[:, None]] = 0        # right padding
        out.append((x, torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
                    (x != 0).long()))
    return out


def reference(layers, batches, side: bool = False):
    """One process, micro-batch by micro-batch (the ragged trim is per micro-batch), the
    gradient summed as loss / m: the engine's objective."""
    model = pf.build_sequential(layers, 0)
    opt = sgd([p for p in model.parameters() if p.requires_grad])
    losses = []
    for x, y, mask in batches:
        opt.zero_grad()
        total = 0.0
        for xs, ys, ms in zip(x.chunk(M), y.chunk(M), mask.chunk(M)):
            h = xs
            for layer in model:
                h = layer(h, attention_mask=ms) if side and isinstance(layer, Block) \
                    else layer(h)
            loss = loss_fn(h, ys) / M
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return model, losses


def _check(engine, comm, model, losses, ref_losses):
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    full = engine.gather_state_dict()
    if comm.rank == 0:
        ref = model.state_dict()
        assert list(full) == list(ref)
        for k, v in ref.items():
            assert torch.allclose(full[k], v, rtol=1e-5, atol=1e-6), k


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("form", ["int-first", "dict", "mask", "ragged", "plain"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_any_structure_between_stages_trains_like_one_process(form, schedule):
    comm = pair()
    layers = layers_for(form)
    engine = pf.Engine(layers, loss_fn, sgd,
                       pf.Config(pipeline=2, microbatches=M, schedule=schedule), comm=comm)
    batches = data()
    losses = [engine.train_step(x, y) for x, y, _ in batches]
    model, ref_losses = reference(layers, batches)
    _check(engine, comm, model, losses, ref_losses)
    # The first stage's parameters moved: its gradients were paired with the right outputs.
    if engine.stage.index == 0:
        start = pf.build_sequential(layers, 0).state_dict()["0.emb.weight"]
        assert not torch.allclose(engine.stage.module.state_dict()["0.emb.weight"], start)
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_a_float_mask_made_without_grad_crosses_forward_only():
    comm = pair()
    engine = pf.Engine(layers_for("mask"), loss_fn, sgd, pf.Config(pipeline=2, microbatches=M),
                       comm=comm)
    x, y, _ = data(1)[0]
    engine.train_step(x, y)
    sent = allgather(comm, engine.stage.pipe_comm.bytes_sent)
    per_mb = (BATCH // M) * SEQ
    # Forward: hidden and mask; backward: the hidden's gradient only, never the mask's.
    assert sent[0] == M * per_mb * (WIDTH + 1) * 4
    assert sent[1] == M * per_mb * WIDTH * 4
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_side_inputs_reach_every_stage_and_never_cross():
    comm = pair()
    layers = layers_for("plain")
    engine = pf.Engine(layers, loss_fn, sgd, pf.Config(pipeline=2, microbatches=M), comm=comm)
    batches = data()
    losses = [engine.train_step(x, y, attention_mask=mask) for x, y, mask in batches]
    model, ref_losses = reference(layers, batches, side=True)
    _check(engine, comm, model, losses, ref_losses)
    # Without the mask the model is a different one: the side input did something.
    _, plain_losses = reference(layers, batches, side=False)
    assert losses[1:] != pytest.approx(plain_losses[1:], rel=1e-5)
    # Activations only crossed: hidden states, no mask.
    assert allgather(comm, engine.stage.pipe_comm.bytes_sent)[0] == \
        3 * M * (BATCH // M) * SEQ * WIDTH * 4
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_frozen_parameters_stay_put_and_save_and_gather(tmp_path_factory):
    comm = pair()
    layers = layers_for("plain", frozen=True)
    engine = pf.Engine(layers, loss_fn, sgd,
                       pf.Config(pipeline=2, microbatches=M, precision="bf16", clip=1.0),
                       comm=comm)
    batches = data()
    for x, y, _ in batches:
        engine.train_step(x, y)
    full = engine.gather_state_dict()
    if comm.rank == 0:
        start = pf.build_sequential(layers, 0).state_dict()
        assert torch.equal(full["0.emb.weight"], start["0.emb.weight"])   # exact, fp32
        assert not torch.equal(full["1.lin.weight"], start["1.lin.weight"])
    folder = bcast(comm, str(tmp_path_factory.mktemp("frozen")) if comm.rank == 0 else None)
    engine.save(folder)
    fresh = pf.Engine(layers, loss_fn, sgd,
                      pf.Config(pipeline=2, microbatches=M, precision="bf16", clip=1.0),
                      comm=comm)
    fresh.load(folder)
    again = fresh.gather_state_dict()
    if comm.rank == 0:
        assert all(torch.equal(full[k], again[k]) for k in full)
    engine.close()
    fresh.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_load_state_dict_and_outputs_from_eval():
    comm = pair()
    layers = layers_for("dict")
    engine = pf.Engine(layers, loss_fn, sgd, pf.Config(pipeline=2, microbatches=M), comm=comm)
    other = pf.build_sequential(layers, seed=7)
    engine.load_state_dict(other.state_dict())
    x, y, _ = data(1)[0]
    logits = engine.eval_step(x)                          # no targets: outputs only
    loss, again = engine.eval_step(x, y, return_outputs=True)
    expected = other(x)
    assert loss == pytest.approx(loss_fn(expected, y).item(), rel=1e-6)
    if comm.rank == 0:
        assert torch.allclose(logits, expected, atol=1e-6)
        assert torch.equal(logits, again)
    else:
        assert logits is None and again is None
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_token_count_normalisation_equals_the_one_process_token_mean():
    comm = pair()
    layers = layers_for("plain")

    def summed(logits, targets):
        t = targets[:, :logits.shape[1]].flatten()
        return nn.functional.cross_entropy(logits.flatten(0, 1), t, ignore_index=-100,
                                           reduction="sum")

    engine = pf.Engine(layers, summed, sgd, pf.Config(pipeline=2, microbatches=M), comm=comm,
                       count_items=lambda t: (t != -100).sum())
    batches = data()
    model = pf.build_sequential(layers, 0)
    opt = sgd(model.parameters())
    for x, y, mask in batches:
        y = y.masked_fill(mask == 0, -100)     # padding is ignored: micro-batches differ
        loss = engine.train_step(x, y)
        ref = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(),
                                          ignore_index=-100)
        opt.zero_grad()
        ref.backward()
        opt.step()
        assert loss == pytest.approx(ref.item(), rel=1e-5)
    full = engine.gather_state_dict()
    if comm.rank == 0:
        for k, v in model.state_dict().items():
            assert torch.allclose(full[k], v, rtol=1e-5, atol=1e-6), k
    engine.close()
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("form", ["plain", "int-first", "dict"])
def test_sent_activations_are_freed_and_training_is_unchanged(form, monkeypatch):
    # Megatron-Core's deallocate_output_tensor: after its send, an activation keeps only its
    # graph in the stash. The same training either way, bit for bit.
    from pipeflow.runtime.runner import Runner
    held: list[int] = []
    original = Runner.backward

    def watching(self, act, st):
        out = st.stash[(act.mb, act.chunk)][1]
        if self.stage.index == 0:
            held.append(sum(t.untyped_storage().nbytes() for t in tree_tensors(out)
                            if t.requires_grad))
        return original(self, act, st)

    monkeypatch.setattr(Runner, "backward", watching)
    comm = pair()
    layers = layers_for(form)
    states = {}
    for free in (False, True):
        held.clear()
        engine = pf.Engine(layers, loss_fn, sgd,
                           pf.Config(pipeline=2, microbatches=M, free_sent_outputs=free),
                           comm=comm)
        for x, y, _ in data():
            engine.train_step(x, y)
        states[free] = engine.stage.module.state_dict()
        if engine.stage.index == 0:
            per_mb = (BATCH // M) * SEQ * WIDTH * 4
            assert held == ([0] * len(held) if free else [per_mb] * len(held)), held
        engine.close()
    assert all(torch.equal(states[True][k], states[False][k]) for k in states[True])
    comm.Free()
