"""Host memory under split-backward schedules: malloc keeps freed memory, unless told not to."""

import os
import subprocess
import sys

import pytest

import pipeflow as pf
from pipeflow import engine as engine_mod
from pipeflow.runtime.hostmem import USER_SETTINGS
from toy import adamw, batches, loss_fn, toy_layers

GLIBC = sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION") is not None
PROBE = "from pipeflow.runtime.hostmem import keep_freed_memory as k; print(k(), k())"


def _probe(**env) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_malloc_keeps_freed_memory_once_and_never_over_the_users_setting():
    assert _probe() == "True True"
    for name in USER_SETTINGS:       # the user's own malloc tuning wins
        assert _probe(**{name: "65536"}) == "False False"


@pytest.mark.parametrize("schedule,keep,called", [("zb-h1", True, True), ("zb-h1", False, False),
                                                  ("1f1b", True, False)])
def test_only_split_backward_schedules_on_cpu_tune_malloc(monkeypatch, schedule, keep, called):
    calls = []
    monkeypatch.setattr(engine_mod, "keep_freed_memory", lambda: calls.append(1) or True)
    engine = pf.Engine(toy_layers(), loss_fn, adamw,
                       pf.Config(schedule=schedule, microbatches=2, keep_host_memory=keep))
    assert bool(calls) == called
    for x, y in batches(2, 8):
        engine.train_step(x, y)
    engine.close()


def test_keep_host_memory_must_be_a_bool():
    with pytest.raises(pf.ConfigError, match="keep_host_memory must be true or false"):
        pf.Config(keep_host_memory="yes")
