"""The torch thread setting: `$AGENT_KV_THREADS` (default 1), `--threads`, applied by
`load_model`. Nothing here assumes how many cores the machine has or what count the test
session runs with, and each test puts torch's count back."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from agent_kv.errors import ConfigError
from agent_kv.runtime.models import threads
from agent_kv.runtime.models.model_loading import load_model


@pytest.fixture
def clean_env(monkeypatch):
    """No thread variables set; torch's count restored afterwards."""
    before = torch.get_num_threads()
    monkeypatch.setenv(threads.ENV, "")  # registered, so `choose` is undone too
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield monkeypatch
    torch.set_num_threads(before)


def test_default_environment_and_omp_num_threads(clean_env):
    assert threads.configured() == threads.DEFAULT == 1
    clean_env.setenv("OMP_NUM_THREADS", "3")
    assert threads.configured() is None  # torch keeps the count it read from OMP_NUM_THREADS
    clean_env.setenv(threads.ENV, " 2 ")
    assert threads.configured() == 2
    for bad in ("0", "-1", "two", "1.5"):
        clean_env.setenv(threads.ENV, bad)
        with pytest.raises(ConfigError, match=f"{threads.ENV} must be a whole number"):
            threads.configured()


def test_choose_sets_the_variable_that_child_processes_inherit(clean_env):
    threads.choose(None)
    assert os.environ[threads.ENV] == ""
    threads.choose(3)
    assert os.environ[threads.ENV] == "3" and threads.configured() == 3
    with pytest.raises(ConfigError, match="threads must be >= 1"):
        threads.choose(0)
    clean_env.setenv(threads.ENV, "many")
    with pytest.raises(ConfigError):
        threads.choose(None)


def test_apply_sets_torch_and_reaches_threads_started_later(clean_env):
    wanted = 2 if torch.get_num_threads() == 1 else 1  # a change, whatever the count is now
    clean_env.setenv(threads.ENV, str(wanted))
    assert threads.apply() == wanted == torch.get_num_threads()
    seen = []
    worker = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    worker.start()
    worker.join()
    assert seen == [wanted]  # the server runs the model in executor threads


def test_load_model_checks_the_setting_before_loading(clean_env):
    clean_env.setenv(threads.ENV, "all")
    with pytest.raises(ConfigError, match=threads.ENV):
        load_model("/nonexistent/model")  # the setting is refused before the path is looked at
