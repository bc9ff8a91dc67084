"""step_timing: before -> after and noop tables (whole outputs; runtime block as `RUNTIME`).

The timer itself (modes, fields, synchronisation, forced toggles) is tested in
test_step_timing.py with the fixture runs; these tables pin down exactly which calls of
the training step the rewrite wraps, where `next_step` goes, and what it leaves alone.
"""

from __future__ import annotations

import pytest
from patch_tables import RUNTIME, assert_patch, assert_refused_beside_others

from patcher.patch import features_from

HEAD = '''import os
import torch

class Hyperparameters:
    iterations = int(os.environ.get("ITERATIONS", 3))

class Loader:
    def __init__(self, device):
        self.device = device

    def next_batch(self, n):
        x = torch.ones(n)
        return x.to(self.device, non_blocking=True), x.to(self.device, non_blocking=True)

'''

PATCHED_HEAD = HEAD.replace("import torch\n", "import torch\n" + RUNTIME).replace(
    '    iterations = int(os.environ.get("ITERATIONS", 3))\n',
    '    iterations = int(os.environ.get("ITERATIONS", 3))\n'
    '    training_timing_breakdown = int(os.environ.get("TRAINING_TIMING_BREAKDOWN", 0))\n'
    '    training_timing_every = int(os.environ.get("TRAINING_TIMING_EVERY", 200))\n',
)

TOGGLES = "Hyperparameters.training_timing_breakdown, Hyperparameters.training_timing_every"
LOGGED = 'f"patch_prefetch training_timing_breakdown:{Hyperparameters.training_timing_breakdown} training_timing_every:{Hyperparameters.training_timing_every}"'

LOG0 = "def log0(msg):\n    print(msg)\n\n"

ONE_LOOP = '''def main(model, optimizers, device):
    train_loader = Loader(device)
    for step in range(Hyperparameters.iterations):
        x, y = train_loader.next_batch(4)
        loss = model(x, y)
        loss.backward()
        for opt in optimizers:
            opt.step()
'''
ONE_LOOP_AFTER = f'''def main(model, optimizers, device):
    log0({LOGGED})
    train_loader = Loader(device)
    for step in range(Hyperparameters.iterations):
        _step_timer.next_step({TOGGLES}, log0)
        x, y = _step_timer.time("batch", lambda: train_loader.next_batch(4))
        loss = _step_timer.time("forward", lambda: model(x, y))
        _step_timer.time("backward", lambda: loss.backward())
        for opt in optimizers:
            _step_timer.time("optimizer", lambda: opt.step())
'''

WARMUP = '''def main(model, optimizers, device):
    def log0(msg):
        print(msg)
    train_loader = Loader(device)
    for warmup_step in range(2):
        x, y = train_loader.next_batch(4)
        warmup_loss = model(x, y)
        warmup_loss.backward()
        for opt in optimizers:
            opt.step()
    for step in range(Hyperparameters.iterations):
        x, y = train_loader.next_batch(4)
        loss = model(x, y)
        loss.backward()
        for opt in optimizers:
            opt.step()
'''
WARMUP_AFTER = f'''def main(model, optimizers, device):
    def log0(msg):
        print(msg)
    log0({LOGGED})
    train_loader = Loader(device)
    for warmup_step in range(2):
        x, y = train_loader.next_batch(4)
        warmup_loss = model(x, y)
        warmup_loss.backward()
        for opt in optimizers:
            opt.step()
    for step in range(Hyperparameters.iterations):
        _step_timer.next_step({TOGGLES}, log0)
        x, y = _step_timer.time("batch", lambda: train_loader.next_batch(4))
        loss = _step_timer.time("forward", lambda: model(x, y))
        _step_timer.time("backward", lambda: loss.backward())
        for opt in optimizers:
            _step_timer.time("optimizer", lambda: opt.step())
'''

MICRO_STEPS = '''def main(model, optimizers, device):
    train_loader = Loader(device)
    step = 0
    while True:
        if step % 2 == 0:
            val_loss = eval_val(model)
        if step == Hyperparameters.iterations:
            break
        for micro_step in range(2):
            x, y = train_loader.next_batch(4)
            with torch.autocast(device_type="cpu", enabled=False):
                loss = model(x, y)
            (loss * 0.5).backward()
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = 0.1
        for opt in optimizers:
            opt.step()
        step += 1
'''
MICRO_STEPS_AFTER = f'''def main(model, optimizers, device):
    log0({LOGGED})
    train_loader = Loader(device)
    step = 0
    while True:
        _step_timer.next_step({TOGGLES}, log0)
        if step % 2 == 0:
            val_loss = _step_timer.time("val", lambda: eval_val(model))
        if step == Hyperparameters.iterations:
            break
        for micro_step in range(2):
            x, y = _step_timer.time("batch", lambda: train_loader.next_batch(4))
            with torch.autocast(device_type="cpu", enabled=False):
                loss = _step_timer.time("forward", lambda: model(x, y))
            _step_timer.time("backward", lambda: (loss * 0.5).backward())
        for opt in optimizers:
            for group in opt.param_groups:
                group["lr"] = 0.1
        for opt in optimizers:
            _step_timer.time("optimizer", lambda: opt.step())
        step += 1
'''

