"""Mixed precision in one process: masters, working copies, loss scaler."""

import pytest
import torch

import pipeflow as pf
from pipeflow.runtime.precision import LossScaler

from toy import adamw, assert_same_update, batches, loss_fn, sgd, toy_layers, update_of


def test_loss_scaler_backs_off_on_overflow_and_grows_after_the_interval():
    s = LossScaler(scale=1024.0, growth=2.0, backoff=0.5, interval=3, minimum=256.0)
    s.update(overflow=True)
    assert s.scale == 512.0 and s.good_steps == 0
    s.update(True)
    s.update(True)
    assert s.scale == 256.0                 # never below the minimum
    for _ in range(2):
        s.update(False)
    assert s.scale == 256.0
    s.update(False)
    assert s.scale == 512.0 and s.good_steps == 0


@pytest.mark.parametrize("precision,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_masters_stay_fp32_and_working_weights_are_the_masters_cast_down(precision, dtype):
    engine = pf.Engine(toy_layers(), loss_fn, adamw,
                       pf.Config(microbatches=2, precision=precision, initial_loss_scale=256.0))
    for x, y in batches(3, 8):
        engine.train_step(x, y)
    for name, p in engine.stage.module.named_parameters():
        master = engine.stage.precision.master_of(p)
        assert master.dtype == torch.float32
        assert engine.stage.optimizer.state[master]["exp_avg"].dtype == torch.float32
        if "norm" in name:                       # LayerNorm is kept in fp32 by default
            assert p.dtype == torch.float32 and torch.equal(p, master)
        else:
            assert p.dtype == dtype and torch.equal(p, master.to(dtype)), name
    # The gathered state is the full-precision masters.
    state = engine.gather_state_dict()
    assert all(v.dtype == torch.float32 for k, v in state.items() if v.is_floating_point())
    engine.close()


def test_fp16_checkpoint_keeps_masters_and_loss_scale(tmp_path):
    config = pf.Config(microbatches=2, precision="fp16", initial_loss_scale=512.0,
                       loss_scale_interval=1)
    engine = pf.Engine(toy_layers(), loss_fn, adamw, config)
    engine.train_step(*batches(1, 8)[0])
    assert engine.loss_scale == 1024.0          # one good step with interval 1 grows it
    engine.save(tmp_path)
    other = pf.Engine(toy_layers(), loss_fn, adamw, config)
    other.load(tmp_path)
    assert other.loss_scale == 1024.0
    for (n, a), (_, b) in zip(engine.named_master_parameters(), other.named_master_parameters()):
        assert torch.equal(a, b), n              # fp32 values, not the fp16 working copy
    x, y = batches(1, 8, seed=3)[0]
    assert engine.train_step(x, y) == other.train_step(x, y)
    engine.close()
    other.close()


class MyRMSNorm(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class MyRotaryEmbedding(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(width) / width))

    def forward(self, x):
        return x


class NormBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = MyRMSNorm(width)
        self.rotary = MyRotaryEmbedding(width)
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.lin(self.norm(self.rotary(x)))


def test_fp32_modules_match_by_class_name_suffix_and_keep_their_buffers():
    layers = [pf.LayerSpec(NormBlock, 4)]
    engine = pf.Engine(layers, lambda out, t: (out - t).pow(2).mean(),
                       lambda ps: torch.optim.SGD(ps, lr=0.1), pf.Config(precision="bf16"))
    block = engine.stage.module.get_submodule("0")
    assert block.lin.weight.dtype == torch.bfloat16
    assert block.norm.weight.dtype == torch.float32          # "RMSNorm" suffix
    assert block.rotary.inv_freq.dtype == torch.float32      # a buffer, "RotaryEmbedding"
    reference = pf.build_sequential(layers, 0)
    assert torch.equal(block.rotary.inv_freq, reference[0].rotary.inv_freq)
    engine.close()


def test_fp16_sgd_update_at_a_large_loss_scale_is_the_fp32_update():
    # Plain SGD's update is the gradient: a loss scale not applied (or not undone) changes
    # its size 1024-fold. fp16 rounding of weights and activations (2^-11) moves it far less.
    x, y = batches(1, 16)[0]
    updates = {}
    for precision in ("fp32", "fp16"):
        engine = pf.Engine(toy_layers(), loss_fn, sgd,
                           pf.Config(microbatches=2, precision=precision,
                                     initial_loss_scale=1024.0))
        updates[precision] = update_of(engine, x, y)
        assert engine.stats.skipped_steps == 0
        assert engine.loss_scale == (1024.0 if precision == "fp16" else 1.0)
        engine.close()
    assert_same_update(updates["fp16"], updates["fp32"], rtol=0.02)


def test_fp16_clipping_uses_the_unscaled_gradient_norm():
    # The norm and the clip coefficient belong to the true gradient: computed while the
    # gradients still carry the loss scale, the norm is 1024 times too large and the clipped
    # update 1024 times too small.
    x, y = batches(1, 16)[0]
    updates, norms = {}, {}
    for precision in ("fp32", "fp16"):
        engine = pf.Engine(toy_layers(), loss_fn, sgd,
                           pf.Config(microbatches=2, precision=precision, initial_loss_scale=1024.0,
                                     clip=0.05))
        updates[precision] = update_of(engine, x, y)
        norms[precision] = engine.stats.grad_norm
        assert engine.stats.skipped_steps == 0
        engine.close()
    assert norms["fp32"] > 0.05, "the clip never bit: the test would prove nothing"
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=0.02)
    assert_same_update(updates["fp16"], updates["fp32"], rtol=0.02)


class Router(torch.nn.Module):
    """A module kept in fp32 whose weights live in its children (a gate of an MoE layer)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(width, width)
        self.inner = torch.nn.Sequential(torch.nn.Linear(width, width), MyRotaryEmbedding(width))

    def forward(self, x):
        return self.inner(self.gate(x))


class RoutedBlock(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.router = Router(width)
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return self.lin(self.router(x))


def test_fp32_modules_keep_their_children_in_fp32():
    layers = [pf.LayerSpec(RoutedBlock, 4)]
    engine = pf.Engine(layers, lambda out, t: (out - t).pow(2).mean(),
                       lambda ps: torch.optim.SGD(ps, lr=0.1),
                       pf.Config(precision="bf16", fp32_modules=["Router"]))
    block = engine.stage.module.get_submodule("0")
    reference = pf.build_sequential(layers, 0)[0]
    assert block.lin.weight.dtype == torch.bfloat16
    kept = dict(block.router.state_dict())
    assert set(kept) == {"gate.weight", "gate.bias", "inner.0.weight", "inner.0.bias",
                         "inner.1.inv_freq"}
    for name, value in reference.router.state_dict().items():
        assert kept[name].dtype == torch.float32, name          # the children too
        assert torch.equal(kept[name], value), name             # never rounded
    # And the router runs in fp32: its output is the fp32 module's, cast once.
    x = torch.randn(3, 4).bfloat16()
    with torch.no_grad():
        assert torch.equal(block.router(x), reference.router(x.float()).bfloat16())
    engine.close()
