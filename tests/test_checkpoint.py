"""Checkpoints on one rank: cleanup keeps what was just written, a killed save loses nothing,
parameter groups and the random state come back exactly, and seeding is per rank."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import pipeflow as pf
from pipeflow.layers import fingerprint
from pipeflow.runtime.rng import get_rng_state, rank_seed, seed_everything, set_rng_state

from toy import (adamw, assert_same_parameters, batches, dropout_layers, loss_fn, toy_layers,
                 train_reference)

HERE = os.path.dirname(os.path.abspath(__file__))


def _engine(layers=None, optimizer=adamw, **config) -> pf.Engine:
    return pf.Engine(layers or toy_layers(), loss_fn, optimizer,
                     pf.Config(microbatches=2, **config))


def _steps(directory) -> list[str]:
    return sorted(d for d in os.listdir(directory) if d.startswith("step-"))


def test_a_fresh_run_into_a_folder_with_higher_steps_keeps_what_it_writes(tmp_path):
    data = batches(3, 4)
    old = _engine()
    for x, y in data:
        old.train_step(x, y)
        old.save(tmp_path)
    assert _steps(tmp_path) == ["step-00000002", "step-00000003"]
    # A second run from step 0 into the same folder: each save must survive its own cleanup.
    new = _engine()
    for step, (x, y) in enumerate(data[:2], start=1):
        new.train_step(x, y)
        folder = new.save(tmp_path)
        assert os.path.isdir(folder)
        assert (tmp_path / "latest").read_text() == f"step-{step:08d}"
    # The two most recently written stay, whatever their step numbers.
    assert _steps(tmp_path) == ["step-00000001", "step-00000002"]
    resumed = _engine()
    resumed.load(tmp_path)
    assert resumed.stats.step == 2
    reference, _ = train_reference(toy_layers(), data[:2])
    assert_same_parameters(resumed.gather_state_dict(), reference.state_dict())
    for engine in (old, new, resumed):
        engine.close()


def test_saving_a_step_again_and_leftovers_of_interrupted_saves(tmp_path):
    engine = _engine()
    engine.train_step(*batches(1, 4)[0])
    engine.save(tmp_path)
    # What a save killed before its engine.json leaves behind: removed by the next save.
    (tmp_path / "step-00000007").mkdir()
    (tmp_path / "step-00000007" / "layer-00000.pt").write_bytes(b"half")
    engine.load(tmp_path)
    folder = engine.save(tmp_path)                  # the same step once more
    assert _steps(tmp_path) == ["step-00000001"]
    meta = json.loads((tmp_path / "step-00000001" / "engine.json").read_text())
    assert meta["sequence"] == 1 and meta["grid"] == {"pipeline": 1, "data": 1}
    assert not [d for d in os.listdir(tmp_path) if d.startswith(".")]   # no staging left
    assert sorted(meta["checksums"]) == sorted(set(os.listdir(folder)) - {"engine.json"})
    engine.load(tmp_path)
    assert engine.stats.step == 1
    engine.close()


KILLED_SAVE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {here!r})
    import pipeflow as pf
    import pipeflow.runtime.checkpoint as ckpt
    from toy import adamw, batches, loss_fn, toy_layers
    engine = pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(microbatches=2))
    x, y = batches(2, 4)[0]
    engine.train_step(x, y)
    engine.save({folder!r})
    engine.train_step(*batches(2, 4)[1])
    writes = []
    real = ckpt.atomic_write_bytes
    def dying(path, data, **kwargs):
        writes.append(path)
        if len(writes) == 3:      # the third file of the second save: the process dies
            os._exit(9)
        real(path, data, **kwargs)
    ckpt.atomic_write_bytes = dying
    engine.save({folder!r})
    print("the save finished")
""")


def _run_script(template: str, folder) -> subprocess.CompletedProcess:
    """`template` (formatted with the tests' folder and `folder`) in a fresh process, outside
    any MPI launch."""
    script = template.format(here=HERE, folder=str(folder))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_"))}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=110, env=env)


