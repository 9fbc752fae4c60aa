"""Small models for the engine's tests: cheap, deterministic, with tuples crossing stages."""

from __future__ import annotations

import torch
from torch import nn

import pipeflow as pf

VOCAB, WIDTH, SEQ = 13, 8, 5


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)

    def forward(self, tokens):
        # A tuple crosses the stage boundary: float activations and the int tokens.
        return self.emb(tokens), tokens


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        h, tokens = x
        keep = (tokens % 3 != 0).unsqueeze(-1).to(h.dtype)
        return h + self.down(torch.tanh(self.up(h))) * keep, tokens


class Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab)

    def forward(self, x):
        h, _ = x
        return self.out(self.norm(h))


class Drop(nn.Module):
    """Dropout on the activation of the toy model's (activation, tokens) pairs."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, x):
        h, tokens = x
        return self.drop(h), tokens


def dropout_layers() -> list[pf.LayerSpec]:
    """The toy model with dropout after the embedding and the first block."""
    layers = toy_layers(blocks=2)
    return [layers[0], pf.LayerSpec(Drop, 0.3), layers[1], pf.LayerSpec(Drop, 0.3),
            *layers[2:]]


def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def toy_layers(blocks: int = 5, tied: bool = False) -> list[pf.LayerSpec]:
    # Blocks of different widths give the "parameters" partition something to balance.
    layers = ([pf.LayerSpec(Embed, VOCAB, WIDTH)]
              + [pf.LayerSpec(Block, WIDTH, 4 * (i + 1)) for i in range(blocks)]
              + [pf.LayerSpec(Head, WIDTH, VOCAB)])
    if tied:   # the input embedding is the output projection, as in GPT-2
        layers[0].tie("embedding", "emb.weight")
        layers[-1].tie("embedding", "out.weight")
    return layers


def pair():
    """The world as pairs of ranks (0-1, 2-3, ...): a 2-rank test runs side by side on 4."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    return world.Split(color=world.rank // 2, key=world.rank)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def sgd(params):
    # Plain SGD: the update is the gradient itself, so a gradient of the wrong size shows
    # (AdamW's first steps are nearly lr * sign(g), blind to it).
    return torch.optim.SGD(params, lr=0.5)


def sgd_momentum(params):
    """SGD with momentum: the update remembers earlier gradients (state a resume must keep)."""
    return torch.optim.SGD(params, lr=0.3, momentum=0.9)


def batches(steps: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (batch, SEQ), generator=g),
             torch.randint(0, VOCAB, (batch, SEQ), generator=g)) for _ in range(steps)]


def train_reference(layers, data, clip: float = 0.0, seed: int = 0, optimizer=None,
                    device: str | torch.device = "cpu", criterion=None):
    """`build_sequential` trained in one process on each whole batch: the ground truth
    (`criterion`: the loss function, this file's `loss_fn` by default)."""
    model = pf.build_sequential(layers, seed).to(device)
    opt = (optimizer or adamw)(list(model.parameters()))
    losses = []
    for x, y in data:
        x, y = x.to(device), y.to(device)
        loss = (criterion or loss_fn)(model(x), y)
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return model, losses


def assert_same_parameters(state, reference_state, rtol: float = 1e-5):
    assert list(state) == list(reference_state)
    for name, ref in reference_state.items():
        diff = (state[name] - ref).abs().max().item()
        scale = ref.abs().max().item()
        assert diff <= rtol * scale, f"{name}: max |diff| {diff:.3g} > {rtol} x {scale:.3g}"


def update_of(engine, x, y) -> dict[str, torch.Tensor]:
    """What one `train_step` adds to each of this stage's fp32 masters, by parameter name."""
    before = {n: p.detach().clone() for n, p in engine.named_master_parameters()}
    engine.train_step(x, y)
    return {n: p.detach() - before[n] for n, p in engine.named_master_parameters()}


def assert_same_update(update, reference, rtol: float):
    """Each parameter's update within `rtol` of the reference's, relative to its size."""
    for name, delta in update.items():
        ref = reference[name]
        err = ((delta - ref).norm() / ref.norm()).item()
        assert err <= rtol, (f"{name}: update off by {err:.2%} of its size (tolerance "
                             f"{rtol:.0%}); |update| {delta.norm():.3g}, expected "
                             f"{ref.norm():.3g}")


