"""Split backward (B then W) gives exactly one full backward's gradients, hooks included."""

import copy

import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from pipeflow.models.gpt import Block, Embedding, GPTConfig, Head, gpt_loss
from pipeflow.schedules.split_backward import backward_input, backward_weight

CFG = GPTConfig(n_layers=2, d_model=32, n_heads=4, seq_len=8)


class Residual(nn.Module):
    """x + mlp(x), with one Linear used twice: a weight reached from two depths."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.shared = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        h = x + self.shared(torch.tanh(self.a(x)))
        return self.shared(torch.relu(self.b(h))) + h


class TwoInputs(nn.Module):
    """Takes (x, mask); returns a pytree with an integer leaf and an output that no input
    reaches (a weight only an output sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.extra = nn.Parameter(torch.randn(3))

    def forward(self, x, mask):
        y = self.lin(x) * mask
        return {"y": y, "count": torch.tensor(7), "extra": self.extra * 2.0}


def _grads(module, inputs):
    return ([None if t.grad is None else t.grad.clone() for t in inputs],
            {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()})


def _full_and_split(module, make_inputs, grad_of, run=None, microbatches=1):
    """Gradients of the inputs and weights after one full backward per micro-batch, and
    after B then W per micro-batch, on two identical copies of `module`."""
    run = run or (lambda mod, ins: mod(*ins))
    split_module = copy.deepcopy(module)
    results = []
    for mod, split in ((module, False), (split_module, True)):
        torch.manual_seed(1)
        pending, ins_all = [], []
        for _ in range(microbatches):
            ins = make_inputs()
            ins_all.append(ins)
            out = run(mod, ins)
            g = grad_of(out)
            if not split:
                pairs = [(o, x) for o, x in zip(tree_leaves(out), tree_leaves(g))
                         if o.requires_grad] if g is not None else [(out, None)]
                torch.autograd.backward([o for o, _ in pairs], [x for _, x in pairs])
                continue
            got, w = backward_input(out, g, ins, mod.parameters())
            assert all(p.grad is None for p in mod.parameters())     # B leaves .grad alone
            for t, gt in zip(ins, got):
                if gt is not None:
                    t.grad = gt if t.grad is None else t.grad + gt
            pending.append(w)
        for w in pending:
            backward_weight(w)
        results.append(_grads(mod, [t for ins in ins_all for t in ins]))
    return results


def _assert_same(full, split):
    (fin, fpar), (sin, spar) = full, split
    assert len(fin) == len(sin)
    for a, b in zip(fin, sin):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert fpar.keys() == spar.keys()
    for name in fpar:
        assert (fpar[name] is None) == (spar[name] is None), name
        if fpar[name] is not None:
            torch.testing.assert_close(spar[name], fpar[name], rtol=0, atol=0, msg=name)


def _x(*shape):
    return lambda: [torch.randn(*shape, requires_grad=True)]


def _rand_like(out):
    return torch.randn_like(out)


@pytest.mark.parametrize("microbatches", [1, 3])
def test_linear_stack_b_then_w_equals_full_backward(microbatches):
    torch.manual_seed(0)
    stack = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    _assert_same(*_full_and_split(stack, _x(5, 4), _rand_like, microbatches=microbatches))


def test_residual_and_a_weight_used_twice():
    torch.manual_seed(0)
    _assert_same(*_full_and_split(Residual(), _x(5, 6), _rand_like, microbatches=2))


def test_gpt_block_and_last_stage_loss():
    torch.manual_seed(0)
    _assert_same(*_full_and_split(Block(CFG), _x(2, CFG.seq_len, CFG.d_model), _rand_like))
    # The last stage: a head and its loss, a scalar whose gradient is implicit (None).
    target = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    last = nn.Sequential(Block(CFG), Head(CFG))
    _assert_same(*_full_and_split(
        last, _x(2, CFG.seq_len, CFG.d_model), lambda out: None,
        run=lambda mod, ins: gpt_loss(mod(*ins), target) * 0.25))


def test_frozen_weights_stay_without_gradient():
    torch.manual_seed(0)
    block = Block(CFG)
    for p in list(block.parameters())[::2]:
        p.requires_grad_(False)
    full, split = _full_and_split(block, _x(2, CFG.seq_len, CFG.d_model), _rand_like)
    _assert_same(full, split)
    assert sum(g is None for g in split[1].values()) == len(list(block.parameters())[::2])


def test_an_input_without_gradient_a_pytree_output_and_a_weight_only_an_output_sees():
    torch.manual_seed(0)

    def inputs():
        return [torch.randn(5, 6, requires_grad=True), (torch.rand(5, 6) > 0.5).float()]

    def grad_of(out):
        return {"y": torch.randn_like(out["y"]), "count": None,
                "extra": torch.randn_like(out["extra"])}

    full, split = _full_and_split(TwoInputs(), inputs, grad_of, microbatches=2)
    _assert_same(full, split)
    assert split[0][1] is None and split[1]["extra"] is not None
    # An output whose gradient is None takes no part: its weight gets none.
    module = TwoInputs()
    x, mask = inputs()
    out = module(x, mask)
    _, w = backward_input(out, {"y": torch.ones(5, 6), "count": None, "extra": None},
                          [x, mask], module.parameters())
    backward_weight(w)
    assert module.extra.grad is None and module.lin.weight.grad is not None


@pytest.mark.parametrize("recompute", ["checkpoint", "pipeflow-full", "pipeflow-selective"])
def test_recomputed_forward(recompute):
    from pipeflow.runtime.recompute import stage_forward

    torch.manual_seed(0)
    blocks = nn.Sequential(Block(CFG), Block(CFG))
    if recompute == "checkpoint":
        def run(mod, ins):
            return checkpoint(mod, *ins, use_reentrant=False)
    else:
        def run(mod, ins):
            return stage_forward(list(mod), ins[0], recompute.split("-")[1])
    _assert_same(*_full_and_split(blocks, _x(2, CFG.seq_len, CFG.d_model), _rand_like,
                                  run=run, microbatches=2))


def test_first_stage_b_is_a_no_op_and_w_runs_the_whole_backward():
    torch.manual_seed(0)
    first = nn.Sequential(Embedding(CFG), Block(CFG))
    tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    out = first(tokens)
    grads, w = backward_input(out, torch.ones_like(out), [tokens], first.parameters())
    assert grads == [None] and all(p.grad is None for p in first.parameters())
    del out
    backward_weight(w)
    ref = copy.deepcopy(first)
    for p in ref.parameters():
        p.grad = None
    ref_out = ref(tokens)
    ref_out.backward(torch.ones_like(ref_out))
    for (name, p), q in zip(first.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_w_fires_post_accumulate_grad_hooks_once_per_weight_and_accumulates():
    torch.manual_seed(0)
    block = Block(CFG)
    fired = []
    for name, p in block.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    x = torch.randn(2, CFG.seq_len, CFG.d_model, requires_grad=True)
    out = block(x)
    _, w = backward_input(out, torch.ones_like(out), [x], block.parameters())
    assert fired == []
    backward_weight(w)
    assert sorted(fired) == sorted(n for n, _ in block.named_parameters())
    with pytest.raises(RuntimeError, match="W already ran"):
        backward_weight(w)


class _LiveSaved:
    """Counts the tensors autograd keeps for backward. It holds a detached alias: holding a
    saved output itself would tie it to its own node in a cycle no collector sees, and a
    retained graph (B keeps one for W) would then never be freed."""

    def __init__(self) -> None:
        self.live: set[int] = set()

    def pack(self, t):
        return _Held(t.detach(), self.live)

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda h: h.tensor)
        self._hooks.__enter__()

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _Held:
    def __init__(self, tensor, live):
        self.tensor, self.live = tensor, live
        live.add(id(self))

    def __del__(self):
        self.live.discard(id(self))


def test_graph_is_kept_for_w_and_freed_after_it():
    torch.manual_seed(0)
    blocks = nn.Sequential(Block(CFG), Block(CFG))
    saved = _LiveSaved()
    x = torch.randn(2, CFG.seq_len, CFG.d_model, requires_grad=True)
    with saved:
        out = blocks(x)
    after_forward = len(saved.live)
    _, w = backward_input(out, torch.ones_like(out), [x], blocks.parameters())
    del out                                 # the runner drops the stage's outputs after B
    assert 0 < len(saved.live) <= after_forward    # held for W
    backward_weight(w)
    assert len(saved.live) == 0             # W freed the graph
    # The same with a full backward that keeps its graph, for comparison: freed on release.
    with saved:
        out = blocks(x)
    out.backward(torch.ones_like(out), retain_graph=True)
    assert len(saved.live) == after_forward
    del out
    assert len(saved.live) == 0


def test_mismatched_gradients_and_outputs_without_gradient_are_clear():
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    out = (lin(x), lin(x))
    with pytest.raises(ValueError, match="2 output leaves but 1 gradients"):
        backward_input(out, [torch.ones(2, 3)], [x], lin.parameters())
    with torch.no_grad():
        frozen = lin(x)
    grads, w = backward_input(frozen, torch.ones(2, 3), [x], lin.parameters())
    assert grads == [None] and lin.weight.grad is None
    with pytest.raises(RuntimeError, match="no gradient to give"):
        backward_weight(w)