@pytest.mark.timeout(120)
def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_usable(tmp_path):
    proc = _run_script(KILLED_SAVE, tmp_path)
    assert proc.returncode == 9, proc.stdout + proc.stderr
    assert (tmp_path / "latest").read_text() == "step-00000001"
    assert not (tmp_path / "step-00000002").exists()              # never published
    staged, = [d for d in os.listdir(tmp_path) if d.startswith(".step-00000002.tmp-")]
    assert len(os.listdir(tmp_path / staged)) == 2               # two shards, no engine.json
    engine = _engine()
    engine.load(tmp_path)
    assert engine.stats.step == 1
    reference, _ = train_reference(toy_layers(), batches(2, 4)[:1])
    assert_same_parameters(engine.gather_state_dict(), reference.state_dict())
    engine.close()


def _two_groups(params):
    # Matrices decay, vectors do not (nanoGPT's rule), at different learning rates.
    matrices = [p for p in params if p.dim() >= 2]
    vectors = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": matrices, "lr": 1e-2, "weight_decay": 0.1},
                              {"params": vectors, "lr": 3e-3, "weight_decay": 0.0}])


def test_parameter_groups_and_their_changed_settings_are_restored(tmp_path):
    data = batches(3, 4)
    engine = _engine(optimizer=_two_groups)
    engine.train_step(*data[0])
    for group in engine.stage.optimizer.param_groups:     # what a learning-rate schedule does
        group["lr"] *= 0.5
    engine.save(tmp_path)
    resumed = _engine(optimizer=_two_groups)
    resumed.load(tmp_path)
    assert [(g["lr"], g["weight_decay"]) for g in resumed.stage.optimizer.param_groups] == \
        [(5e-3, 0.1), (1.5e-3, 0.0)]
    for x, y in data[1:]:
        engine.train_step(x, y)
        resumed.train_step(x, y)
    for (name, a), (_, b) in zip(engine.named_master_parameters(),
                                 resumed.named_master_parameters()):
        assert torch.equal(a, b), name
    engine.close()
    resumed.close()


def _masters(engine):
    return {n: p.detach().clone() for n, p in engine.named_master_parameters()}


def test_a_dropout_run_resumes_bit_identically(tmp_path):
    data = batches(3, 4)
    seed_everything(0, 0)
    engine = _engine(dropout_layers())
    for x, y in data[:2]:
        engine.train_step(x, y)
    engine.save(tmp_path)
    engine.train_step(*data[2])
    expected = _masters(engine)
    resumed = _engine(dropout_layers())
    resumed.load(tmp_path)
    resumed.train_step(*data[2])
    assert all(torch.equal(expected[n], p) for n, p in _masters(resumed).items())
    # The control: the same resume on another random state draws other masks.
    other = _engine(dropout_layers())
    other.load(tmp_path)
    torch.manual_seed(1234)
    other.train_step(*data[2])
    assert not all(torch.equal(expected[n], p) for n, p in _masters(other).items())
    for e in (engine, resumed, other):
        e.close()


def _draws():
    return torch.rand(4), random.random(), np.random.rand()


def test_the_random_state_round_trips_through_a_weights_only_file(tmp_path):
    seed_everything(3, 1)
    _draws()
    torch.save(get_rng_state("cpu"), tmp_path / "rng.pt")
    expected = _draws()
    _draws()
    assert set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), "cpu") == []
    got = _draws()
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_seed_everything_is_reproducible_and_differs_per_rank_and_seed():
    assert len({rank_seed(s, r) for s in range(4) for r in range(64)}) == 4 * 64
    seed_everything(7, 0)
    a = _draws()
    seed_everything(7, 0)
    again = _draws()
    assert torch.equal(a[0], again[0]) and a[1:] == again[1:]
    for seed, rank in [(7, 1), (8, 0)]:
        seed_everything(seed, rank)
        other = _draws()
        assert not torch.equal(a[0], other[0]) and a[1] != other[1] and a[2] != other[2]


