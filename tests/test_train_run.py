"""`pipeflow train` end to end in one process: a user's factory model against a plain loop,
token files read by memmap, resume continuing the data stream, metrics, pictures, overrides."""

import json
import os
import sys

import numpy as np
import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
import torch

import pipeflow as pf
from pipeflow.cli import main
from pipeflow.train.data import Batches, load_corpus, token_file
from pipeflow.models import GPTConfig, flops_per_token, gpt_layers, gpt_loss
from pipeflow.train.prepare import prepare
from pipeflow.train.run_config import load_run_config
from pipeflow.train.loop import lr_at, train, weight_decay_groups

from factory_models import RUN_TOML

FACTORY = RUN_TOML.format(pipeline=1, data=1, steps=4, batch_size=4, log_every=1)


def _run(tmp_path, text, *overrides):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_run_config(path, overrides)


def _plain_loop(model, run, steps: int, batch: int, seq: int) -> list[float]:
    """The reference: the same model, AdamW with the same groups and schedule, the same
    batches, in a plain loop."""
    opt = torch.optim.AdamW(weight_decay_groups(model.parameters(), run.train.weight_decay),
                            lr=run.train.lr, betas=(run.train.beta1, run.train.beta2))
    batches = Batches(load_corpus(), batch, seq, seed=0)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, run.train)
        x, y = batches.batch(step)
        loss = gpt_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(60)
def test_factory_model_trains_as_the_same_model_in_a_plain_loop(tmp_path):
    run = _run(tmp_path, FACTORY)
    losses = train(run, log=lambda *a, **k: None)
    # The reference: build_sequential, AdamW with the same groups, the same batches.
    from factory_models import token_mlp
    model = pf.build_sequential(token_mlp(d_model=16, n_layers=2, seq_len=16), seed=0)
    expected = _plain_loop(model, run, steps=4, batch=4, seq=16)
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert losses[-1] < losses[0]


