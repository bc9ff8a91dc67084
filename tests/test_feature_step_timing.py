"""step_timing: before -> after and noop tables (whole outputs; runtime block as `RUNTIME`).

The timer itself (modes, fields, synchronisation, forced toggles) is tested in
test_step_timing.py with the fixture runs; these tables pin down exactly which calls of
the training step the rewrite wraps, where `next_step` goes, and what it leaves alone.
"""

from __future__ import annotations

import pytest
from patch_tables import assert_noop, assert_patch, assert_refused_beside_others, notes_of

from patcher.patch import features_from

HEAD = """import os
import torch

class Hyperparameters:
    iterations = int(os.environ.get("ITERATIONS", 3))

class Loader:
    def __init__(self, device):
        self.device = device

    def next_batch(self, n):
        x = torch.ones(n)
        return x.to(self.device, non_blocking=True), x.to(self.device, non_blocking=True)

"""

LOG0 = "def log0(msg):\n    print(msg)\n\n"

ONE_LOOP = """def main(model, optimizers, device):
    train_loader = Loader(device)
    for step in range(Hyperparameters.iterations):
        x, y = train_loader.next_batch(4)
        loss = model(x, y)
        loss.backward()
        for opt in optimizers:
            opt.step()
"""
ONE_LOOP_AFTER = """\
import os
import torch
#<runtime>

class Hyperparameters:
    iterations = int(os.environ.get("ITERATIONS", 3))
    training_timing_breakdown = int(os.environ.get("TRAINING_TIMING_BREAKDOWN", 0))
    training_timing_every = int(os.environ.get("TRAINING_TIMING_EVERY", 200))

class Loader:
    def __init__(self, device):
        self.device = device

    def next_batch(self, n):
        x = torch.ones(n)
        return x.to(self.device, non_blocking=True), x.to(self.device, non_blocking=True)

def log0(msg):
    print(msg)

def main(model, optimizers, device):
    log0(f"patch_prefetch training_timing_breakdown:{Hyperparameters.training_timing_breakdown} training_timing_every:{Hyperparameters.training_timing_every}")
    train_loader = Loader(device)
    for step in range(Hyperparameters.iterations):
        _step_timer.next_step(Hyperparameters.training_timing_breakdown, Hyperparameters.training_timing_every, log0)
        x, y = _step_timer.time("batch", lambda: train_loader.next_batch(4))
        loss = _step_timer.time("forward", lambda: model(x, y))
        _step_timer.time("backward", lambda: loss.backward())
        for opt in optimizers:
            _step_timer.time("optimizer", lambda: opt.step())
"""

WARMUP = """def main(model, optimizers, device):
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
"""

MICRO_STEPS = """def main(model, optimizers, device):
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
"""

# a step function called by the warm-up and the main loop; its batch carries cu_seqlens too
STEP_FN = """def log(msg):
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
"""

MODULE_LOOP = """train_loader = Loader("cpu")
for step in range(Hyperparameters.iterations):
    x, y = train_loader.next_batch(4)
    loss = model(x, y)
    loss.backward()
    optimizer.step()
    log0(f"step:{step} val_loss:{eval_val(model)}")
"""

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
MINIFIED_LOOP = "\tfor step in range(h.iterations):\n\t\tx,y=train_loader.next_batch(4);loss=model(x,y);loss.backward();optimizer_tok.step();optimizer_muon.step()\n"
# a second, later training step on a one-line loop: the last complete step is the one timed
MINIFIED_ONE_LINE = "\tfor step in range(2):x,y=train_loader.next_batch(4);loss=model(x,y);loss.backward();opt.step()\n"

NO_EVAL = "; no eval_val(...) in the loop, val_ms stays 0"