def test_a_checkpoint_of_format_1_still_loads_without_the_random_state(tmp_path):
    engine = _engine()
    engine.train_step(*batches(1, 4)[0])
    folder = engine.save(tmp_path)
    meta = json.loads(open(os.path.join(folder, "engine.json")).read())
    for key in ("checksums", "sequence", "grid", "model", "sha256"):   # what format 1 lacks
        del meta[key]
    meta["format"] = 1
    with open(os.path.join(folder, "engine.json"), "w") as f:
        json.dump(meta, f)
    other = _engine()
    with pytest.warns(RuntimeWarning, match="the random state is not restored"):
        other.load(tmp_path)
    assert other.stats.step == 1
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(engine.named_master_parameters(),
                                                           other.named_master_parameters()))
    engine.close()
    other.close()


def _failing_writes(monkeypatch, error: int, which: str = "layer-") -> None:
    """Every write of a file whose name starts with `which` fails with OS error `error`."""
    import pipeflow.runtime.checkpoint as ckpt
    real = ckpt.atomic_write_bytes

    def failing(path, data, **kwargs):
        if os.path.basename(path).startswith(which):
            raise OSError(error, os.strerror(error), path)
        real(path, data, **kwargs)

    monkeypatch.setattr(ckpt, "atomic_write_bytes", failing)


@pytest.mark.parametrize("again", [False, True], ids=["next-step", "same-step-again"])
def test_a_failed_save_keeps_the_previous_checkpoint_loadable(tmp_path, monkeypatch, again):
    # A full disk mid-save: the save raises naming the OS error, and the checkpoint before it
    # (even one of the very step being saved again) still loads, unchanged.
    engine = _engine()
    x, y = batches(2, 4)[0]
    engine.train_step(x, y)
    engine.save(tmp_path)
    saved = _masters(engine)
    if not again:
        engine.train_step(*batches(2, 4)[1])
    with monkeypatch.context() as patch:
        _failing_writes(patch, errno.ENOSPC)
        with pytest.raises(pf.CheckpointError, match=r"checkpoint of step \d was not saved: "
                           r".*No space left on device.*the previous checkpoint "
                           r"'step-00000001' is untouched"):
            engine.save(tmp_path)
    assert (tmp_path / "latest").read_text() == "step-00000001"
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000001"]   # nothing half-written
    other = _engine()
    other.load(tmp_path)
    assert other.stats.step == 1
    assert all(torch.equal(a, b) for a, b in zip(_masters(other).values(), saved.values()))
    # The engine that failed to save goes on and saves once there is room again.
    assert engine.save(tmp_path).endswith(f"step-{engine.stats.step:08d}")
    for e in (engine, other):
        e.close()



def test_a_shard_that_reached_the_disk_short_fails_the_save(tmp_path, monkeypatch):
    # A write that returned but left the file short (a network filesystem or a quota that
    # reports late): the save compares each file's size with what was written and fails,
    # naming the file, instead of publishing a checkpoint the next load refuses.
    import pipeflow.runtime.checkpoint as ckpt
    engine = _engine()
    engine.train_step(*batches(2, 4)[0])
    engine.save(tmp_path)
    saved = _masters(engine)
    engine.train_step(*batches(2, 4)[1])
    real = ckpt.atomic_write_bytes

    def short(path, data, **kwargs):
        real(path, data[:-7] if os.path.basename(path) == "layer-00001.pt" else data, **kwargs)

    monkeypatch.setattr(ckpt, "atomic_write_bytes", short)
    with pytest.raises(pf.CheckpointError, match=r"checkpoint of step 2 was not saved: "
                       r"'.*layer-00001.pt' holds \d+ bytes after the save, \d+ were written"
                       r".*the previous checkpoint 'step-00000001' is untouched"):
        engine.save(tmp_path)
    monkeypatch.undo()
    _assert_step_1_still_loads(tmp_path, saved, engine)

FILE_LIMIT_SAVE = textwrap.dedent("""
    import os, resource, signal, sys
    sys.path.insert(0, {here!r})
    import pipeflow as pf
    from toy import adamw, batches, loss_fn, toy_layers
    engine = pf.Engine(toy_layers(), loss_fn, adamw, pf.Config(microbatches=2))
    engine.train_step(*batches(2, 4)[0])
    engine.save({folder!r})
    engine.train_step(*batches(2, 4)[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # writes past the limit: EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
    try:
        engine.save({folder!r})
    except pf.CheckpointError as exc:
        print("refused:", exc)
""")


