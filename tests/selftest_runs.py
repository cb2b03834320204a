"""The self-test runs the real-code tests read, each started once per session.

Starting the self-test means importing vLLM 0.30.0 in the probe venv (most of
a run's time), so every run the tests read is made once and shared:

- ``checkpoints``: the synthetic DeepSeek-V4.1 checkpoints (tools/checkpoints.py),
  written once; ``make probe``'s two (``v41``, ``r2``) are read by both
  tests/test_selftest_real.py and tests/test_probe.py.
- ``trees``: the two shadow trees of the installed vLLM, unpatched (the
  self-test member alone) and patched (the whole overlay).
- ``selftest_runs``: every run of ``selftest_argvs``, by name, as a
  ``SelftestRun`` (exit code, stdout, stderr). One interpreter per tree, the
  two side by side: each imports vLLM once and then runs the module as
  ``python -m`` would (``runpy``, ``__name__ == "__main__"``, ``sys.argv``,
  its ``sys.exit``), with the file descriptors 1 and 2 captured per run.
  ``variation_runs`` and ``command_runs`` are its two parts.

A test module uses them with ``pytest_plugins = ["tests.selftest_runs"]``
(not by importing them: pytest rewrites a plugin's asserts only if it
imports it first).
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from builder.probe import SELFTEST_MODULE, TEXT_ONLY, SelftestRun, installed_vllm_dir, selftest_env
from builder.probe_env import shadow_tree
from tools.checkpoints import write_v41_checkpoint

DRIVER_TIMEOUT = 900

# Runs the self-test module once per named argv, in this one interpreter, as `python -m` does:
# a fresh __main__ module each time, sys.argv set, SystemExit turned into the exit code, and
# whatever reaches file descriptors 1 and 2 (vLLM's log handler included) kept per run.
# One JSON line per run goes to the driver's own stdout, kept aside before any run.
_DRIVER = r"""
import json, os, runpy, sys, tempfile, traceback

module, runs = sys.argv[1], json.loads(sys.stdin.read())
report = os.fdopen(os.dup(1), "w")
for name, args in runs.items():
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = [module, *args]
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        out.seek(0)
        err.seek(0)
        row = {"name": name, "code": code, "stdout": out.read().decode(), "stderr": err.read().decode()}
    report.write(json.dumps(row) + "\n")
    report.flush()
