"""`model.path`: a folder that is not there, or a hub name with no network, is a config error
that says which, at once."""

import time

import pytest

from reinforge.errors import ConfigError
from reinforge.models.location import check_model_location, hub_reachable


def test_missing_folder_names_the_setting_not_the_hub(tmp_path):
    for path in (str(tmp_path / "nope"), "./checkpoints/model", "../x", "~/models/qwen"):
        with pytest.raises(ConfigError, match=r"model.path = .*no such folder"):
            check_model_location(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a model folder"):
        check_model_location(str(tmp_path / "empty"))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    check_model_location(str(tmp_path / "model"))  # a model folder passes


def test_offline_hub_name_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_reachable.cache_clear()
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"HF_HUB_OFFLINE is set.*hf download Org/Model-0\.5B"):
        check_model_location("Org/Model-0.5B")
    assert time.perf_counter() - start < 2
    hub_reachable.cache_clear()
