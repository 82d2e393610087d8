"""The memory plan in preflight: printed by --dry-run, its choices used unless set, and a setting
that cannot fit refused before any model loads."""

from reinforge.errors import ExitCode

from .conftest import TINY_RUN, cli


def test_dry_run_prints_the_memory_plan(tmp_path):
    out = cli("train", *TINY_RUN, "--dry-run", f"run.output_dir={tmp_path}")
    assert out.returncode == ExitCode.OK, out.stderr
    for row in (
        "memory budget",
        "available RAM",
        "micro-batch tokens",
        "gradient checkpointing",
        "plan: weights",
        "plan: activations",
        "plan: peak, training phase",
    ):
        assert row in out.stdout, row
    assert not any(tmp_path.iterdir())


def test_a_micro_batch_shorter_than_a_sequence_is_refused(tmp_path):
    out = cli("train", *TINY_RUN, f"run.output_dir={tmp_path}", "train.micro_batch_tokens=10")
    assert out.returncode == ExitCode.CONFIG_ERROR, out.stdout + out.stderr
    assert "train.micro_batch_tokens = 10 is shorter than one full sequence" in out.stderr
    assert not any(tmp_path.iterdir())


def test_deprecated_micro_batch_size_is_read_as_tokens_and_said_so():
    runs = [x for x in TINY_RUN if not x.startswith("train.micro_batch_tokens")]
    out = cli("train", *runs, "--dry-run", "train.micro_batch_size=2")
    assert out.returncode == ExitCode.OK, out.stderr
    assert "deprecated" in out.stdout
    longest = int(out.stdout.split("longest prompt")[1].split("│")[1].split()[0])
    tokens = int(out.stdout.split("micro-batch tokens")[1].split("│")[1].split()[0])
    assert tokens == 2 * (longest + 4)  # rollout.max_new_tokens = 4 in TINY_RUN
