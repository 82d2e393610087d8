"""`distributed.rollout_staleness` as a setting: bad values refused with the fix, the resolved
value per mode, a saved config that resumes, the preflight's row and warning. The runs that show
the lag (k = 0 on-policy exactly, k = 1, k = 2 after a resume that drops the queue) are in
test_torchrun.py, beside the single-process run they compare with."""

import pytest

from reinforge.config import TrainConfig, load_config
from reinforge.config.load import to_toml
from reinforge.errors import ConfigError

from ..conftest import TINY_RUN

DISAGGREGATED = "distributed.mode=disaggregated"


def test_a_negative_staleness_is_refused_with_the_values_that_work():
    with pytest.raises(ConfigError, match=r"rollout_staleness = -1.*set 0 \(on-policy\) or 1"):
        load_config(TrainConfig, None, [DISAGGREGATED, "distributed.rollout_staleness=-1"])


def test_staleness_without_the_disaggregated_mode_is_refused():
    with pytest.raises(ConfigError, match=r"needs distributed\.mode = 'disaggregated'") as error:
        load_config(TrainConfig, None, ["distributed.rollout_staleness=2"])
    assert "mode is 'colocated'" in str(error.value)
    # 0 asks for nothing the colocated mode does not do
    assert (
        load_config(TrainConfig, None, ["distributed.rollout_staleness=0"]).distributed.staleness
        == 0
    )


@pytest.mark.parametrize(
    "overrides,want",
    [([], 0), ([DISAGGREGATED], 1), ([DISAGGREGATED, "distributed.rollout_staleness=3"], 3)],
)
def test_resolved_staleness_and_the_saved_config_reloads(tmp_path, overrides, want):
    cfg = load_config(TrainConfig, None, overrides)
    assert cfg.distributed.staleness == want
    saved = tmp_path / "config.toml"  # what a run writes, and a resume reads
    saved.write_text(to_toml(cfg))
    assert load_config(TrainConfig, str(saved), []).distributed.staleness == want


@pytest.mark.parametrize("k,warns", [(0, False), (2, True)])
def test_preflight_names_the_staleness_and_warns_only_when_uncorrected(monkeypatch, k, warns):
    from reinforge.preflight import run_preflight

    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    overrides = [*TINY_RUN, DISAGGREGATED, f"distributed.rollout_staleness={k}"]
    pf = run_preflight(load_config(TrainConfig, None, overrides))
    assert f"up to {k} step(s) behind" in dict(pf.rows)["processes"]
    assert any("leaves that uncorrected" in w for w in pf.warnings) == warns
    corrected = run_preflight(load_config(TrainConfig, None, [*overrides, "algorithm.tis_cap=2"]))
    assert not any("leaves that uncorrected" in w for w in corrected.warnings)


def test_the_sampler_waits_for_weights_k_steps_old_and_loads_the_newest():
    """The generator's sampling side (`Lookahead.take_weights`), with the link thread's part
    played by hand: rollout(t) waits for the weights of step t - 1 - k, then samples with the
    newest staged; a stop wakes it."""
    import threading

    import torch

    from reinforge.train.loop.disaggregated import Lookahead

    model = [torch.zeros(3)]
    ahead = Lookahead(model, weights_step=0, staleness=2)
    assert ahead.staging[0] is not model[0]  # weights arrive beside the model while it samples
    assert all(ahead.take_weights(t) for t in (1, 2, 3)) and ahead.weights_step == 0
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(ahead.take_weights(4)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # rollout(4) needs the weights of step 1
    with ahead.changed:
        ahead.staging[0].fill_(1.0)
        ahead.staged(1)
    waiter.join(10)
    assert got == [True] and ahead.weights_step == 1 and model[0].tolist() == [1.0] * 3
    with ahead.changed:  # steps 2 and 3 arrived while rollout(4) was sampled: the newest wins
        ahead.staging[0].fill_(3.0)
        ahead.staged(3)
    assert ahead.take_weights(5) and ahead.weights_step == 3 and model[0].tolist() == [3.0] * 3
    waiter = threading.Thread(target=lambda: got.append(ahead.take_weights(7)))
    waiter.start()  # needs step 4's weights; the trainers stop instead
    with ahead.changed:
        ahead.is_stopped = True
        ahead.changed.notify_all()
    waiter.join(10)
    assert got == [True, False]
    assert Lookahead(model, 0, staleness=0).staging is model  # k = 0: straight into the model
