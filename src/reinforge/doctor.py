"""`reinforge doctor [CONFIG]`: can this machine run reinforge (and this config)?

Versions, devices, memory, disk, optional parts, a short smoke test (the built-in micro model's
forward, backward and generate on every device), and with a CONFIG its preflight. Prints a
table and a verdict; the command exits non-zero when something required fails.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

OK, WARN, FAIL = "ok", "warn", "FAIL"
MIN_TORCH = (2, 6)


@dataclass
class Check:
    name: str
    value: str
    status: str = OK
    fix: str = ""
    is_config: bool = False  # about the config, not the machine


@dataclass
class DoctorReport:
    checks: list[Check] = field(default_factory=list)

    def add(
        self, name: str, value: str, status: str = OK, fix: str = "", is_config: bool = False
    ) -> None:
        self.checks.append(Check(name, value, status, fix, is_config))

    @property
    def is_ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    @property
    def exit_code(self) -> int:
        """0: ready; 1 (runtime failure): the machine cannot run reinforge; 2 (configuration
        error): it can, but not this config."""
        from reinforge.errors import ExitCode

        failed = [c for c in self.checks if c.status == FAIL]
        if not failed:
            return ExitCode.OK
        if all(c.is_config for c in failed):
            return ExitCode.CONFIG_ERROR
        return ExitCode.RUNTIME_FAILURE


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception:
        return None
    return str(getattr(mod, "__version__", "installed"))


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def check_environment(report: DoctorReport, output_dir: str = ".") -> None:
    py = sys.version_info
    report.add(
        "python", platform.python_version(), OK if py >= (3, 10) else FAIL, "use Python >= 3.10"
    )
    torch_v = _version("torch")
    if torch_v is None:
        report.add("torch", "missing", FAIL, "pip install 'torch>=2.6'")
    else:
        major_minor = tuple(int(x) for x in torch_v.split("+")[0].split(".")[:2])
        report.add(
            "torch", torch_v, OK if major_minor >= MIN_TORCH else FAIL, "pip install 'torch>=2.6'"
        )
    for name, required in (
        ("transformers", True),
        ("tokenizers", True),
        ("safetensors", True),
        ("pydantic", True),
        ("peft", False),
    ):
        v = _version(name)
        status = OK if v else (FAIL if required else WARN)
        report.add(name, v or "missing", status, f"pip install {name}" if not v else "")
    triton = _version("triton")
    if triton or not (torch_v and _has_cuda()):
        report.add("triton", triton or "absent (only GPU runs use it)")
    else:
        report.add(
            "triton", "absent: GPU runs fall back to slow kernels (pip install triton)", WARN
        )
    report.add("cpu", f"{os.cpu_count()} cores, {platform.machine()}")
    try:
        pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        report.add("ram", f"{pages * page_size / 2**30:.1f} GiB")
    except (ValueError, OSError, AttributeError):
        report.add("ram", "unknown", WARN)
    target = Path(output_dir)
    while not target.exists():
        target = target.parent
    free = shutil.disk_usage(target).free / 2**30
    report.add(
        f"free disk at {output_dir}",
        f"{free:.1f} GiB",
        OK if free > 1 else WARN,
        "free some space: checkpoints need room",
    )
    for label, present in (
        ("bubblewrap (sandbox)", shutil.which("bwrap") is not None),
        ("open_spiel (games)", _version("pyspiel") is not None),
        ("math-verify (math rewards)", _version("math_verify") is not None),
        ("tensorboard", _version("tensorboard") is not None),
        ("wandb", _version("wandb") is not None),
    ):
        report.add(label, "present" if present else "absent", OK if present else WARN)


# What each command imports when it runs; a base install (`pip install reinforge`) must load all
# of them but `serve`, whose HTTP layer is the `serve` extra.
COMMAND_MODULES = {
    "train": ("reinforge.train.loop.rl",),
    "sft": ("reinforge.train.loop.sft_run",),
    "eval": ("reinforge.eval.run", "reinforge.eval", "reinforge.server.loading"),
    "export": ("reinforge.export",),
    "report": ("reinforge.report", "reinforge.report.page"),
}


def check_commands(report: DoctorReport) -> None:
    """Each command's modules import here (what `reinforge eval` failing on a base install for
    want of fastapi would have shown); `serve` warns, naming its extra."""
    broken = {}
    for command, modules in COMMAND_MODULES.items():
        for module in modules:
            try:
                importlib.import_module(module)
            except Exception as e:
                broken[command] = f"{module}: {type(e).__name__}: {e}"
                break
    for command, error in broken.items():
        report.add(f"reinforge {command}", error, FAIL, "pip install -e . (reinstall reinforge)")
    if not broken:
        report.add("commands", f"{', '.join(COMMAND_MODULES)} load")
    serve = _version("fastapi") is not None and _version("uvicorn") is not None
    report.add(
        "reinforge serve",
        "fastapi and uvicorn present"
        if serve
        else "fastapi or uvicorn absent (pip install 'reinforge[serve]')",
        OK if serve else WARN,
    )


def check_devices(report: DoctorReport, smoke: bool = True) -> None:
    import torch

    devices = ["cpu"]
    if torch.cuda.is_available():
        report.add("cuda", f"{torch.version.cuda} ({torch.cuda.device_count()} GPU)")
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            bf16 = torch.cuda.is_bf16_supported()
            report.add(
                f"gpu {i}",
                f"{props.name}, {free / 2**30:.1f}/{total / 2**30:.1f} GiB free, "
                f"bf16 {'yes' if bf16 else 'no'}",
            )
            devices.append(f"cuda:{i}")
    else:
        report.add("cuda", "not available (CPU runs work; GPU makes them fast)", WARN)
    if smoke:
        for device in devices:
            report.add(f"smoke {device}", *smoke_test(device))


def smoke_test(device: str) -> tuple[str, str, str]:
    """Forward, backward and a short generate with the built-in micro model."""
    import torch

    from reinforge.engine.base import SamplingParams
    from reinforge.engine.simple import SimpleEngine
    from reinforge.models.loading import load_model, load_tokenizer
    from reinforge.models.tiny import builtin_path

    start = time.perf_counter()
    try:
        path = str(builtin_path("micro", 0))
        dtype = (
            torch.bfloat16
            if device.startswith("cuda") and torch.cuda.is_bf16_supported()
            else torch.float32
        )
        model = load_model(path, torch.device(device), dtype)
        tok = load_tokenizer(path)
        ids = torch.tensor([tok.encode("1+1=")], device=device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss), "non-finite loss"
        out = SimpleEngine(model, tok).generate(
            [ids[0].tolist()], SamplingParams(max_new_tokens=4, ignore_eos=True)
        )
        assert len(out[0][0].token_ids) == 4
    except Exception as e:
        return (
            f"{type(e).__name__}: {e}",
            FAIL,
            "run `reinforge doctor` again after fixing the error above",
        )
    return f"forward+backward+generate in {time.perf_counter() - start:.1f}s", OK, ""


def check_config(
    report: DoctorReport, command: str, config: str | None, overrides: list[str]
) -> None:
    from reinforge.config import ROOTS, load_config
    from reinforge.errors import ConfigError
    from reinforge.preflight import run_preflight

    try:
        cfg = load_config(ROOTS[command], config, overrides)
        pf = run_preflight(cfg)
    except ConfigError as e:
        report.add("config", str(e), FAIL, is_config=True)
        return
    for name, value in pf.rows:
        report.add(f"preflight: {name}", value, is_config=True)
    for warning in pf.warnings:
        report.add("preflight", warning, WARN, is_config=True)
    for error in pf.errors:
        report.add("preflight", error, FAIL, is_config=True)


def output_dir_of(command: str, config: str | None, overrides: list[str]) -> str:
    """Where the config's runs will write (its disk is the one to check); "." without one."""
    from reinforge.config import ROOTS, load_config
    from reinforge.errors import ConfigError

    if config is None and not overrides:
        return "."
    try:
        return load_config(ROOTS[command], config, overrides).run.output_dir
    except ConfigError:
        return "."  # check_config reports it


