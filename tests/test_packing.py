"""`[data] packed = true`: position ids restart after each end-of-text token, so a document
packed after another gives the logits it gives alone (attention stays inside it), for every
family pipeflow.models.hf builds; and the packed sampler is deterministic and resumes at its
batch."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import pipeflow as pf                                              # noqa: E402
from hub_run import SEQ, VOCAB, hub_config, run_toml, save_hub     # noqa: E402
from pipeflow.models import hf                                     # noqa: E402
from pipeflow.train.data import packed_positions                   # noqa: E402
from pipeflow.train.loop import train                              # noqa: E402
from pipeflow.train.run_config import load_run_config              # noqa: E402
from test_hf import MODELS, hf_model, make_config, pipeflow_copy, run_layers  # noqa: E402

EOT = 5


def test_positions_restart_after_each_end_of_text():
    ids = torch.tensor([[9, 8, EOT, 7, 6, EOT, 4], [EOT, EOT, 3, 2, 1, 0, 9]])
    assert packed_positions(ids, EOT).tolist() == [[0, 1, 2, 0, 1, 2, 0],
                                                   [0, 0, 0, 1, 2, 3, 4]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_packed_document_gives_the_logits_it_gives_alone(kind):
    cfg = hub_config(kind)
    engine = pf.Engine(hf.causal_lm_layers(cfg), hf.causal_lm_loss_sum,
                       lambda ps: torch.optim.SGD(ps, lr=0.1), pf.Config(microbatches=1))
    gen = torch.Generator().manual_seed(1)
    first = torch.randint(6, VOCAB, (1, 6), generator=gen)
    second = torch.randint(6, VOCAB, (1, SEQ - 7), generator=gen)
    row = torch.cat([first, torch.tensor([[EOT]]), second], dim=1)
    alone = engine.eval_step(second)
    packed = engine.eval_step(row, position_ids=packed_positions(row, EOT))
    torch.testing.assert_close(packed[:, 7:], alone, atol=1e-5, rtol=1e-5)
    # Without the restarted positions the second document sees the first: other logits.
    unpacked = engine.eval_step(row)
    assert not torch.allclose(unpacked[:, 7:], alone, atol=1e-3)
    engine.close()


@pytest.mark.parametrize("kind", MODELS)
def test_every_family_gives_a_packed_document_the_logits_it_gives_alone(kind):
    # Two rows cut at different places: each block's mask must keep attention inside each
    # document of each row, and positions (rotary, learned, ALiBi) restart with it. OPT, Bloom
    # and GPT-OSS in transformers build their masks without position ids (their own forward
    # attends across the documents); pipeflow builds every family's from them.
    cfg = make_config(kind)
    seq = pipeflow_copy(cfg, hf_model(cfg).eval())
    gen = torch.Generator().manual_seed(2)
    docs = [torch.randint(6, VOCAB, (1, n), generator=gen) for n in (6, 9, 10, 5)]
    eot = torch.tensor([[EOT]])
    rows = torch.cat([torch.cat([docs[0], eot, docs[1]], 1), torch.cat([docs[2], eot, docs[3]], 1)])
    with torch.no_grad():
        packed = run_layers(seq, rows, position_ids=packed_positions(rows, EOT))
        alone = [run_layers(seq, d) for d in docs]
        first = run_layers(seq, torch.cat([docs[0], eot], 1))
    torch.testing.assert_close(packed[:1, :7], first, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[:1, 7:], alone[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[1:, :10], alone[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[1:, 11:], alone[3], atol=1e-5, rtol=1e-5)


def _packed_tokens(folder: str) -> str:
    """Tokens with an end-of-text about every fifth token, and the meta.json recording it."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(6, VOCAB, 4000)
    tokens[rng.random(4000) < 0.2] = EOT
    path = os.path.join(folder, "tokens.bin")
    np.asarray(tokens, dtype=np.uint16).tofile(path)
    with open(os.path.join(folder, "meta.json"), "w") as f:
        f.write(f'{{"dtype": "uint16", "vocab_size": {VOCAB}, "eot": {EOT}}}')
    return path


@pytest.mark.timeout(120)
def test_packed_runs_are_deterministic_and_resume_at_their_batch(tmp_path):
    hub = str(tmp_path / "hub")
    save_hub(hub, "llama", sharded=False)
    path = run_toml(str(tmp_path), f'pretrained = "{hub}"', steps=4,
                    data_extra="packed = true", tokens=_packed_tokens(str(tmp_path)))
    quiet = dict(log=lambda *a, **k: None)
    whole = train(load_run_config(path), **quiet)
    assert train(load_run_config(path), **quiet) == whole
    save = f"train.save_dir={str(tmp_path / 'ckpt')!r}".replace("'", '"')
    part = train(load_run_config(path, [save, "train.steps=2"]), **quiet)
    rest = train(load_run_config(path, [save, "train.resume=true"]), **quiet)
    assert part + rest == whole
    # The positions reach the model: the same run unpacked trains otherwise.
    assert train(load_run_config(path, ["data.packed=false"]), **quiet) != whole


def test_positions_of_a_packed_batch_restart_after_each_end_of_text_of_its_inputs():
    # The rule: position 0 at a row's first input token and at each input token right after
    # an end-of-text *in the inputs*. The targets are the inputs shifted by one: positions
    # from them restart one token early, inside the previous document.
    from types import SimpleNamespace

    from pipeflow.train.data import Batches
    from pipeflow.train.loop import _batch
    tokens = np.arange(1, 401) % 7 + 6
    tokens[::5] = EOT
    one_stage = SimpleNamespace(holds_first=lambda stage: True, holds_last=lambda stage: True)
    engine = SimpleNamespace(stage=SimpleNamespace(index=0, topo=SimpleNamespace(replica=0)),
                             plan=one_stage, config=SimpleNamespace(data=1))
    (x, y), side = _batch(Batches(tokens, 4, 12, seed=3), 0, engine, EOT)
    expected = []
    for row in x.tolist():
        positions = [0]
        for before in row[:-1]:
            positions.append(0 if before == EOT else positions[-1] + 1)
        expected.append(positions)
    assert (x[:, :-1] == EOT).any(), "no end-of-text inside a row: the test would prove nothing"
    assert side["position_ids"].tolist() == expected


def test_an_end_of_text_id_of_0_is_an_id_not_unset(tmp_path):
    # 0 is a token id like any other; only -1 means "read meta.json". [data] eot = 0 and
    # meta.json's "eot": 0 are both read as 0, and eot = 0 without packed is refused like
    # any other id.
    from pipeflow.config import ConfigError
    from pipeflow.train.loop import _packing_eot
    from pipeflow.train.run_config import DataConfig
    tokens = str(tmp_path / "tokens.bin")
    np.zeros(64, dtype=np.uint16).tofile(tokens)
    meta = tmp_path / "meta.json"
    meta.write_text(f'{{"dtype": "uint16", "vocab_size": {VOCAB}, "eot": {EOT}}}')
    assert _packing_eot(DataConfig(train=tokens, packed=True, eot=0)) == 0
    meta.write_text(f'{{"dtype": "uint16", "vocab_size": {VOCAB}, "eot": 0}}')
    assert _packing_eot(DataConfig(train=tokens, packed=True)) == 0
    hub = str(tmp_path / "hub")
    path = run_toml(str(tmp_path), f'pretrained = "{hub}"', data_extra="eot = 0",
                    tokens=tokens)
    with pytest.raises(ConfigError, match=r"\[data\] eot = 0 is read only with packed = true"):
        load_run_config(path)