REWRITES = [
    pytest.param(
        HEAD + LOG0 + ONE_LOOP,
        ONE_LOOP_AFTER,
        (True, "training loop at line 20 timed per step (batch line 21, forward line 22, backward line 23, optimizer line 25), logged through log0" + NO_EVAL, 20),
        id="one-loop-every-phase-wrapped",
    ),
    pytest.param(
        HEAD + WARMUP,
        """\
import os
import torch
#<runtime>

class Hyperparameters:
    iterations = int(os.environ.get("ITERATIONS", 3))
    training_timing_breakdown = int(os.environ.get("TRAINING_TIMING_BREAKDOWN", 0))
    training_timing_every = int(os.environ.get("TRAINING_TIMING_EVERY", 200))

class Loader:
    def __init__(self, device):
        self.device = device

    def next_batch(self, n):
        x = torch.ones(n)
        return x.to(self.device, non_blocking=True), x.to(self.device, non_blocking=True)

def main(model, optimizers, device):
    def log0(msg):
        print(msg)
    log0(f"patch_prefetch training_timing_breakdown:{Hyperparameters.training_timing_breakdown} training_timing_every:{Hyperparameters.training_timing_every}")
    train_loader = Loader(device)
    for warmup_step in range(2):
        x, y = train_loader.next_batch(4)
        warmup_loss = model(x, y)
        warmup_loss.backward()
        for opt in optimizers:
            opt.step()
    for step in range(Hyperparameters.iterations):
        _step_timer.next_step(Hyperparameters.training_timing_breakdown, Hyperparameters.training_timing_every, log0)
        x, y = _step_timer.time("batch", lambda: train_loader.next_batch(4))
        loss = _step_timer.time("forward", lambda: model(x, y))
        _step_timer.time("backward", lambda: loss.backward())
        for opt in optimizers:
            _step_timer.time("optimizer", lambda: opt.step())
""",
        (True, "training loop at line 25 timed per step (batch line 26, forward line 27, backward line 28, optimizer line 30), logged through log0" + NO_EVAL, 25),
        id="warmup-step-untimed-log0-defined-in-main",
    ),
    pytest.param(
        HEAD + LOG0 + MICRO_STEPS,
        """\
import os
import torch
#<runtime>

class Hyperparameters:
    iterations = int(os.environ.get("ITERATIONS", 3))
    training_timing_breakdown = int(os.environ.get("TRAINING_TIMING_BREAKDOWN", 0))
    training_timing_every = int(os.environ.get("TRAINING_TIMING_EVERY", 200))

class Loader:
    def __init__(self, device):
        self.device = device

    def next_batch(self, n):
        x = torch.ones(n)
        return x.to(self.device, non_blocking=True), x.to(self.device, non_blocking=True)

def log0(msg):
    print(msg)

def main(model, optimizers, device):
    log0(f"patch_prefetch training_timing_breakdown:{Hyperparameters.training_timing_breakdown} training_timing_every:{Hyperparameters.training_timing_every}")
    train_loader = Loader(device)
    step = 0
    while True:
        _step_timer.next_step(Hyperparameters.training_timing_breakdown, Hyperparameters.training_timing_every, log0)
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
""",
        (True, "training loop at line 21 timed per step (batch line 27, forward line 29, backward line 30, optimizer line 35, val line 23), logged through log0", 21),
        id="micro-steps-autocast-and-validation-in-the-loop",
    ),
    pytest.param(
        HEAD + STEP_FN,
        """\
import os
import torch
#<runtime>

class Hyperparameters:
    iterations = int(os.environ.get("ITERATIONS", 3))
    training_timing_breakdown = int(os.environ.get("TRAINING_TIMING_BREAKDOWN", 0))
    training_timing_every = int(os.environ.get("TRAINING_TIMING_EVERY", 200))

class Loader:
    def __init__(self, device):
        self.device = device

    def next_batch(self, n):
        x = torch.ones(n)
        return x.to(self.device, non_blocking=True), x.to(self.device, non_blocking=True)

def log(msg):
    print(msg)

def train_model(h, model, optimizers, device):
    log(f"patch_prefetch training_timing_breakdown:{Hyperparameters.training_timing_breakdown} training_timing_every:{Hyperparameters.training_timing_every}")
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
        _step_timer.next_step(Hyperparameters.training_timing_breakdown, Hyperparameters.training_timing_every, log)
        if step == h.iterations:
            val_loss, val_bpb = _step_timer.time("val", lambda: eval_val(h, device))
            break
        step_fn(step)
        step += 1
""",
        (True, "training loop at line 29 timed per step (batch line 22, forward line 23, backward line 24, optimizer line 25, val line 31), logged through log", 29),
        id="step-function-timed-from-the-loop-that-calls-it",
    ),
    pytest.param(
        HEAD + LOG0 + MODULE_LOOP,
        """\
import os
import torch
#<runtime>

class Hyperparameters:
    iterations = int(os.environ.get("ITERATIONS", 3))
    training_timing_breakdown = int(os.environ.get("TRAINING_TIMING_BREAKDOWN", 0))
    training_timing_every = int(os.environ.get("TRAINING_TIMING_EVERY", 200))

class Loader:
    def __init__(self, device):
        self.device = device

    def next_batch(self, n):
        x = torch.ones(n)
        return x.to(self.device, non_blocking=True), x.to(self.device, non_blocking=True)

def log0(msg):
    print(msg)

log0(f"patch_prefetch training_timing_breakdown:{Hyperparameters.training_timing_breakdown} training_timing_every:{Hyperparameters.training_timing_every}")
train_loader = Loader("cpu")
for step in range(Hyperparameters.iterations):
    _step_timer.next_step(Hyperparameters.training_timing_breakdown, Hyperparameters.training_timing_every, log0)
    x, y = _step_timer.time("batch", lambda: train_loader.next_batch(4))
    loss = _step_timer.time("forward", lambda: model(x, y))
    _step_timer.time("backward", lambda: loss.backward())
    _step_timer.time("optimizer", lambda: optimizer.step())
    log0(f"step:{step} val_loss:{eval_val(model)}")
""",
        (True, "training loop at line 19 timed per step (batch line 20, forward line 21, backward line 22, optimizer line 23), logged through log0" + NO_EVAL, 19),
        id="module-level-loop-validation-in-an-f-string-untimed",
    ),
    pytest.param(
        MINIFIED + MINIFIED_LOOP,
        (
            "import os,torch\n"
            "#<runtime>\n"
            "class Hyperparameters():seed=int(os.environ.get('SEED',1));iterations=3;training_timing_breakdown=int(os.environ.get('TRAINING_TIMING_BREAKDOWN',0));training_timing_every=int(os.environ.get('TRAINING_TIMING_EVERY',200))\n"
            "class L:\n"
            "\tdef __init__(self,device):self.device=device\n"
            "\tdef next_batch(self,n):x=torch.ones(n);return x.to(self.device),x.to(self.device)\n"
            "def log(msg):print(msg)\n"
            "def main(model,device):\n"
            '\th=Hyperparameters();log(f"patch_prefetch training_timing_breakdown:{Hyperparameters.training_timing_breakdown} training_timing_every:{Hyperparameters.training_timing_every}");train_loader=L(device)\n'
            "\tfor step in range(h.iterations):\n"
            "\t\t_step_timer.next_step(Hyperparameters.training_timing_breakdown,Hyperparameters.training_timing_every,log)\n"
            '\t\tx,y=_step_timer.time("batch",lambda:train_loader.next_batch(4));loss=_step_timer.time("forward",lambda:model(x,y));'
            '_step_timer.time("backward",lambda:loss.backward());_step_timer.time("optimizer",lambda:optimizer_tok.step());'
            '_step_timer.time("optimizer",lambda:optimizer_muon.step())\n'
        ),
        (True, "training loop at line 9 timed per step (batch line 10, forward line 10, backward line 10, optimizer line 10), logged through log" + NO_EVAL, 9),
        id="minified-one-line-class-two-optimizers",
    ),
    pytest.param(
        MINIFIED + MINIFIED_LOOP + MINIFIED_ONE_LINE,
        (
            "import os,torch\n"
            "#<runtime>\n"
            "class Hyperparameters():seed=int(os.environ.get('SEED',1));iterations=3;training_timing_breakdown=int(os.environ.get('TRAINING_TIMING_BREAKDOWN',0));training_timing_every=int(os.environ.get('TRAINING_TIMING_EVERY',200))\n"
            "class L:\n"
            "\tdef __init__(self,device):self.device=device\n"
            "\tdef next_batch(self,n):x=torch.ones(n);return x.to(self.device),x.to(self.device)\n"
            "def log(msg):print(msg)\n"
            "def main(model,device):\n"
            '\th=Hyperparameters();log(f"patch_prefetch training_timing_breakdown:{Hyperparameters.training_timing_breakdown} training_timing_every:{Hyperparameters.training_timing_every}");train_loader=L(device)\n'
            "\tfor step in range(h.iterations):\n"
            "\t\tx,y=train_loader.next_batch(4);loss=model(x,y);loss.backward();optimizer_tok.step();optimizer_muon.step()\n"
            "\tfor step in range(2):_step_timer.next_step(Hyperparameters.training_timing_breakdown,Hyperparameters.training_timing_every,log);"
            'x,y=_step_timer.time("batch",lambda:train_loader.next_batch(4));loss=_step_timer.time("forward",lambda:model(x,y));'
            '_step_timer.time("backward",lambda:loss.backward());_step_timer.time("optimizer",lambda:opt.step())\n'
        ),
        (True, "training loop at line 11 timed per step (batch line 11, forward line 11, backward line 11, optimizer line 11), logged through log" + NO_EVAL, 11),
        id="minified-last-step-on-a-one-line-loop-timed",
    ),
]