def run_doctor(
    config: str | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    command: str = "train",
    smoke: bool = True,
) -> DoctorReport:
    report = DoctorReport()
    check_environment(report, output_dir_of(command, config, list(overrides)))
    if not report.is_ok:
        return report  # torch or transformers missing: nothing further can run
    check_commands(report)
    check_devices(report, smoke=smoke)
    if config is not None or overrides:
        check_config(report, command, config, list(overrides))
    return report


def print_report(report: DoctorReport) -> None:
    from rich.table import Table

    from reinforge.metrics import console

    table = Table(title="reinforge doctor")
    for col in ("check", "value", "status"):
        table.add_column(col, overflow="fold")
    style = {OK: "green", WARN: "yellow", FAIL: "bold red"}
    for c in report.checks:
        value = f"{c.value} (fix: {c.fix})" if c.status == FAIL and c.fix else c.value
        table.add_row(c.name, value, f"[{style[c.status]}]{c.status}[/]")
    console.print(table)
    failed = list(dict.fromkeys(c.name for c in report.checks if c.status == FAIL))
    if not failed:
        print("verdict: ready")
    elif report.exit_code == 2:
        print(f"verdict: NOT ready: this machine cannot run this config ({', '.join(failed)})")
    else:
        print(f"verdict: NOT ready: this machine cannot run reinforge ({', '.join(failed)})")