# a step function called by the warm-up and the main loop; its batch carries cu_seqlens too
STEP_FN = '''def log(msg):
    print(msg)

def train_model(h, model, optimizers, device):
    train_loader = Loader(device)
    def step_fn(step):
        for micro_step in range(2):
            x, y, cu = train_loader.next_batch(4)
            loss = model(x, y, cu_seqlens=cu)
            (loss / 2).backward()
        optimizers.step(distributed=False)
    for warmup_step in range(2):
        step_fn(warmup_step)
    step = 0
    while True:
        if step == h.iterations:
            val_loss, val_bpb = eval_val(h, device)
            break
        step_fn(step)
        step += 1
'''
STEP_FN_AFTER = f'''def log(msg):
    print(msg)

def train_model(h, model, optimizers, device):
    log({LOGGED})
    train_loader = Loader(device)
    def step_fn(step):
        for micro_step in range(2):
            x, y, cu = _step_timer.time("batch", lambda: train_loader.next_batch(4))
            loss = _step_timer.time("forward", lambda: model(x, y, cu_seqlens=cu))
            _step_timer.time("backward", lambda: (loss / 2).backward())
        _step_timer.time("optimizer", lambda: optimizers.step(distributed=False))
    for warmup_step in range(2):
        step_fn(warmup_step)
    step = 0
    while True:
        _step_timer.next_step({TOGGLES}, log)
        if step == h.iterations:
            val_loss, val_bpb = _step_timer.time("val", lambda: eval_val(h, device))
            break
        step_fn(step)
        step += 1
'''

MODULE_LOOP = '''train_loader = Loader("cpu")
for step in range(Hyperparameters.iterations):
    x, y = train_loader.next_batch(4)
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    log0(f"step:{step} val_loss:{eval_val(model)}")
'''
MODULE_LOOP_AFTER = f'''log0({LOGGED})
train_loader = Loader("cpu")
for step in range(Hyperparameters.iterations):
    _step_timer.next_step({TOGGLES}, log0)
    x, y = _step_timer.time("batch", lambda: train_loader.next_batch(4))
    loss = _step_timer.time("forward", lambda: model(x, y))
    _step_timer.time("backward", lambda: loss.backward())
    _step_timer.time("optimizer", lambda: optimizer.step())
    log0(f"step:{{step}} val_loss:{{eval_val(model)}}")
'''

MINIFIED = (
    "import os,torch\n"
    "class Hyperparameters():seed=int(os.environ.get('SEED',1));iterations=3\n"
    "class L:\n"
    "\tdef __init__(self,device):self.device=device\n"
    "\tdef next_batch(self,n):x=torch.ones(n);return x.to(self.device),x.to(self.device)\n"
    "def log(msg):print(msg)\n"
    "def main(model,device):\n"
    "\th=Hyperparameters();train_loader=L(device)\n"
)
MINIFIED_AFTER = (
    "import os,torch\n"
    + RUNTIME
    + "class Hyperparameters():seed=int(os.environ.get('SEED',1));iterations=3;training_timing_breakdown=int(os.environ.get('TRAINING_TIMING_BREAKDOWN',0));training_timing_every=int(os.environ.get('TRAINING_TIMING_EVERY',200))\n"
    "class L:\n"
    "\tdef __init__(self,device):self.device=device\n"
    "\tdef next_batch(self,n):x=torch.ones(n);return x.to(self.device),x.to(self.device)\n"
    "def log(msg):print(msg)\n"
    "def main(model,device):\n"
    f"\th=Hyperparameters();log({LOGGED});train_loader=L(device)\n"
)
MINIFIED_LOOP = "\tfor step in range(h.iterations):\n\t\tx,y=train_loader.next_batch(4);loss=model(x,y);loss.backward();optimizer_tok.step();optimizer_muon.step()\n"
MINIFIED_LOOP_AFTER = (
    "\tfor step in range(h.iterations):\n"
    "\t\t_step_timer.next_step(Hyperparameters.training_timing_breakdown,Hyperparameters.training_timing_every,log)\n"
    '\t\tx,y=_step_timer.time("batch",lambda:train_loader.next_batch(4));loss=_step_timer.time("forward",lambda:model(x,y));'
    '_step_timer.time("backward",lambda:loss.backward());_step_timer.time("optimizer",lambda:optimizer_tok.step());'
    '_step_timer.time("optimizer",lambda:optimizer_muon.step())\n'
)
# a second, later training step on a one-line loop: the last complete step is the one timed
MINIFIED_ONE_LINE = "\tfor step in range(2):x,y=train_loader.next_batch(4);loss=model(x,y);loss.backward();opt.step()\n"
MINIFIED_ONE_LINE_AFTER = (
    "\tfor step in range(2):_step_timer.next_step(Hyperparameters.training_timing_breakdown,Hyperparameters.training_timing_every,log);"
    'x,y=_step_timer.time("batch",lambda:train_loader.next_batch(4));loss=_step_timer.time("forward",lambda:model(x,y));'
    '_step_timer.time("backward",lambda:loss.backward());_step_timer.time("optimizer",lambda:opt.step())\n'
)