@pytest.mark.parametrize("before, after, note", REWRITES)
def test_rewrites(before, after, note):
    result = assert_patch(before, after, only="step_timing")
    assert result.applied == ["step_timing", "env_toggles"]
    assert notes_of(result, "step_timing") == [note]
    compile(result.source, "patched", "exec")


def test_with_the_default_features_the_prefetched_loader_is_timed():
    """`--with step_timing`: the loader prefetched, its copies through `_h2d`, its `next_batch` timed."""
    after = """\
import os
import torch
#<runtime>

class Hyperparameters:
    iterations = int(os.environ.get("ITERATIONS", 3))
    train_prefetch = int(os.environ.get("TRAIN_PREFETCH", 1))
    train_copy_stream = int(os.environ.get("TRAIN_COPY_STREAM", 1))
    training_timing_breakdown = int(os.environ.get("TRAINING_TIMING_BREAKDOWN", 0))
    training_timing_every = int(os.environ.get("TRAINING_TIMING_EVERY", 200))

class Loader:
    def __init__(self, device):
        self.device = device

    def next_batch(self, n):
        x = torch.ones(n)
        return _h2d(x, self.device, Hyperparameters.train_copy_stream), _h2d(x, self.device, Hyperparameters.train_copy_stream)

def log0(msg):
    print(msg)

def main(model, optimizers, device):
    log0(f"patch_prefetch train_prefetch:{Hyperparameters.train_prefetch} train_copy_stream:{Hyperparameters.train_copy_stream} training_timing_breakdown:{Hyperparameters.training_timing_breakdown} training_timing_every:{Hyperparameters.training_timing_every}")
    train_loader = _make_train_loader(lambda loader_device: Loader(loader_device), device, prefetch=Hyperparameters.train_prefetch, copy_stream=Hyperparameters.train_copy_stream)
    for step in range(Hyperparameters.iterations):
        _step_timer.next_step(Hyperparameters.training_timing_breakdown, Hyperparameters.training_timing_every, log0)
        x, y = _step_timer.time("batch", lambda: train_loader.next_batch(4))
        loss = _step_timer.time("forward", lambda: model(x, y))
        _step_timer.time("backward", lambda: loss.backward())
        for opt in optimizers:
            _step_timer.time("optimizer", lambda: opt.step())
"""
    result = assert_patch(HEAD + LOG0 + ONE_LOOP, after, enabled=features_from(None, None, ["step_timing"]))
    assert result.applied == ["train_prefetch", "copy_stream", "step_timing", "env_toggles"]


