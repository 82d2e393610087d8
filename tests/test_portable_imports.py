"""Windows and macOS: the package imports, and the CPU quickstart path runs, without the Unix-only
standard modules (`resource`, `fcntl`, `termios`, `pwd`, `grp`, ...). Checked here on Linux by
hiding them from reinforge's own imports (a meta-path finder that refuses them when the import
comes from a reinforge module; third-party packages see them as usual, as they would their own
platform's), then importing every module and running a tiny SFT + RL run."""

import subprocess
import sys
import textwrap

from .conftest import REPO, TINY_RUN

HIDDEN = ("resource", "fcntl", "termios", "pwd", "grp", "pty", "tty", "syslog", "crypt", "spwd")

SCRIPT = textwrap.dedent(
    """
    import importlib, pkgutil, sys

    HIDDEN = set(sys.argv[1].split(","))
    # GPU kernels and extras: absent on a CPU-only base install, loaded only where used
    OPTIONAL = {"triton", "pyspiel", "wandb", "fastapi", "uvicorn", "starlette"}

    class Hide:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] not in HIDDEN:
                return None
            frame = sys._getframe(1)
            while frame is not None and frame.f_globals.get("__name__", "").startswith(
                ("importlib", "_frozen_importlib")
            ):
                frame = frame.f_back
            caller = frame.f_globals.get("__name__", "") if frame is not None else ""
            if caller.split(".")[0] == "reinforge":
                raise ImportError(f"{name} is Unix-only (imported by {caller})")
            return None

    for name in HIDDEN:  # imported already by the interpreter's startup: import them afresh
        sys.modules.pop(name, None)
    sys.meta_path.insert(0, Hide())

    import reinforge

    failed = []
    for info in pkgutil.walk_packages(reinforge.__path__, "reinforge."):
        if info.name.endswith("__main__"):  # runs the command line
            continue
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            if e.name.split(".")[0] not in OPTIONAL:
                failed.append(f"{info.name}: {e}")
        except Exception as e:
            failed.append(f"{info.name}: {type(e).__name__}: {e}")
    assert not failed, "\\n".join(failed)
    print("imported", len(list(pkgutil.walk_packages(reinforge.__path__))), "modules")

    from reinforge.cli import main
    code = main(["train", *sys.argv[2:]])
    assert code == 0, code
    print("tiny run: ok")
    """
)


def test_every_module_imports_and_the_cpu_path_runs_without_unix_modules(tmp_path):
    args = [*TINY_RUN, f"run.output_dir={tmp_path}", "run.name=p", "run.max_steps=1", "sft.steps=1"]
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, ",".join(HIDDEN), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "tiny run: ok" in out.stdout
    assert (tmp_path / "p" / "checkpoints" / "step_000001").is_dir()


def test_the_hiding_finder_can_fail(tmp_path):
    """The check sees a Unix-only import at a reinforge module's top."""
    pkg = tmp_path / "reinforge_probe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import fcntl\n")
    script = SCRIPT.split("import reinforge\n")[0].replace('"reinforge"', '"reinforge_probe"')
    out = subprocess.run(
        [sys.executable, "-c", script + "import reinforge_probe\n", ",".join(HIDDEN)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert out.returncode != 0 and "fcntl is Unix-only (imported by reinforge_probe)" in out.stderr