"""


def run_in_one_interpreter(python: Path, tree: Path, runs: dict[str, list[str]]) -> dict[str, SelftestRun]:
    """Each of ``runs`` (name: the module's argv) in one ``python`` with ``tree`` first on the path,
    in the environment builder.probe.run_selftest gives each probe arm."""
    env = selftest_env(tree)
    proc = subprocess.run(
        [str(python), "-c", _DRIVER, SELFTEST_MODULE],
        input=json.dumps(runs),
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        timeout=DRIVER_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [row["name"] for row in rows] == list(runs), proc.stderr[-3000:]
    return {row["name"]: SelftestRun(row["code"], row["stdout"], row["stderr"]) for row in rows}


def variation_argvs(ck: dict[str, Path]) -> dict[str, list[str]]:
    """The rank's serve argv of each variation the patched tree is checked on (--static --json)."""
    v41, r2 = str(ck["v41"]), str(ck["r2"])
    sizes = '{"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128]}'
    mtp = '{"method": "mtp", "num_speculative_tokens": 2}'
    return {
        "r2-tp4": [r2, "-tp", "4", *TEXT_ONLY],
        "v41-tp4": [v41, "-tp", "4", *TEXT_ONLY],
        "v41-seqs8": [v41, "-tp", "4", "--max-num-seqs", "8", *TEXT_ONLY],
        "v41-seqs256": [v41, "-tp", "4", "--max-num-seqs", "256", *TEXT_ONLY],
        "v41-seqs8-sizes": [v41, "-tp", "4", "--max-num-seqs", "8", "--compilation-config", sizes, *TEXT_ONLY],
        "v41-seqs8-eager": [v41, "-tp", "4", "--max-num-seqs", "8", "--enforce-eager", *TEXT_ONLY],
        "v41-mtp2": [v41, "-tp", "4", "--speculative-config", mtp, *TEXT_ONLY],
        "r2-tp2": [r2, "-tp", "2", *TEXT_ONLY],
        "r2-tp8": [r2, "-tp", "8", *TEXT_ONLY],
        "r2-tp4-dp2": [r2, "-tp", "4", "-dp", "2", *TEXT_ONLY],
        "r2-h128-tp1": [str(ck["r2-h128"]), "-tp", "1", *TEXT_ONLY],
        "r2-w256": [str(ck["r2-w256"]), "-tp", "4", *TEXT_ONLY],
        "r2-k1024": [str(ck["r2-k1024"]), "-tp", "4", *TEXT_ONLY],
        "r2-vision": [r2, "-tp", "4"],
    }


def command_argvs(ck: dict[str, Path]) -> dict[str, tuple[str, list[str]]]:
    """The module as a command: name -> (tree, its whole argv); text output, not --json."""
    v41 = str(ck["v41"])
    return {
        "unpatched-mm": ("unpatched", ["--static", "--", v41, "-tp", "4"]),
        "patched-no-device": ("patched", ["--", str(ck["r2"]), "-tp", "4", *TEXT_ONLY]),
        "bad-missing-model": ("patched", ["--static", "--", str(ck["missing"]), "-tp", "4"]),
        "bad-no-config": ("patched", ["--static", "--", str(ck["no-config"]), "-tp", "4"]),
        "bad-tp3": ("patched", ["--static", "--", v41, "-tp", "3"]),
        "bad-flag": ("patched", ["--static", "--", v41, "--no-such-flag"]),
    }


def selftest_argvs(ck: dict[str, Path]) -> dict[str, tuple[str, list[str]]]:
    """Every run the tests read: name -> (tree, the module's argv)."""
    runs = {name: ("patched", ["--static", "--json", "--", *argv]) for name, argv in variation_argvs(ck).items()}
    runs.update(command_argvs(ck))
    return runs


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    empty = root / "no-config"
    empty.mkdir()
    return {
        # compress_ratios 0/1/2: a ratio-1 layer has a compressed page of 128 // 1 (make probe's first)
        "v41": write_v41_checkpoint(root / "v41"),
        # compressed layers all ratio 2 (page 64), window 128 (make probe's second)
        "r2": write_v41_checkpoint(root / "r2", compress_ratios=(0, 2, 2)),
        "r2-h128": write_v41_checkpoint(root / "r2-h128", compress_ratios=(0, 2, 2), heads=128),
        "r2-w256": write_v41_checkpoint(root / "r2-w256", compress_ratios=(0, 2, 2), sliding_window=256),
        "r2-k1024": write_v41_checkpoint(root / "r2-k1024", compress_ratios=(0, 2, 2), index_topk=1024),
        "no-config": empty,
        "missing": root / "does-not-exist",
    }


@pytest.fixture(scope="session")
def installed_vllm(probe_python) -> Path:
    path = installed_vllm_dir(probe_python)
    assert (path / "__init__.py").is_file()
    return path


@pytest.fixture(scope="session")
def trees(installed_vllm, overlay_files, tmp_path_factory) -> dict[str, Path]:
    return {
        name: shadow_tree(installed_vllm, overlay_files[files], tmp_path_factory.mktemp(f"shadow-{name}"))
        for name, files in (("unpatched", "selftest-only"), ("patched", "patched"))
    }


@pytest.fixture(scope="session")
def selftest_runs(probe_python, trees, checkpoints) -> dict[str, SelftestRun]:
    """Every run of selftest_argvs, by name: one interpreter (one vLLM import) per tree."""
    runs = selftest_argvs(checkpoints)
    by_tree = {
        tree: {name: argv for name, (t, argv) in runs.items() if t == tree}
        for tree in sorted({t for t, _ in runs.values()})
    }
    with ThreadPoolExecutor(max_workers=len(by_tree)) as pool:  # each ~one core
        futures = [pool.submit(run_in_one_interpreter, probe_python, trees[t], r) for t, r in by_tree.items()]
        done = {name: run for f in futures for name, run in f.result().items()}
    assert sorted(done) == sorted(runs)
    for name, run in done.items():  # one run's output, whole: no line of another run's, none lost
        verdicts = [line for line in run.stdout.splitlines() if line.startswith(("SELFTEST PASS", "SELFTEST FAIL"))]
        assert verdicts == [run.verdict], (name, verdicts)
    return done


@pytest.fixture(scope="session")
def variation_runs(selftest_runs, checkpoints) -> dict[str, SelftestRun]:
    """The argv variations (variation_argvs) on the patched tree, --static --json."""
    return {name: selftest_runs[name] for name in variation_argvs(checkpoints)}


@pytest.fixture(scope="session")
def command_runs(selftest_runs, checkpoints) -> dict[str, SelftestRun]:
    """The module as a command (command_argvs): exit codes, no device, bad argv, text output."""
    return {name: selftest_runs[name] for name in command_argvs(checkpoints)}
