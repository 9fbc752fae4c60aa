"""Export folders (`pipeflow export CKPT --hf OUT`, `[train] export_hf`): never destroying what
pipeflow did not write. Files of OUT it does not write stay, weights of another writer and
checkpoint folders are refused, and a kill at any point of `export.publish` leaves the old OUT
or the new one whole, its leftovers named and removed by the next export."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
from mpi4py import MPI

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from hub_run import run_toml, safetensors_of, save_hub, train_keeping_engine  # noqa: E402
from pipeflow.cli import main                                                 # noqa: E402
from pipeflow.train import export                                             # noqa: E402

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A one-step HF run with a checkpoint; (folder, save_dir, the Hub folder it started from)."""
    tmp = tmp_path_factory.mktemp("export")
    hub = str(tmp / "hub")
    save_hub(hub, "llama", sharded=False)
    path = run_toml(str(tmp), f'pretrained = "{hub}"', steps=1,
                    train_extra=f'save_dir = "{tmp / "ckpt"}"')
    train_keeping_engine(path, MPI.COMM_WORLD)
    return tmp, str(tmp / "ckpt"), hub


def _snapshot(folder) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def test_export_into_a_folder_keeps_every_file_it_did_not_write(run, tmp_path, capsys):
    _, ckpt, _ = run
    out = tmp_path / "out"
    (out / "tokenizer").mkdir(parents=True)
    (out / "README.md").write_text("my model card")
    (out / "tokenizer" / "tokenizer.json").write_text('{"v": 1}')
    theirs = _snapshot(out)
    for _ in range(2):              # into the folder, then over pipeflow's own export
        assert main(["export", ckpt, "--hf", str(out)]) == 0
        after = _snapshot(out)
        assert {k: after[k] for k in theirs} == theirs
        # ...and what the run's source folder holds besides weights (its generation config)
        assert sorted(after) == sorted([*theirs, "config.json", "generation_config.json",
                                        "model.safetensors"])
    said = capsys.readouterr().out
    assert "kept ['README.md', 'tokenizer']" in said
    assert "replaced ['config.json', 'generation_config.json', 'model.safetensors']" in said
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".out.")]   # no leftover