@pytest.mark.timeout(120)
def test_a_save_past_the_file_size_limit_fails_and_the_previous_one_loads(tmp_path):
    # A real OS error, not a patched one: `ulimit -f 1` (1 KiB) makes every shard too large.
    proc = _run_script(FILE_LIMIT_SAVE, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "refused: the checkpoint of step 2 was not saved" in proc.stdout, proc.stdout
    assert "File too large" in proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-00000001"]
    engine = _engine()
    engine.load(tmp_path)
    assert engine.stats.step == 1
    engine.close()


def test_an_edited_engine_json_is_refused(tmp_path):
    # One changed value (the step 1 -> 2) in a file without a checksum would resume at the
    # wrong step; engine.json carries its own sha256.
    engine = _engine()
    engine.train_step(*batches(1, 4)[0])
    folder = engine.save(tmp_path)
    path = os.path.join(folder, "engine.json")
    text = open(path).read()
    assert '"step": 1' in text
    with open(path, "w") as f:
        f.write(text.replace('"step": 1', '"step": 2'))
    with pytest.raises(pf.CheckpointError, match="engine.json.*does not match its sha256"):
        _engine().load(tmp_path)
    engine.close()


def test_a_checkpoint_of_another_model_with_the_same_shapes_is_refused(tmp_path):
    # Same layer count and parameter shapes, another constructor argument: the weights would
    # load without a word and mean something else.
    engine = pf.Engine([pf.LayerSpec(Scaled, 4, 2.0)], lambda out, t: (out - t).pow(2).mean(),
                       lambda ps: torch.optim.SGD(ps, lr=0.1), pf.Config())
    engine.save(tmp_path)
    other = pf.Engine([pf.LayerSpec(Scaled, 4, 3.0)], lambda out, t: (out - t).pow(2).mean(),
                      lambda ps: torch.optim.SGD(ps, lr=0.1), pf.Config())
    with pytest.raises(pf.CheckpointError, match=r"of another model: its layer 0 is "
                       r".*Scaled\(4, 2.0\), this model's is .*Scaled\(4, 3.0\)"):
        other.load(tmp_path)
    for e in (engine, other):
        e.close()


class Scaled(torch.nn.Module):
    def __init__(self, width: int, scale: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.scale = scale

    def forward(self, x):
        return self.lin(x) * self.scale


def test_a_step_saved_again_that_fails_between_its_renames_keeps_the_old_copy(tmp_path,
                                                                               monkeypatch):
    # The old copy is moved aside only once the new one is whole; if publishing the new one
    # then fails, the old copy goes back under its name and loads.
    engine = _engine()
    engine.train_step(*batches(1, 4)[0])
    engine.save(tmp_path)
    saved = _masters(engine)
    real = os.replace

    def failing(src, dst):
        if os.path.basename(os.fspath(src)).startswith(".step-00000001.tmp-"):  # publish
            raise OSError(errno.EIO, "I/O error", os.fspath(src))
        real(src, dst)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(pf.CheckpointError, match="step 1 was not saved: .*I/O error"):
        engine.save(tmp_path)
    monkeypatch.setattr(os, "replace", real)
    _assert_step_1_still_loads(tmp_path, saved, engine)


@pytest.mark.parametrize("disk", ["slow", "as assumed"])
def test_the_watchdog_allows_a_long_save_and_load_and_still_watches_them(tmp_path, monkeypatch,
                                                                         disk):
    # A checkpoint of many GB a rank is one long stretch of I/O (and of waiting on the ranks
    # that write): `watchdog_s`, sized for a step, must not abort it mid-save. Each of the 4
    # files here takes 0.4 s against a watchdog of 1 s; the allowance is the bytes at the
    # assumed disk rate, so with the rate set far above the real one the watchdog fires as
    # before.
    from pipeflow import engine as pf_engine
    from pipeflow.runtime import checkpoint, failure
    expired = []
    monkeypatch.setattr(failure.Watchdog, "_expire", lambda self, idle: expired.append(idle))
    real_write, real_read = checkpoint._write, checkpoint._read

    def slow_write(*args):
        time.sleep(0.4)
        return real_write(*args)

    def slow_read(*args):
        time.sleep(0.4)
        return real_read(*args)

    monkeypatch.setattr(checkpoint, "_write", slow_write)
    monkeypatch.setattr(checkpoint, "_read", slow_read)
    monkeypatch.setattr(pf_engine, "CHECKPOINT_IO_BYTES_S", 1e3 if disk == "slow" else 1e15)
    engine = _engine(toy_layers(blocks=1), watchdog_s=1.0)
    engine.train_step(*batches(1, 4)[0])
    expired.clear()
    engine.save(tmp_path)
    engine.load(tmp_path)
    engine.close()
    if disk == "slow":
        assert expired == []
    else:
        assert expired, "the watchdog never fired: the test proves nothing"

def _activation():
    """A new function object each call: the same code, another address."""
    def act(x):
        return torch.tanh(x)
    return act


class Activated(torch.nn.Module):
    def __init__(self, width: int, act) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        self.act = act

    def forward(self, x):
        return self.act(self.lin(x))


def test_the_same_model_with_a_function_argument_loads_its_own_checkpoint(tmp_path):
    # A layer argument printed with its address (`<function act at 0x7f3a...>`) differs from
    # one process, or one build, to the next: the fingerprint leaves every hex digit of the
    # address out, so the rebuilt model is the same model and loads its checkpoint.
    acts = [_activation() for _ in range(8)]
    saved = next(a for a in acts if re.search("[a-f]", hex(id(a))[2:]))
    again = next(a for a in acts if a is not saved)
    assert fingerprint([pf.LayerSpec(Activated, 4, saved)]) == \
        fingerprint([pf.LayerSpec(Activated, 4, again)])
    mse = lambda out, t: (out - t).pow(2).mean()                       # noqa: E731
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)                       # noqa: E731
    engine = pf.Engine([pf.LayerSpec(Activated, 4, saved)], mse, sgd, pf.Config())
    engine.train_step(torch.ones(2, 4), torch.zeros(2, 4))
    engine.save(tmp_path)
    other = pf.Engine([pf.LayerSpec(Activated, 4, again)], mse, sgd, pf.Config())
    other.load(tmp_path)
    assert other.stats.step == 1
    assert torch.equal(other.stage.module.state_dict()["0.lin.weight"],
                       engine.stage.module.state_dict()["0.lin.weight"])
    for e in (engine, other):
        e.close()


def _assert_step_1_still_loads(folder, saved, engine) -> None:
    """After a failed save: only step 1 is there, and it loads exactly."""
    assert sorted(os.listdir(folder)) == ["latest", "step-00000001"]
    other = _engine()
    other.load(folder)
    assert all(torch.equal(a, b) for a, b in zip(_masters(other).values(), saved.values()))
    for e in (engine, other):
        e.close()


def test_checkpoint_files_and_folders_follow_the_umask(tmp_path):
    """Issue 46 item 17: a checkpoint is written with the modes `open` and `os.makedirs` give
    (0666 / 0777 less the umask), not tempfile's 0600 / 0700, so a team can read it."""
    old_mask = os.umask(0o022)
    try:
        engine = _engine()
        x, y = batches(1, 4)[0]
        engine.train_step(x, y)
        folder = engine.save(tmp_path)
        engine.close()
    finally:
        os.umask(old_mask)
    found = {os.path.relpath(os.path.join(d, n), tmp_path): os.stat(os.path.join(d, n)).st_mode
             & 0o777 for d, dirs, files in os.walk(tmp_path) for n in dirs + files
             if not n.startswith(".")}
    want = {path: 0o755 if os.path.isdir(tmp_path / path) else 0o644 for path in found}
    assert os.path.basename(folder) in found and found == want