REWRITES = [
    pytest.param(HEAD + LOG0 + ONE_LOOP, PATCHED_HEAD + LOG0 + ONE_LOOP_AFTER, id="one-loop-every-phase-wrapped"),
    pytest.param(HEAD + WARMUP, PATCHED_HEAD + WARMUP_AFTER, id="warmup-step-untimed-log0-defined-in-main"),
    pytest.param(HEAD + LOG0 + MICRO_STEPS, PATCHED_HEAD + LOG0 + MICRO_STEPS_AFTER, id="micro-steps-autocast-and-validation-in-the-loop"),
    pytest.param(HEAD + STEP_FN, PATCHED_HEAD + STEP_FN_AFTER, id="step-function-timed-from-the-loop-that-calls-it"),
    pytest.param(HEAD + LOG0 + MODULE_LOOP, PATCHED_HEAD + LOG0 + MODULE_LOOP_AFTER, id="module-level-loop-validation-in-an-f-string-untimed"),
    pytest.param(MINIFIED + MINIFIED_LOOP, MINIFIED_AFTER + MINIFIED_LOOP_AFTER, id="minified-one-line-class-two-optimizers"),
    pytest.param(MINIFIED + MINIFIED_LOOP + MINIFIED_ONE_LINE, MINIFIED_AFTER + MINIFIED_LOOP + MINIFIED_ONE_LINE_AFTER, id="minified-last-step-on-a-one-line-loop-timed"),
]


@pytest.mark.parametrize("before, after", REWRITES)
def test_rewrites(before, after):
    result = assert_patch(before, after, only="step_timing")
    assert result.applied == ["step_timing", "env_toggles"]
    compile(result.source, "patched", "exec")


def test_with_the_default_features_the_prefetched_loader_is_timed():
    """`--with step_timing`: the loader prefetched, its copies through `_h2d`, its `next_batch` timed."""
    after = (
        HEAD.replace("import torch\n", "import torch\n" + RUNTIME).replace(
            '    iterations = int(os.environ.get("ITERATIONS", 3))\n',
            '    iterations = int(os.environ.get("ITERATIONS", 3))\n'
            '    train_prefetch = int(os.environ.get("TRAIN_PREFETCH", 1))\n'
            '    train_copy_stream = int(os.environ.get("TRAIN_COPY_STREAM", 1))\n'
            '    training_timing_breakdown = int(os.environ.get("TRAINING_TIMING_BREAKDOWN", 0))\n'
            '    training_timing_every = int(os.environ.get("TRAINING_TIMING_EVERY", 200))\n',
        ).replace(
            "        return x.to(self.device, non_blocking=True), x.to(self.device, non_blocking=True)\n",
            "        return _h2d(x, self.device, Hyperparameters.train_copy_stream), _h2d(x, self.device, Hyperparameters.train_copy_stream)\n",
        )
        + LOG0
        + ONE_LOOP_AFTER.replace(
            "patch_prefetch training_timing_breakdown:",
            "patch_prefetch train_prefetch:{Hyperparameters.train_prefetch} "
            "train_copy_stream:{Hyperparameters.train_copy_stream} training_timing_breakdown:",
        ).replace(
            "    train_loader = Loader(device)\n",
            "    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, "
            "copy_stream=Hyperparameters.train_copy_stream)\n",
        )
    )
    result = assert_patch(HEAD + LOG0 + ONE_LOOP, after, enabled=features_from(None, None, ["step_timing"]))
    assert result.applied == ["train_prefetch", "copy_stream", "step_timing", "env_toggles"]