def test_weight_decay_only_on_matrices():
    model = pf.build_sequential(gpt_layers(GPTConfig(n_layers=1, d_model=16, n_heads=2)))
    decay, no_decay = weight_decay_groups(model.parameters(), 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    skipped = {names[id(p)] for p in no_decay["params"]}
    assert any("ln" in n or "norm" in n for n in skipped), skipped   # LayerNorm weights
    assert all(n.endswith("bias") or p.dim() == 1
               for n, p in model.named_parameters() if id(p) in map(id, no_decay["params"]))
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def _token_file(tmp_path, n=5000, dtype=np.uint16, vocab=65536):
    path = tmp_path / "tokens.bin"
    (np.arange(n) % vocab).astype(dtype).tofile(path)
    return path


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_memmap_replicas_read_disjoint_shards_of_each_batch(tmp_path, dtype):
    tokens = token_file(_token_file(tmp_path, dtype=np.dtype(dtype).type), dtype)
    assert isinstance(tokens, np.memmap)
    batches = Batches(tokens, batch_size=8, seq_len=10, seed=3)
    reads = []
    original = batches.rows
    batches.rows = lambda step, lo, hi: (reads.append((lo, hi)), original(step, lo, hi))[1]
    for d in (2, 4):
        reads.clear()
        gx, gy = batches.batch(5)
        reads.clear()
        parts = [batches.local_batch(5, r, d) for r in range(d)]
        rows = [set(range(lo, hi)) for lo, hi in reads]
        assert all(a.isdisjoint(b) for i, a in enumerate(rows) for b in rows[i + 1:])
        assert set().union(*rows) == set(range(8))
        shard = 8 // d
        for r, (x, y) in enumerate(parts):
            mine = slice(r * shard, (r + 1) * shard)
            # Only the replica's rows: no global batch with zeros in the others' places.
            assert x.shape == (shard, 10) and torch.equal(x, gx[mine]) and torch.equal(y, gy[mine])
    # An arange file: each window is consecutive tokens, targets shifted by one.
    assert torch.equal(gy, gx + 1) and gx.dtype == torch.int64


def test_token_file_of_the_wrong_size_names_the_dtype(tmp_path):
    path = tmp_path / "odd.bin"
    path.write_bytes(b"\x00" * 7)
    with pytest.raises(ValueError, match="not a multiple of 2 .uint16.: is \\[data\\] dtype"):
        token_file(path, "uint16")


def test_prepare_writes_nanogpt_files_that_train(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello pipeline world\n" * 200)
    meta = prepare([text], tmp_path / "data", "byte", val_fraction=0.1)
    train_ids = np.fromfile(tmp_path / "data" / "train.bin", dtype=np.uint16)
    val_ids = np.fromfile(tmp_path / "data" / "val.bin", dtype=np.uint16)
    raw = list(text.read_bytes())
    assert train_ids.tolist() + val_ids.tolist() == raw
    assert len(val_ids) == int(len(raw) * 0.1) and meta["vocab_size"] == 256
    data = tmp_path / "data"
    assert main(["prepare", str(text), "--out", str(tmp_path / "d2"),
                 "--val-fraction", "0.1"]) == 0
    assert (tmp_path / "d2" / "train.bin").read_bytes() == (data / "train.bin").read_bytes()
    run = _run(tmp_path, FACTORY, f'data.train="{data}/train.bin"',
               f'data.val="{data}/val.bin"', "train.steps=3")
    losses = train(run, log=lambda *a, **k: None)
    assert len(losses) == 3 and losses[-1] < losses[0]


@pytest.mark.timeout(90)
def test_resume_continues_with_the_next_batch(tmp_path, monkeypatch):
    import pipeflow.train.loop as train_mod
    used = []
    original = train_mod._batch
    monkeypatch.setattr(train_mod, "_batch",
                        lambda b, i, e, eot=None: (used.append((b.batch_size, i)),
                                                   original(b, i, e, eot))[1])
    data = _token_file(tmp_path, n=20000, vocab=256)
    base = [f'data.train="{data}"', "data.seq_len=16", "train.steps=6"]
    whole = train(_run(tmp_path, FACTORY, *base), log=lambda *a, **k: None)
    assert [i for _, i in used] == [0, 1, 2, 3, 4, 5]
    save = f'train.save_dir="{tmp_path / "ck"}"'
    used.clear()
    first = train(_run(tmp_path, FACTORY, *base, save, "train.steps=3"), log=lambda *a, **k: None)
    assert json.loads((tmp_path / "ck" / "step-00000003" / "data.json").read_text())[
        "next_batch"] == 3
    used.clear()
    rest = train(_run(tmp_path, FACTORY, *base, save, "train.resume=true"),
                 log=lambda *a, **k: None)
    assert [i for _, i in used] == [3, 4, 5]
    assert first + rest == whole          # bit-identical: same batches, same state
    # The position comes from the checkpoint: a hand edit is refused (the record is sealed
    # with its sha256), a position written as pipeflow writes it is followed.
    from pipeflow.runtime.checkpoint import read_sealed_json, sealed_json
    state = tmp_path / "ck" / "step-00000006" / "data.json"
    record = read_sealed_json(str(state))
    state.write_text(state.read_text().replace('"next_batch": 6', '"next_batch": 40'))
    with pytest.raises(pf.ConfigError, match="data.json.*does not match its sha256"):
        train(_run(tmp_path, FACTORY, *base, save, "train.resume=true", "train.steps=7"),
              log=lambda *a, **k: None)
    state.write_bytes(sealed_json({**record, "next_batch": 40}))
    used.clear()
    train(_run(tmp_path, FACTORY, *base, save, "train.resume=true", "train.steps=7"),
          log=lambda *a, **k: None)
    assert [i for _, i in used] == [40]


@pytest.mark.timeout(60)
def test_metrics_jsonl_holds_computed_figures(tmp_path):
    metrics = tmp_path / "m.jsonl"
    run = _run(tmp_path, FACTORY.replace('factory = "factory_models:token_mlp"\n', "")
               .replace("d_model = 16\nn_layers = 2\nseq_len = 16",
                        "d_model = 16\nn_layers = 2\nn_heads = 2\nseq_len = 16"),
               f'train.metrics="{metrics}"', "train.peak_tflops=0.5", "train.eval_every=2")
    train(run, log=lambda *a, **k: None)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    assert [r["step"] for r in evals] == [1, 3, 3]     # eval_every = 2, and at the end
    fpt = flops_per_token(GPTConfig(n_layers=2, d_model=16, n_heads=2, seq_len=16))
    for r in steps:
        assert r["tokens_per_s"] == pytest.approx(4 * 16 / r["step_time_s"])
        assert r["mfu"] == pytest.approx(fpt * r["tokens_per_s"] / 0.5e12)
        assert r["flops_per_token"] == fpt and r["lr"] == pytest.approx(lr_at(r["step"], run.train))
        assert r["loss_scale"] == 1.0 and r["skipped_steps"] == 0
        (stage,) = r["stages"]
        assert 0.0 <= stage["bubble"] < 1.0 and stage["peak_memory_bytes"] > 2**20
        (memory,) = r["memory"]            # engine.memory_report() of each rank
        assert memory["parameters"] > 0 and memory["sharded"] is False
        assert memory["optimizer_state"] > 0 and memory["gradients"] > 0
        assert memory["bytes_per_parameter"]["working"] == pytest.approx(4.0)
    assert len({r["tokens_per_s"] for r in steps}) > 1        # measured, not a constant
    train(run, log=lambda *a, **k: None)                       # a new run: a new file
    assert len(metrics.read_text().splitlines()) == len(records)


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.timeout(60)
def test_pictures_of_a_schedule_a_trace_and_a_run(tmp_path):
    pytest.importorskip("matplotlib")
    assert main(["schedule", "-p", "4", "-m", "8", "--png", str(tmp_path / "s.png")]) == 0
    assert _png_size(tmp_path / "s.png") == (1200, 400)
    path = tmp_path / "run.toml"
    path.write_text(FACTORY)
    trace, metrics = tmp_path / "t.json", tmp_path / "m.jsonl"
    assert main(["train", str(path), "--trace", str(trace),
                 "--set", f'train.metrics="{metrics}"', "--set", "train.eval_every=1"]) == 0
    # The last training step's, not the validation's forwards after it (eval_every = 1).
    categories = {e["cat"] for e in json.loads(trace.read_text())["traceEvents"] if "cat" in e}
    assert categories == {"F", "B", "optimizer step"}
    assert main(["trace", str(trace), "--png", str(tmp_path / "t.png")]) == 0
    assert main(["plot", str(metrics), "--png", str(tmp_path / "l.png")]) == 0
    assert _png_size(tmp_path / "t.png") == (1200, 400)
    assert _png_size(tmp_path / "l.png") == (1200, 640)      # 2 x 2 panels (no loss scale)
    for name in ("t.png", "l.png"):
        assert (tmp_path / name).stat().st_size > 10_000     # drawn, not blank


def test_run_panels_plot_each_recorded_figure_against_the_shared_step():
    # Each panel draws the JSONL's own values at their steps: the loss raw, its smoothed
    # curve (a bias-corrected moving average, written out here) and the validation points;
    # the learning rate; tokens/s; the grad norm; the loss scale of an fp16 run (log scale).
    pytest.importorskip("matplotlib")
    from pipeflow.train import plot
    records = [{"step": s, "loss": 5.0 - s / 10 if s != 30 else None, "lr": 1e-3 * (s + 1),
                "tokens_per_s": 1000.0 + s, "grad_norm": 2.0 / (s + 1),
                "loss_scale": 2.0 ** 16 / (2 if s >= 20 else 1)} for s in range(0, 50, 10)]
    records.insert(3, {"step": 20, "eval_loss": 3.5})
    records.append({"step": 40, "eval_loss": 1.5})
    fig = plot.metrics_figure(records, smoothing=0.5)
    axes = {ax.get_ylabel(): ax for ax in fig.axes}
    assert list(axes) == ["loss (nats/token)", "learning rate", "tokens/s",
                          "gradient norm (L2, whole grid)", "loss scale (fp16)"]
    train = [r for r in records if "loss" in r]
    steps = [r["step"] for r in train]
    expected = {"learning rate": [r["lr"] for r in train],
                "tokens/s": [r["tokens_per_s"] for r in train],
                "gradient norm (L2, whole grid)": [r["grad_norm"] for r in train],
                "loss scale (fp16)": [r["loss_scale"] for r in train]}
    for label, values in expected.items():
        (line,) = axes[label].get_lines()
        assert list(line.get_xdata()) == steps and list(line.get_ydata()) == values, label
    assert axes["loss scale (fp16)"].get_yscale() == "log"
    raw, smooth, val = axes["loss (nats/token)"].get_lines()
    assert list(raw.get_xdata()) == steps
    assert [None if v != v else v for v in raw.get_ydata()] == [r["loss"] for r in train]
    m, w, want = 0.0, 0.0, []            # weights 0.5 ** age over the finite losses so far
    for r in train:
        if r["loss"] is None:
            want.append(None)
            continue
        m, w = 0.5 * m + 0.5 * r["loss"], 0.5 * w + 0.5
        want.append(m / w)
    got = [None if v != v else v for v in smooth.get_ydata()]
    assert [g is None for g in got] == [x is None for x in want] == [False] * 3 + [True, False]
    assert [g for g in got if g is not None] == pytest.approx([x for x in want if x is not None])
    assert list(val.get_xdata()) == [20, 40] and list(val.get_ydata()) == [3.5, 1.5]
    # One step axis for every panel, each labelled.
    shared = axes["loss (nats/token)"].get_shared_x_axes()
    assert all(shared.joined(axes["loss (nats/token)"], ax) for ax in fig.axes)
    assert {ax.get_xlabel() for ax in fig.axes} == {"step"}
    # Without scaling (loss_scale 1.0 throughout) or a grad norm, those panels are left out.
    plain = [{k: v for k, v in r.items() if k != "grad_norm"} | {"loss_scale": 1.0}
             for r in train]
    assert [ax.get_ylabel() for ax in plot.metrics_figure(plain).axes] == \
        ["loss (nats/token)", "learning rate", "tokens/s"]


def test_the_lanes_legend_names_every_kind_drawn_and_idle_time():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    from pipeflow.train import plot
    lanes = [[("F0", 0, 1), ("SA0", 1, 1.2), ("RG0", 1.2, 3), ("B0", 3, 4), ("W0", 4, 5),
              ("optimizer step", 5, 6)],
             [("RA0", 0, 1.2), ("F0", 1.2, 2), ("B0", 2, 3), ("SG0", 3, 3.1)]]
    fig, ax = plt.subplots()
    plot.draw_lanes(ax, lanes, ["rank 0", "rank 1"], "ms")
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "F forward (colour: micro-batch)", "B backward (input gradient)", "W weight gradient",
        "send (SA, SG)", "receive (RA, RG); long: a wait", "optimizer step",
        "idle: the bubble"]
    # Sends and receives are told apart in the picture as in the legend.
    thin = {tuple(c.get_facecolor()[0]) for c in ax.collections
            if c.get_paths()[0].get_extents().height < 0.5}
    assert len(thin) == 2
    plt.close(fig)
    fig, ax = plt.subplots()
    plot.draw_lanes(ax, [[("F0", 0, 1)]], ["rank 0"], "ms")     # only what is drawn, and idle
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "F forward (colour: micro-batch)", "idle: the bubble"]
    plt.close(fig)