def test_weights_pipeflow_did_not_write_are_refused_unless_overwrite(run, tmp_path, capsys):
    _, ckpt, hub = run
    out = tmp_path / "hub"
    save_hub(str(out), "llama", sharded=True)         # save_pretrained's shards and index
    before = _snapshot(out)
    assert main(["export", ckpt, "--hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert "which pipeflow did not write" in err and "model.safetensors.index.json" in err
    assert "--overwrite" in err
    assert _snapshot(out) == before
    assert main(["export", ckpt, "--hf", str(out), "--overwrite"]) == 0
    after = sorted(os.listdir(out))
    assert after == ["config.json", "generation_config.json", "model.safetensors"]
    assert (out / "generation_config.json").read_bytes() == before["generation_config.json"]
    assert safetensors_of(str(out))                    # pipeflow's own, readable


@pytest.mark.parametrize("target", ["save_dir", "checkpoint", "parent", "inside"])
def test_a_checkpoint_or_save_folder_is_never_an_export_folder(run, capsys, target):
    tmp, ckpt, _ = run
    step = os.path.join(ckpt, "step-00000001")
    out = {"save_dir": ckpt, "checkpoint": step, "parent": str(tmp),
           "inside": os.path.join(step, "hf")}[target]
    before = _snapshot(ckpt)
    assert main(["export", ckpt, "--hf", out, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "an export there would mix with the checkpoints" in err, err
    assert _snapshot(ckpt) == before and not os.path.exists(os.path.join(step, "hf"))


def test_export_hf_into_the_runs_save_dir_is_refused_before_training(run, tmp_path, capsys):
    tmp, _, hub = run
    save = tmp_path / "ckpt"
    path = run_toml(str(tmp_path), f'pretrained = "{hub}"', steps=1,
                    train_extra=f'save_dir = "{save}"\nexport_hf = "{save}"')
    assert main(["train", path]) == 2
    err = capsys.readouterr().err
    assert "[train] export_hf =" in err and "the run's save_dir" in err, err
    assert not save.exists()                           # nothing trained, nothing saved


def _writer(content: bytes):
    def write(staging: str) -> None:
        for name in export.OWN:
            with open(os.path.join(staging, name), "wb") as f:
                f.write(content)
    return write


def _killed_at(tmp_path, point: str, exchange: bool) -> None:
    """`publish` of new files over an old export in a child process that dies (os._exit, no
    cleanup) at `point`."""
    import multiprocessing
    out = str(tmp_path / "out")

    def child() -> None:
        import pipeflow.train.export as ex
        if not exchange:
            ex._exchange = lambda a, b: False
        die = lambda *a, **k: os._exit(9)                                  # noqa: E731
        if point == "writing":
            ex.publish(out, lambda staging: (_writer(b"new")(staging), die()), overwrite=True)
        elif point == "swapped":
            ex.shutil.rmtree = die            # the old folder is not yet removed
            ex.publish(out, _writer(b"new"), overwrite=True)
        elif point == "between-renames":
            real = os.rename
            calls = []

            def rename(a, b):
                calls.append(a)
                if len(calls) == 2:          # out -> .out.old-* done, staging -> out not
                    die()
                return real(a, b)
            ex.os.rename = rename
            ex.publish(out, _writer(b"new"), overwrite=True)
        os._exit(0)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(60)
    assert proc.exitcode == 9


@pytest.mark.parametrize("point,exchange", [("writing", True), ("swapped", True),
                                            ("writing", False), ("swapped", False),
                                            ("between-renames", False)])
def test_a_kill_anywhere_leaves_one_whole_folder_and_the_next_export_cleans_up(tmp_path, point,
                                                                               exchange):
    out = tmp_path / "out"
    export.publish(str(out), _writer(b"old"), overwrite=True)   # not marked
    (out / "README.md").write_text("keep me")
    _killed_at(tmp_path, point, exchange)
    left = sorted(e for e in os.listdir(tmp_path) if e.startswith(".out."))
    assert left, "the kill left nothing behind: the test did not stop where it meant to"
    if out.exists():
        seen = {n: (out / n).read_bytes() for n in export.OWN}
        assert set(seen.values()) in ({b"old"}, {b"new"}), seen      # whole: old or new
        assert (out / "README.md").read_text() == "keep me"
    else:
        assert point == "between-renames"     # the two-rename fallback: restored next time
    done = export.publish(str(out), _writer(b"newer"), overwrite=True)
    assert done.cleaned and all(any(c.startswith(x) for c in done.cleaned) for x in left)
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".out.")]
    assert {(out / n).read_bytes() for n in export.OWN} == {b"newer"}
    assert (out / "README.md").read_text() == "keep me"


def test_a_full_disk_is_one_line_naming_the_folder(run, tmp_path, capsys, monkeypatch):
    _, ckpt, _ = run
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*args, **kwargs):    # what safetensors raises on a full disk (seen on a tmpfs)
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("x")
    assert main(["export", ckpt, "--hf", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write the export folder '{out}'" in err
    assert "the disk is full (No space left on device)" in err and "Free space" in err
    assert os.listdir(out) == ["README.md"] and os.listdir(tmp_path) == ["out"]


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS])
def test_a_read_only_folder_is_one_line_naming_it(run, tmp_path, capsys, monkeypatch, code):
    _, ckpt, _ = run

    def refused(*args, **kwargs):    # root writes anywhere: the refusal is simulated
        raise OSError(code, os.strerror(code), str(tmp_path / ".out.export-x"))
    monkeypatch.setattr(export.tempfile, "mkdtemp", refused)
    assert main(["export", ckpt, "--hf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write the export folder '{tmp_path / 'out'}'" in err
    assert os.strerror(code) in err and "must be writable" in err
    assert json.dumps(os.listdir(tmp_path)) == "[]"


def test_a_folder_beside_the_save_dir_is_an_export_folder_whatever_its_name_shares(run, capsys):
    # Only the save_dir itself, a folder inside it or one holding it is refused, by path
    # components: `ckpt-hf` beside `ckpt` (the name the refusal itself suggests), `ckpt2`
    # and `ckp` are folders of their own.
    tmp, ckpt, _ = run
    assert main(["export", ckpt, "--hf", ckpt]) == 2
    err = capsys.readouterr().err
    suggested = ckpt + "-hf"
    assert f"(e.g. {suggested!r})" in err, err
    try:
        assert main(["export", ckpt, "--hf", suggested]) == 0
        assert safetensors_of(suggested)
    finally:
        shutil.rmtree(suggested, ignore_errors=True)
    for beside in (suggested, ckpt + "2", ckpt[:-1], os.path.join(ckpt + "-hf", "inner")):
        export.check_target(beside, avoid=(ckpt,))
    for near in (ckpt, os.path.join(ckpt, "hf"), str(tmp)):
        with pytest.raises(export.ExportError, match="the run's save_dir|checkpoint"):
            export.check_target(near, avoid=(ckpt,))


def test_a_sharded_export_is_pipeflows_own_to_export_over(run, tmp_path):
    # A sharded export (its index and shards) is pipeflow's: the next export into the folder,
    # sharded or not, needs no --overwrite, and leaves only its own weights (no stale index
    # or shard that transformers would load instead).
    _, ckpt, _ = run
    from pipeflow.train.hub import weight_index
    out = str(tmp_path / "out")
    sharded = ["export", ckpt, "--hf", out, "--max-shard-size", "20KB"]
    keys = None
    for argv in (sharded, sharded, ["export", ckpt, "--hf", out], sharded):
        assert main(argv) == 0, argv
        files = sorted(os.listdir(out))
        weights = [f for f in files if f.endswith((".safetensors", ".index.json"))]
        if argv is sharded:
            assert export.INDEX in files and "model.safetensors" not in files
            index = json.loads((tmp_path / "out" / export.INDEX).read_text())
            assert sorted(weights) == sorted({*index["weight_map"].values(), export.INDEX})
        else:
            assert weights == ["model.safetensors"]
        keys = keys or sorted(weight_index(out))
        assert sorted(weight_index(out)) == keys