def test_patched_step_runs_and_logs_its_timing(monkeypatch):
    """The one-loop row patched runs: the runtime it names is there, the step is the same."""
    monkeypatch.setenv("TRAINING_TIMING_BREAKDOWN", "2")  # data wait: no synchronisation, no toggle forced off
    monkeypatch.setenv("TRAINING_TIMING_EVERY", "1")
    result = assert_patch(HEAD + LOG0 + ONE_LOOP, PATCHED_HEAD + LOG0 + ONE_LOOP_AFTER, only="step_timing")
    lines = []
    namespace = {"print": lines.append}
    exec(compile(result.source, "patched", "exec"), namespace)

    class Model:
        def __call__(self, x, y):
            return type("Loss", (), {"backward": lambda loss: lines.append("backward")})()

    class Opt:
        def step(self):
            lines.append("step")

    namespace["main"](Model(), [Opt()], "cpu")
    assert lines[0] == "patch_prefetch training_timing_breakdown:2 training_timing_every:1"
    assert lines[1].startswith("step_timing mode:data_wait every:1")
    assert [line for line in lines if not line.startswith("step_timing ")][1:] == ["backward", "step"] * 3
    assert [line.split()[1] for line in lines if line.startswith("step_timing step:")] == ["step:1", "step:2"]


def test_skipped_env_toggles_leaves_the_script_alone():
    # Module constants or inline defaults are read before the runtime could switch prefetch off.
    assert_patch(HEAD + LOG0 + ONE_LOOP, None, enabled={"step_timing"})


def _one_loop(old: str, new: str) -> str:
    assert old in ONE_LOOP
    return HEAD + LOG0 + ONE_LOOP.replace(old, new)


NOOPS = [
    pytest.param(_one_loop("        loss.backward()\n", "        fitness = loss.item()\n"), id="no-backward-evolution-strategies"),
    pytest.param(_one_loop("opt.step()", "opt.zero_grad()"), id="no-optimizer-step"),
    pytest.param(_one_loop("opt.step()", "scheduler.step()"), id="step-of-a-scheduler-is-not-an-optimizer-step"),
    pytest.param(
        _one_loop("        for opt in optimizers:\n            opt.step()\n", "").replace("        x, y = train_loader", "        for opt in optimizers:\n            opt.step()\n        x, y = train_loader"),
        id="optimizer-step-before-the-batch",
    ),
    pytest.param(_one_loop("loss = model(x, y)", "loss = model(tokens)"), id="forward-does-not-take-the-batch"),
    pytest.param(_one_loop("loss = model(x, y)", "loss = x.mul(y)"), id="method-of-the-batch-is-not-a-forward"),
    pytest.param(_one_loop("x, y = train_loader.next_batch(4)", "x = train_loader.next_batch(4)[0]"), id="batch-not-assigned-directly"),
    pytest.param(_one_loop("x, y = train_loader.next_batch(4)", "x, y = (lambda: train_loader.next_batch(4))()"), id="batch-drawn-inside-a-lambda"),
    pytest.param(
        HEAD + LOG0 + "def main(model, optimizer, device):\n    train_loader = Loader(device)\n    x, y = train_loader.next_batch(4)\n    loss = model(x, y)\n    loss.backward()\n    optimizer.step()\n",
        id="batch-outside-any-loop",
    ),
    pytest.param(HEAD + LOG0 + ONE_LOOP.replace("train_loader", "calib_loader"), id="calibration-loader-only"),
    pytest.param(HEAD + LOG0 + "def main(device):\n    train_loader = Loader(device)\n", id="loader-never-drawn"),
    pytest.param(HEAD + "def show(msg):\n    print(msg)\n\n" + ONE_LOOP, id="no-log-function"),
    pytest.param(HEAD + "def setup():\n    def log0(msg):\n        print(msg)\n    return log0\n\n" + ONE_LOOP, id="log0-defined-in-another-function"),
    pytest.param(
        (HEAD + LOG0 + ONE_LOOP).replace('iterations = int(os.environ.get("ITERATIONS", 3))', "iterations = 3"),
        id="no-env-line-in-hyperparameters-to-copy",
    ),
    pytest.param(
        (HEAD + LOG0 + ONE_LOOP).replace('class Hyperparameters:\n    iterations = int(os.environ.get("ITERATIONS", 3))\n\n', "").replace("Hyperparameters.iterations", "3"),
        id="no-hyperparameters-class",
    ),
    pytest.param(
        "import mlx.core as mx\nclass Loader:\n    def next_batch(self, n):\n        return mx.zeros(n), mx.zeros(n)\n"
        "def log0(msg):\n    print(msg)\n"
        "def main(model, opt):\n    train_loader = Loader()\n    for step in range(3):\n        x, y = train_loader.next_batch(4)\n        loss = model(x, y)\n        loss.backward()\n        opt.step()\n",
        id="mlx-script-no-torch",
    ),
]


@pytest.mark.parametrize("source", NOOPS)
def test_noop(source):
    assert_patch(source, None, only="step_timing")


@pytest.mark.parametrize("source", NOOPS)
def test_noop_beside_every_other_feature(source):
    """Refused with every feature on: the output of every feature but this one."""
    assert_refused_beside_others(source, "step_timing")
