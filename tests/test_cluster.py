"""The single-process parts of running on a cluster: the model cache under concurrent builders,
`reinforge report` on the files distributed failures leave, the launcher's exit-code verdict
and the reading of collective errors. The two-node scenarios are in
tests/distributed/test_cluster_nodes.py."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import pytest

from reinforge.cluster_heartbeat import kind_of
from reinforge.errors import ExitCode
from reinforge.launch import node_verdict
from reinforge.models.cache import MANIFEST, cached_entry, is_complete
from reinforge.report import build_report, print_run_report


def _slow_build(out: Path) -> None:
    out.mkdir(parents=True)
    (out / "weights.bin").write_bytes(b"x" * 1000)
    time.sleep(0.3)  # long enough for every other process to find no entry and wait
    (out / "config.json").write_text("{}")
    with open(out.parent.parent.parent / "builds.log", "a") as log:
        log.write("built\n")


def _ask(root: str, results) -> None:
    import os

    os.environ["REINFORGE_CACHE"] = root
    results.put(str(cached_entry("entry-v1", _slow_build)))


def test_concurrent_processes_build_an_entry_once_and_all_read_it_whole(tmp_path):
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_ask, args=(str(tmp_path / "cache"), results)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    paths = {results.get() for _ in procs}
    assert paths == {str(tmp_path / "cache" / "entry-v1")}
    assert (tmp_path / "builds.log").read_text() == "built\n"  # one builder
    assert is_complete(tmp_path / "cache" / "entry-v1")
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name != ".locks"] == ["entry-v1"]


def test_a_half_written_entry_is_rebuilt(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REINFORGE_CACHE", str(tmp_path / "cache"))
    entry = tmp_path / "cache" / "entry-v1"
    entry.mkdir(parents=True)
    (entry / "config.json").write_text("{}")  # what a crashed older builder left: no manifest
    assert not is_complete(entry)
    assert cached_entry("entry-v1", _slow_build) == entry
    assert (entry / "weights.bin").stat().st_size == 1000
    assert "incomplete" in capsys.readouterr().err
    # a file truncated after publishing no longer matches its manifest: rebuilt again
    (entry / "weights.bin").write_bytes(b"x" * 10)
    assert not is_complete(entry)
    cached_entry("entry-v1", _slow_build)
    assert (entry / "weights.bin").stat().st_size == 1000
    assert json.loads((entry / MANIFEST).read_text())["files"]["weights.bin"] == 1000


def test_report_shows_every_ranks_error_and_never_reads_markup(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[run]\nmax_steps = 4\n[rollout]\n")
    gloo = (
        "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
        "Read error [127.0.0.1]:7075: Connection reset by peer. [bold]GLHF![/]"
    )
    (run / "error.txt").write_text(f"Traceback (most recent call last):\n{gloo}\n")
    (run / "error.rank1.txt").write_text("Traceback ...\nConfigError: [/x] on rank 1\n")
    (run / "hang.rank2.txt").write_text("reinforge watchdog: no progress in phase 'training'\n")
    report = build_report(run)
    assert report.status == f"failed: {gloo}"
    assert report.rank_errors == [
        ("error.rank1.txt", "ConfigError: [/x] on rank 1"),
        ("hang.rank2.txt", "reinforge watchdog: no progress in phase 'training'"),
    ]
    from reinforge.metrics import console

    with console.capture() as captured:
        print_run_report(report)  # rich would raise MarkupError on "[/__w...]" read as markup
    shown = captured.get()
    assert "[/__w/pytorch" in shown and "[bold]GLHF![/]" in shown and "error.rank1.txt" in shown


def test_a_rank_error_alone_is_the_status(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("[rollout]\n")
    (run / "error.rank1.txt").write_text("boom on rank 1\n")
    assert build_report(run).status == "failed: error.rank1.txt: boom on rank 1"


@pytest.mark.parametrize(
    "codes, failed, verdict",
    [
        ({"rank 0": 3, "rank 1": 3}, True, ExitCode.STOPPED_AFTER_SAVE),
        ({"rank 0": 6, "rank 1": 4}, True, ExitCode.HANG),  # the hang caused the loss
        ({"rank 0": 6, "others": None}, True, ExitCode.PEER_LOST),
        ({"rank 0": 1, "rank 1": 6}, True, ExitCode.RUNTIME_FAILURE),  # the cause, not the echo
        ({"others": None}, True, ExitCode.RUNTIME_FAILURE),  # killed: no code recorded
        ({"rank 0": 3, "others": None}, True, ExitCode.RUNTIME_FAILURE),
        ({"rank 0": 5, "rank 1": 5}, False, ExitCode.NOTHING_TRAINED),
        ({"rank 0": 0, "rank 1": 0}, False, ExitCode.OK),
        ({"rank 0": 2, "rank 1": 1}, True, ExitCode.CONFIG_ERROR),
    ],
)
def test_the_launcher_returns_what_the_workers_decided(codes, failed, verdict):
    assert node_verdict(codes, failed) == verdict


def test_collective_errors_are_read_by_what_happened():
    # texts as gloo and torch raise them (torch 2.13, gloo over TCP)
    lost = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:7075: Connection reset by peer. This is typically caused by a remote "
        "worker hanging or bugs in the application. GLHF!"
    )
    closed = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
        "Connection closed by peer [127.0.0.1]:4321"
    )
    timeout = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:84] "
        "Timed out waiting 30000ms for recv operation to complete"
    )
    mismatch = RuntimeError(
        "[enforce fail at ../third_party/gloo/gloo/allreduce.cc:131] "
        "opts.elements == elements. EnforceNotMet"
    )
    assert [kind_of(e) for e in (lost, closed, timeout, mismatch)] == [
        "lost",
        "lost",
        "timeout",
        "mismatch",
    ]
    assert kind_of(ValueError("Connection reset by peer")) is None  # not from a collective
    assert kind_of(RuntimeError("CUDA out of memory")) is None
