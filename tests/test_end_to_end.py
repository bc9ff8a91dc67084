"""Original and patched fixtures train on CPU with bit-identical losses.

Each runnable fixture is patched, then the original and the patched script are run
as subprocesses on the same synthetic shards; every `step:N train_loss:X` line
(full float repr) and the final validation loss must match, with TRAIN_PREFETCH=1
and =0. The runs go in parallel so the whole file stays fast.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from test_fixtures import NOT_RUN as FIXTURES_NOT_RUN, WRAPPED, runnable

from patcher.demo import STEP_LINE
from patcher.families import registry
from patcher.patch import patch_source
from patcher.proof.shards import write_shards
from patcher.read.source import read_script, render

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
# The family fixtures not trained here: test_fixtures' list (stale entries fail there),
# less the one it leaves to this file. Every other family fixture is trained here
# (`registry.UNITS`: a new family's fixture is, with no change to this file).
NOT_RUN = {name: why for name, why in FIXTURES_NOT_RUN.items() if name != "generator_toplevel"}
RUNNABLE = runnable(registry.UNITS, NOT_RUN, others=["curriculum", "batch_switch", "wrapped_lzma_raw", "wrapped_lzma_oneline"])
MODES = {"original": {}, "prefetch_on": {"TRAIN_PREFETCH": "1"}, "prefetch_off": {"TRAIN_PREFETCH": "0"}}


def _run(script: Path, data: Path, env: dict) -> str:
    full = dict(os.environ, DATA_PATH=str(data), OMP_NUM_THREADS="1", **env)
    done = subprocess.run([sys.executable, str(script)], env=full, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{script.name} {env}: {done.stderr[-2000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = tmp_path_factory.mktemp("shards")
    write_shards(data)
    out_dir = tmp_path_factory.mktemp("patched")
    jobs = {}
    for name in RUNNABLE:
        script = read_script(FIXTURES / f"{name}.py")
        patched = out_dir / f"{name}.py"
        patched.write_text(render(script, patch_source(script.source).source))
        # A wrapped fixture's original run is its payload's source run (same bytes, same
        # output: test_fixtures.py::test_wrapped_fixture_matches_source), so it is not run twice.
        if WRAPPED.get(name) not in RUNNABLE:
            jobs[(name, "original")] = (FIXTURES / f"{name}.py", {})
        jobs[(name, "prefetch_on")] = (patched, MODES["prefetch_on"])
        jobs[(name, "prefetch_off")] = (patched, MODES["prefetch_off"])
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {key: pool.submit(_run, path, data, env) for key, (path, env) in jobs.items()}
        done = {key: f.result() for key, f in futures.items()}
    for name in RUNNABLE:
        done.setdefault((name, "original"), done.get((WRAPPED.get(name), "original")))
    return done


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("mode", ["prefetch_on", "prefetch_off"])
def test_losses_bit_identical(runs, name, mode):
    reference = STEP_LINE.findall(runs[(name, "original")])
    patched = STEP_LINE.findall(runs[(name, mode)])
    assert len([l for l in reference if l.startswith("step:")]) >= 20
    assert patched == reference


@pytest.mark.parametrize("name", ["tokenstream_readable", "shuffled_minified"])
def test_patched_run_logs_its_mode(runs, name):
    assert "patch_prefetch train_prefetch:1 train_copy_stream:1" in runs[(name, "prefetch_on")]
    assert "patch_prefetch train_prefetch:0" in runs[(name, "prefetch_off")]