def test_overrides_reach_every_table_and_print_config_shows_them(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(FACTORY)
    assert main(["train", str(path), "--set", "engine.microbatches=4", "--set", "train.lr=1e-3",
                 "--set", "data.dtype=uint32", "--set", "model.d_model=8",
                 "--print-config"]) == 0
    doc = tomllib.loads(capsys.readouterr().out)
    assert doc["engine"]["microbatches"] == 4 and doc["train"]["lr"] == 1e-3
    assert doc["data"]["dtype"] == "uint32" and doc["model"]["d_model"] == 8
    assert doc["model"]["factory"] == "factory_models:token_mlp"
    assert doc["train"]["steps"] == 4        # untouched keys keep the file's values


def test_trace_category_is_the_op_letters():
    from pipeflow.train.trace import op_kind
    assert [op_kind(n) for n in ("F3", "F3.1", "B12.3", "SA2", "optimizer step")] == [
        "F", "F", "B", "SA", "optimizer step"]


def test_plain_lines_without_a_terminal():
    from pipeflow.train.metrics import MetricsLog
    lines = []
    out = MetricsLog([], total=10, first=0, progress=True,
                     log=lambda text, **k: lines.append(text))
    assert out.bar is None                       # pytest's stdout is no terminal
    out.line("step 0")
    out.advance(1.0)
    out.close()
    assert lines == ["step 0"]


def test_progress_bar_on_a_terminal(monkeypatch):
    pytest.importorskip("tqdm")
    from pipeflow.train.metrics import MetricsLog
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    # The process's own stdout (a test's capture of it otherwise draws no bar, by design).
    monkeypatch.setattr("sys.__stdout__", sys.stdout)
    out = MetricsLog([], total=10, first=3, progress=True)
    assert out.bar is not None and out.bar.n == 3
    out.advance(2.0)
    assert out.bar.n == 4
    out.close()


@pytest.mark.timeout(60)
def test_tensorboard_gets_the_same_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    metrics, board = tmp_path / "m.jsonl", tmp_path / "tb"
    train(_run(tmp_path, FACTORY, f'train.metrics="{metrics}"', f'train.tensorboard="{board}"'),
          log=lambda *a, **k: None)
    events = EventAccumulator(str(board))
    events.Reload()
    assert {"loss", "lr", "tokens_per_s", "mfu"} <= set(events.Tags()["scalars"])
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(losses, rel=1e-6)


@pytest.mark.timeout(60)
def test_hf_model_from_the_config_trains_as_the_same_model_in_a_plain_loop(tmp_path):
    transformers = pytest.importorskip("transformers", reason="kind = 'hf' needs transformers")
    from pipeflow.models import hf
    text = open(os.path.join(os.path.dirname(__file__), "..", "examples",
                             "hf_llama.toml")).read()
    run = _run(tmp_path, text, "engine.pipeline=1", "train.steps=3", "train.batch_size=4",
               "model.seq_len=16")
    losses = train(run, log=lambda *a, **k: None)
    cfg = transformers.AutoConfig.for_model(**run.model["config"])
    model = pf.build_sequential(hf.causal_lm_layers(cfg), seed=0)
    expected = _plain_loop(model, run, steps=3, batch=4, seq=16)
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.timeout(60)
def test_a_second_run_on_the_same_save_dir_is_refused_naming_the_first(tmp_path):
    # Two jobs saving into one folder would overwrite each other's checkpoints (and one
    # crashed on the other's temporary files): the second is refused at start, naming the
    # host and PID of the first; once the first ends, the folder is free again.
    import subprocess
    import sys
    save = tmp_path / "ck"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pipeflow.train.loop import SaveDirLock; "
         f"SaveDirLock({str(save)!r}).acquire(); print('locked', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        run = _run(tmp_path, FACTORY, f'train.save_dir="{save}"', "train.steps=1")
        with pytest.raises(pf.ConfigError, match=rf"is in use by another run \(host .*, pid "
                                                 rf"{holder.pid}, which holds"):
            train(run, log=lambda *a, **k: None)
        assert not [d for d in os.listdir(save) if d.startswith("step-")]
    finally:
        holder.kill()
        holder.wait()
    assert len(train(run, log=lambda *a, **k: None)) == 1      # free again
    assert (save / "latest").read_text() == "step-00000001"


def test_an_unusable_save_dir_is_found_before_step_0(tmp_path):
    # A save_dir whose parent is a file (root writes anywhere else, so this is the case CI
    # can show): refused before any step is trained, not at the first save hours later.
    (tmp_path / "file").write_text("not a folder")
    run = _run(tmp_path, FACTORY, f'train.save_dir="{tmp_path / "file" / "ck"}"')
    trained = []
    with pytest.raises(pf.ConfigError, match="not a writable folder"):
        train(run, log=lambda *a, **k: None, on_step=trained.append)
    assert trained == []


@pytest.mark.timeout(60)
def test_a_stop_right_after_a_periodic_save_does_not_save_again(tmp_path):
    # SIGUSR1 just after the periodic save of the same step: the checkpoint is already there;
    # writing it again would only spend the time a preemption warning leaves.
    import signal
    save = tmp_path / "ck"
    run = _run(tmp_path, FACTORY, f'train.save_dir="{save}"', "train.save_every=2",
               "train.steps=6")

    def on_step(step):
        if step == 1:
            os.kill(os.getpid(), signal.SIGUSR1)

    assert len(train(run, log=lambda *a, **k: None, on_step=on_step)) == 2
    assert (save / "latest").read_text() == "step-00000002"
    meta = json.loads((save / "step-00000002" / "engine.json").read_text())
    assert meta["sequence"] == 0                  # written once
    assert (save / "STOPPED").read_text() == "SIGUSR1 at step 2\n"   # slurm.sbatch requeues
    rest = train(_run(tmp_path, FACTORY, f'train.save_dir="{save}"', "train.save_every=2",
                      "train.steps=6", "train.resume=true"), log=lambda *a, **k: None)
    assert len(rest) == 4 and not (save / "STOPPED").exists()


@pytest.mark.timeout(60)
def test_sigusr1_after_pipeflow_train_finished_does_not_kill_the_rank(tmp_path):
    # Slurm's warning may come after the last step: the finished rank must not die of it
    # (a default SIGUSR1 kills the process, and mpirun then reports the job failed).
    import signal
    import subprocess
    import sys
    path = tmp_path / "run.toml"
    path.write_text(FACTORY.replace("steps = 4", "steps = 1"))
    script = ("import os, signal, sys, time; sys.path.insert(0, sys.argv[2]); "
              "from pipeflow.cli import main; rc = main(['train', sys.argv[1]]); "
              "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.2); print('alive', rc)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_"))}
    proc = subprocess.run([sys.executable, "-c", script, str(path),
                           os.path.dirname(os.path.abspath(__file__))],
                          capture_output=True, text=True, timeout=50, env=env)
    assert proc.returncode != -signal.SIGUSR1, "killed by SIGUSR1 after the run"
    assert proc.returncode == 0 and "alive 0" in proc.stdout, proc.stdout + proc.stderr