def test_patched_step_runs_and_logs_its_timing(monkeypatch):
    """The one-loop row patched runs: the runtime it names is there, the step is the same."""
    monkeypatch.setenv("TRAINING_TIMING_BREAKDOWN", "2")  # data wait: no synchronisation, no toggle forced off
    monkeypatch.setenv("TRAINING_TIMING_EVERY", "1")
    result = assert_patch(HEAD + LOG0 + ONE_LOOP, ONE_LOOP_AFTER, only="step_timing")
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


def test_noop_when_env_toggles_is_off():
    # Module constants or inline defaults are read before the runtime could switch prefetch off.
    assert_noop(HEAD + LOG0 + ONE_LOOP, "env_toggles is off: the timing could not be switched at run time", 20, enabled={"step_timing"}, feature="step_timing")


def _one_loop(old: str, new: str) -> str:
    """The one-loop script with its one `old` text replaced by `new` (what the row changes)."""
    assert ONE_LOOP.count(old) == 1
    return HEAD + LOG0 + ONE_LOOP.replace(old, new)


NO_STEP = "no optimizer step (`for opt in optimizers: opt.step()` or `optimizers.step()`) after the micro-step"
NO_FORWARD = "no forward `loss = model(x, y)` after the batch"
NO_CALL = "no `next_batch` call on the training loader"
NOT_SWITCHABLE = "no Hyperparameters class with an env line to add TRAINING_TIMING_BREAKDOWN to: the timing could not be switched at run time"

