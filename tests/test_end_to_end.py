"""Original and patched fixtures train on CPU with bit-identical losses.

Each runnable fixture is patched, then the original and the patched script are run
as subprocesses on the same synthetic shards; every `step:N train_loss:X` line
(full float repr) and the final validation loss must match, with TRAIN_PREFETCH=1,
and with =0 once for each runtime the toggle switches off (`PREFETCH_OFF`). The runs
go in parallel so the whole file stays fast; the original runs are shared with
test_fixtures.py (fixture_training.py).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fixture_training import original_runs, run_env, run_script, shard_dir, workers
from test_fixtures import NOT_RUN as FIXTURES_NOT_RUN, WRAPPED, runnable

from patcher.demo import STEP_LINE
from patcher.families import registry
from patcher.patch import patch_source
from patcher.read.source import read_script, render

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
# The family fixtures not trained here: test_fixtures' list (stale entries fail there),
# less the one it leaves to this file. Every other family fixture is trained here
# (`registry.UNITS`: a new family's fixture is, with no change to this file).
NOT_RUN = {name: why for name, why in FIXTURES_NOT_RUN.items() if name != "generator_toplevel"}
RUNNABLE = runnable(registry.UNITS, NOT_RUN, others=["curriculum", "batch_switch", "wrapped_lzma_raw", "wrapped_lzma_oneline"])
MODES = {"original": {}, "prefetch_on": {"TRAIN_PREFETCH": "1"}, "prefetch_off": {"TRAIN_PREFETCH": "0"}}
# TRAIN_PREFETCH=0 makes the patched construction return the script's own loader,
# `make_loader(device)`, whatever the family: one fixture per runtime that has the
# toggle runs with it off (the process producer; the thread runtime over a loader's
# method and over a generator).
PREFETCH_OFF = ["tokenstream_readable", "curriculum", "generator_toplevel"]


def _run(script: Path, env: dict, workdir: Path) -> str:
    done = run_script(script, env, workdir)
    assert done.returncode == 0, f"{script.name} {env.get('TRAIN_PREFETCH')}: {done.stderr[-2000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def patched_sources() -> dict[str, str]:
    """{fixture: its default patch's source, before rendering (a wrapped fixture's payload)}."""
    return {name: patch_source(read_script(FIXTURES / f"{name}.py").source).source for name in RUNNABLE}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, patched_sources):
    """{(fixture, mode): stdout}. The patched runs train here, on the shards of the original
    runs; those come from fixture_training.py, trained once for this file and test_fixtures.py."""
    data = shard_dir(tmp_path_factory)
    out_dir = tmp_path_factory.mktemp("patched")
    workdir = tmp_path_factory.mktemp("cwd")
    jobs = {}
    for name in RUNNABLE:
        patched = out_dir / f"{name}.py"
        patched.write_text(render(read_script(FIXTURES / f"{name}.py"), patched_sources[name]))
        jobs[(name, "prefetch_on")] = (patched, run_env(data, **MODES["prefetch_on"]))
        if name in PREFETCH_OFF:
            jobs[(name, "prefetch_off")] = (patched, run_env(data, **MODES["prefetch_off"]))
    # The patched runs first: meanwhile the other test worker may train the originals.
    with ThreadPoolExecutor(max_workers=workers()) as pool:
        futures = {key: pool.submit(_run, path, env, workdir) for key, (path, env) in jobs.items()}
        done = {key: f.result() for key, f in futures.items()}
    # A wrapped fixture's original run is its payload's source run (same bytes, same
    # output: test_fixtures.py::test_wrapped_fixture_matches_source), so it is not run twice.
    originals = [name for name in RUNNABLE if WRAPPED.get(name) not in RUNNABLE]
    for (name, _), run in original_runs(tmp_path_factory, [(name, 0) for name in originals]).items():
        assert run.returncode == 0, f"{name}.py: {run.stderr[-2000:]}"
        done[(name, "original")] = run.stdout
    for name in RUNNABLE:
        done.setdefault((name, "original"), done.get((WRAPPED.get(name), "original")))
    return done


@pytest.mark.parametrize("name, mode", [(name, "prefetch_on") for name in RUNNABLE] + [(name, "prefetch_off") for name in PREFETCH_OFF])
def test_losses_bit_identical(runs, name, mode):
    reference = STEP_LINE.findall(runs[(name, "original")])
    patched = STEP_LINE.findall(runs[(name, mode)])
    assert len([l for l in reference if l.startswith("step:")]) >= 20
    assert patched == reference


def test_the_toggle_is_off_in_a_runtime_of_each_kind(patched_sources):
    # Each runtime the toggle switches off is trained with it off: a new runtime's
    # fixture must be named in PREFETCH_OFF.
    kinds = {}
    for name, source in patched_sources.items():
        kind = "generator" if "def _spawn_generator" in source else "thread" if "class _Worker" in source else "process" if "class _PrefetchLoader" in source else None
        kinds.setdefault(kind, set()).add(name)
    assert set(PREFETCH_OFF) <= set(RUNNABLE)
    assert all(names & set(PREFETCH_OFF) for kind, names in kinds.items() if kind), kinds


@pytest.mark.parametrize("name", ["tokenstream_readable", "curriculum"])
def test_patched_run_logs_its_mode(runs, name):
    assert "patch_prefetch train_prefetch:1 train_copy_stream:1" in runs[(name, "prefetch_on")]
    assert "patch_prefetch train_prefetch:0" in runs[(name, "prefetch_off")]