def sub_world(stages: int):
    """The world in groups of `stages` ranks, one pipeline each (`mpirun -n 4` runs two
    2-stage pipelines side by side); skips the test when the world is smaller."""
    import pytest
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size < stages:
        pytest.skip(f"needs {stages} ranks")
    return world.Split(color=world.rank // stages, key=world.rank)


# The tests' own collectives (comparing ranks, sharing a folder, lining ranks up) wait by
# yielding their core, whatever the engine's wait policy: mpi4py's blocking calls spin inside
# MPI, and at 4 ranks on 2 cores three ranks spinning there slowed the rank they waited for
# 1.7x (1.2x yielding) and starved gloo's threads.
def _yielding(collective, comm, *args, **kwargs):
    from pipeflow.comm import waiting

    saved = waiting.policy()
    waiting.use("yield")
    try:
        return collective(comm, *args, **kwargs)
    finally:
        waiting.use(saved)


def allgather(comm, obj) -> list:
    """`comm.allgather(obj)`, yielding while it waits."""
    from pipeflow.comm import waiting
    return _yielding(waiting.allgather, comm, obj)


def gather(comm, obj, root: int = 0):
    """`comm.gather(obj, root=root)`, yielding while it waits."""
    from pipeflow.comm import waiting
    return _yielding(waiting.gather, comm, obj, root)


def bcast(comm, obj, root: int = 0):
    """`comm.bcast(obj, root=root)`, yielding while it waits."""
    from pipeflow.comm import waiting
    return _yielding(waiting.bcast, comm, obj, root)


def barrier(comm) -> None:
    """`comm.Barrier()`, yielding while it waits."""
    from pipeflow.comm import waiting
    waiting.sleeping_barrier(comm)


def watch_receives(engine) -> list:
    """Record, on `engine`'s pipeline communicator and runner: each receive posted ahead
    ("post", peer, tag), each probed ("probe", peer, tag), each instruction run ("run", act)."""
    runner, pipe = engine.runner, engine.stage.pipe_comm
    events: list = []
    posted_recv, probed_recv = pipe.irecv_message, pipe.recv_message

    def posted(metas, source, tag, device):
        events.append(("post", source, tag))
        return posted_recv(metas, source, tag, device)

    def probed(source, tag, known, device):
        events.append(("probe", source, tag))
        return probed_recv(source, tag, known, device)
    pipe.irecv_message, pipe.recv_message = posted, probed
    handlers = runner._handlers
    runner._handlers = {op: (lambda f: lambda r, act, st: (events.append(("run", act)),
                                                           f(r, act, st)))(f)
                        for op, f in handlers.items()}
    return events


def receives_posted_ahead(engine, events: list, one_activation_a_link: bool) -> tuple[int, int]:
    """Check a step recorded by `watch_receives`: each receive from another rank with a
    compute before it was posted before that compute and never probed; the others were
    probed. Those are the step's first receives (no compute before them) and, with
    `one_activation_a_link` (MPI, which posts for a link's last header), a second activation
    of one link between two computes. Returns (posted ahead, probed where they stand)."""
    from pipeflow import schedules as sched

    runner, pipe = engine.runner, engine.stage.pipe_comm
    program = engine.plan.programs[engine.stage.index]
    ahead = where_it_stands = 0
    for i, act in enumerate(program):
        if act.op not in sched.RECVS or runner.route(act).peer == pipe.rank:
            continue
        r = runner.route(act)
        computes = [j for j, a in enumerate(program[:i]) if a.op in sched.COMPUTE]
        window = program[computes[-1] + 1:i] if computes else []
        same_link = one_activation_a_link and act.op == sched.RECV_ACT and any(
            a.op == sched.RECV_ACT and runner.route(a).peer == r.peer
            and runner.route(a).chunk == r.chunk for a in window)
        if not computes or same_link:
            assert ("probe", r.peer, r.tag) in events, act
            where_it_stands += 1
            continue
        run_before = events.index(("run", program[computes[-1]]))
        assert events.index(("post", r.peer, r.tag)) < run_before, act
        assert ("probe", r.peer, r.tag) not in events, act
        ahead += 1
    assert sum(e[0] == "probe" for e in events) == where_it_stands
    return ahead, where_it_stands