NOOPS = [
    pytest.param(_one_loop("        loss.backward()\n", "        fitness = loss.item()\n"), "no `.backward()` after the forward", 21, id="no-backward-evolution-strategies"),
    pytest.param(_one_loop("opt.step()", "opt.zero_grad()"), NO_STEP, 21, id="no-optimizer-step"),
    pytest.param(_one_loop("opt.step()", "scheduler.step()"), NO_STEP, 21, id="step-of-a-scheduler-is-not-an-optimizer-step"),
    pytest.param(
        HEAD
        + LOG0
        + """def main(model, optimizers, device):
    train_loader = Loader(device)
    for step in range(Hyperparameters.iterations):
        for opt in optimizers:
            opt.step()
        x, y = train_loader.next_batch(4)
        loss = model(x, y)
        loss.backward()
""",
        NO_STEP,
        23,
        id="optimizer-step-before-the-batch",
    ),
    pytest.param(_one_loop("loss = model(x, y)", "loss = model(tokens)"), NO_FORWARD, 21, id="forward-does-not-take-the-batch"),
    pytest.param(_one_loop("loss = model(x, y)", "loss = x.mul(y)"), NO_FORWARD, 21, id="method-of-the-batch-is-not-a-forward"),
    pytest.param(
        _one_loop("x, y = train_loader.next_batch(4)", "x = train_loader.next_batch(4)[0]"),
        "the training `next_batch` call is not a plain `x, y = train_loader.next_batch(...)`",
        21,
        id="batch-not-assigned-directly",
    ),
    pytest.param(
        _one_loop("x, y = train_loader.next_batch(4)", "x, y = (lambda: train_loader.next_batch(4))()"),
        "the training `next_batch` call sits in a lambda, class or f-string",
        21,
        id="batch-drawn-inside-a-lambda",
    ),
    pytest.param(
        _one_loop("x, y = train_loader.next_batch(4)", 'x, y = f"{train_loader.next_batch(4)}"'),
        "the training `next_batch` call sits in a lambda, class or f-string",
        21,
        id="batch-drawn-inside-an-f-string",
    ),
    pytest.param(
        HEAD + LOG0 + "def main(model, optimizer, device):\n    train_loader = Loader(device)\n    x, y = train_loader.next_batch(4)\n    loss = model(x, y)\n    loss.backward()\n    optimizer.step()\n",
        "the training `next_batch` call is not inside a training loop",
        20,
        id="batch-outside-any-loop",
    ),
    pytest.param(
        HEAD
        + LOG0
        + """def main(model, optimizers, device):
    calib_loader = Loader(device)
    for step in range(Hyperparameters.iterations):
        x, y = calib_loader.next_batch(4)
        loss = model(x, y)
        loss.backward()
        for opt in optimizers:
            opt.step()
""",
        NO_CALL,
        None,
        id="calibration-loader-only",
    ),
    pytest.param(HEAD + LOG0 + "def main(device):\n    train_loader = Loader(device)\n", NO_CALL, None, id="loader-never-drawn"),
    pytest.param(
        HEAD + "def show(msg):\n    print(msg)\n\n" + ONE_LOOP,
        "no log function (log0, log) visible in the training loop at line 20",
        20,
        id="no-log-function",
    ),
    pytest.param(
        HEAD + "def setup():\n    def log0(msg):\n        print(msg)\n    return log0\n\n" + ONE_LOOP,
        "no log function (log0, log) visible in the training loop at line 22",
        22,
        id="log0-defined-in-another-function",
    ),
    pytest.param(
        """import os
import torch

class Hyperparameters:
    iterations = 3

class Loader:
    def __init__(self, device):
        self.device = device

    def next_batch(self, n):
        x = torch.ones(n)
        return x.to(self.device, non_blocking=True), x.to(self.device, non_blocking=True)

"""
        + LOG0
        + ONE_LOOP,
        NOT_SWITCHABLE,
        20,
        id="no-env-line-in-hyperparameters-to-copy",
    ),
    pytest.param(
        """import os
import torch

class Loader:
    def __init__(self, device):
        self.device = device

    def next_batch(self, n):
        x = torch.ones(n)
        return x.to(self.device, non_blocking=True), x.to(self.device, non_blocking=True)

def log0(msg):
    print(msg)

def main(model, optimizers, device):
    train_loader = Loader(device)
    for step in range(3):
        x, y = train_loader.next_batch(4)
        loss = model(x, y)
        loss.backward()
        for opt in optimizers:
            opt.step()
""",
        NOT_SWITCHABLE,
        17,
        id="no-hyperparameters-class",
    ),
    pytest.param(
        "import mlx.core as mx\nclass Loader:\n    def next_batch(self, n):\n        return mx.zeros(n), mx.zeros(n)\n"
        "def log0(msg):\n    print(msg)\n"
        "def main(model, opt):\n    train_loader = Loader()\n    for step in range(3):\n        x, y = train_loader.next_batch(4)\n        loss = model(x, y)\n        loss.backward()\n        opt.step()\n",
        "script does not use torch (MLX or other framework)",
        None,
        id="mlx-script-no-torch",
    ),
]


@pytest.mark.parametrize("source, reason, line", NOOPS)
def test_noop(source, reason, line):
    assert_noop(source, reason, line, only="step_timing")


@pytest.mark.parametrize("source, reason, line", NOOPS)
def test_noop_beside_every_other_feature(source, reason, line):
    """Refused with every feature on: the output of every feature but this one."""
    assert_refused_beside_others(source, "step_timing")
