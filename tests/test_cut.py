"""patcher/render/cut.py: the runtime cut to what a script's patch uses.

Two kinds of tests: exact before -> after tables for folding and pruning on small
snippets, and the real templates cut for each combination of options a patch can
pass, executed, and driven against the loader they wrap (same batches, one worker,
stopped at the end). A cut that drops a needed path or keeps a wrong one fails here,
not in a user's run.
"""

from __future__ import annotations

import textwrap
import threading

import libcst as cst
import pytest
import torch

from patcher.render import render
from patcher.render.cut import PASSED, CutError, fold, prune
from patcher.transforms.base import Code


def _fold(code: str, facts: dict) -> str:
    return cst.Module(body=fold(cst.parse_module(textwrap.dedent(code)).body, facts)).code


def _prune(code: str, roots: set[str]) -> str:
    return cst.Module(body=prune(cst.parse_module(textwrap.dedent(code)).body, roots)).code


FOLD_CASES = [
    pytest.param(
        """\
        def make(loader, rollback=False, depth=2):
            return Wrapper(loader, depth, rollback=rollback)
        """,
        {"rollback": False},
        """\
        def make(loader, depth=2):
            return Wrapper(loader, depth)
        """,
        id="parameter-and-keyword-of-a-fact-go",
    ),
    pytest.param(
        """\
        class W:
            def __init__(self, a, rollback=False):
                self.a, self.rollback = a, rollback
                self._rollback = rollback
            def run(self):
                if self._rollback:
                    snap()
                else:
                    plain()
                return snap() if self.rollback else None
        """,
        {"rollback": False},
        """\
        class W:
            def __init__(self, a):
                self.a = a
            def run(self):
                plain()
                return None
        """,
        id="stores-reads-and-branches-of-a-fact",
    ),
    pytest.param(
        """\
        def f(x, workers=1):
            if workers > 1 and not HOOK:
                raise RuntimeError("no")
            kind = HOOK[0] if workers > 1 else Plain
            return kind(x, workers=workers)
        """,
        {"workers": 1, "HOOK": []},
        """\
        def f(x):
            kind = Plain
            return kind(x)
        """,
        id="comparisons-and-an-empty-hook",
    ),
    pytest.param(
        """\
        def stage(item, pin, host_copy=True):
            if not (pin or host_copy):
                return item
            return [stage(t, pin, host_copy) for t in item]
        """,
        {"host_copy": True},
        """\
        def stage(item, pin):
            return [stage(t, pin) for t in item]
        """,
        id="truth-of-or-with-a-pure-read-and-a-positional-argument",
    ),
    pytest.param(
        """\
        def key(self, args):
            if self._reshape_arg is None or self._reshape_arg >= len(args):
                return args
            return args[: self._reshape_arg]
        """,
        {"reshape_arg": None},
        """\
        def key(self, args):
            return args
        """,
        id="code-after-return-is-dead",
    ),
    pytest.param(
        """\
        def f(x, rollback=False):
            return g(x) and rollback
        """,
        {},
        """\
        def f(x, rollback=False):
            return g(x) and rollback
        """,
        id="noop-without-facts",
    ),
    pytest.param(
        """\
        def f(x):
            if g(x) or True:
                pass
            return x.rollback
        """,
        {"rollback": False},
        """\
        def f(x):
            if g(x) or True:
                pass
            return x.rollback
        """,
        id="noop-effects-and-other-objects-attributes-stay",
    ),
    pytest.param(
        """\
        class W:
            def __init__(self, loader, reshape_arg=None):
                self.loader, self.reshape_arg = loader, reshape_arg

            def build(self):
                if self.reshape_arg is not None:
                    return reshape(self.loader.next_batch(), self.reshape_arg)
                else:
                    return stage(self.loader.next_batch())

            def other(self):
                return self.reshape_arg is None or (reshape_arg is None)
        """,
        {"reshape_arg": PASSED},
        """\
        class W:
            def __init__(self, loader, reshape_arg=None):
                self.loader, self.reshape_arg = loader, reshape_arg

            def build(self):
                return reshape(self.loader.next_batch(), self.reshape_arg)

            def other(self):
                return False
        """,
        id="passed-option-tests-against-none-fold-its-reads-parameter-and-store-stay",
    ),
    pytest.param(
        """\
        class W:
            def __init__(self, loader, queue_depth=2):
                self.depth, self.n = max(1, int(queue_depth)), min(len(loader), 3)
                self.limit = max(1, int("2")), max(1, 2, key=abs), max(5)
        """,
        {"queue_depth": 2},
        """\
        class W:
            def __init__(self, loader):
                self.depth, self.n = 2, min(len(loader), 3)
                self.limit = max(1, int("2")), max(1, 2, key=abs), max(5)
        """,
        id="int-max-min-of-integer-literals-evaluated-other-calls-kept",
    ),
    pytest.param(
        """\
        class W:
            def __init__(self, loader, queue_depth=2, copy=True):
                self.depth = queue_depth

        def make(loader, queue_depth=2):
            return W(loader, queue_depth, False)
        """,
        {"queue_depth": 2},
        """\
        class W:
            def __init__(self, loader, copy=True):
                self.depth = 2

        def make(loader):
            return W(loader, False)
        """,
        id="positional-option-in-a-class-call-goes-with-its-init-parameter",
    ),
]


@pytest.mark.parametrize("before, facts, after", FOLD_CASES)
def test_fold(before, facts, after):
    assert _fold(before, facts) == textwrap.dedent(after)


TRAIN = "_make_train_loader"
TOGGLE_ON = Code("Hyperparameters.train_copy_stream")


# What each call passes -> the facts of reshape_arg, host_copy and rollback ("-": none, the code stays).
@pytest.mark.parametrize("calls, facts", [
    pytest.param({}, {"reshape_arg": None, "host_copy": True, "rollback": False}, id="no-call-the-entry-functions-defaults"),
    pytest.param({TRAIN: [{"reshape_arg": 1}] * 2}, {"reshape_arg": PASSED, "host_copy": True, "rollback": False}, id="every-call-a-literal"),
    pytest.param({TRAIN: [{"reshape_arg": 1}, {"queue_depth": 3}]}, {"reshape_arg": "-", "host_copy": True, "rollback": False}, id="one-call-leaves-it-out"),
    pytest.param({TRAIN: [{"reshape_arg": None}]}, {"reshape_arg": "-", "host_copy": True, "rollback": False}, id="passed-as-none"),
    pytest.param({TRAIN: [{"reshape_arg": Code(f"1 if {TOGGLE_ON} else None")}]}, {"reshape_arg": "-", "host_copy": True, "rollback": False}, id="may-be-none"),
    pytest.param({TRAIN: [{"host_copy": False}]}, {"reshape_arg": None, "host_copy": PASSED, "rollback": False}, id="a-literal-false-is-not-none"),
    pytest.param({TRAIN: [{"rollback": TOGGLE_ON}]}, {"reshape_arg": None, "host_copy": True, "rollback": "-"}, id="a-toggle-is-not-a-literal"),
    pytest.param({"_other": [{"reshape_arg": 1}]}, {"reshape_arg": None, "host_copy": True, "rollback": False}, id="not-the-entry-function"),
])
def test_cut_facts_come_from_the_options_each_call_passed(calls, facts):
    found = render.cut_facts(["prefetch_loader"], calls)
    assert {option: found.get(option, "-") for option in facts} == facts


def test_an_option_default_is_the_entry_functions_own():
    assert render.option_default("prefetch_loader", "rollback") == (TRAIN, False)
    assert render.option_default("prefetch_lean", "queue_depth") == (TRAIN, 2)
    with pytest.raises(CutError, match="no single module-level function"):
        render.option_default("prefetch_loader", "no_such_option")


def test_fold_refuses_an_option_passed_with_another_value():
    with pytest.raises(CutError, match="rollback=True"):
        _fold("def f(rollback=False):\n    return g(rollback=True)\n", {"rollback": False})


def test_fold_refuses_an_ambiguous_positional_option():
    code = "class A:\n    def put(self, x, rollback=False):\n        pass\nclass B:\n    def put(self, x):\n        pass\ndef f(q, rollback=False):\n    q.put(1, rollback)\n"
    with pytest.raises(CutError, match="by keyword"):
        _fold(code, {"rollback": False})


PRUNE_CASES = [
    pytest.param(
        """\
        _live = {}
        _unused = 1
        atexit.register(lambda: stop(_live))
        def stop(live):
            pass
        def entry():
            return Loader()
        class Loader:
            close = shutdown = None
            def __init__(self):
                self.q = Queue()
            def next_batch(self):
                return self.q.get()
            def wait_full(self):
                pass
        class Queue:
            def get(self):
                pass
            def qsize(self):
                pass
        def orphan():
            pass
        """,
        {"entry", "next_batch"},
        """\
        _live = {}
        atexit.register(lambda: stop(_live))
        def stop(live):
            pass
        def entry():
            return Loader()
        class Loader:
            def __init__(self):
                self.q = Queue()
            def next_batch(self):
                return self.q.get()
        class Queue:
            def get(self):
                pass
        """,
        id="reachable-definitions-and-members-only",
    ),
]


@pytest.mark.parametrize("before, roots, after", PRUNE_CASES)
def test_prune(before, roots, after):
    assert _prune(before, roots) == textwrap.dedent(after)


# ---------------------------------------------------------------------------
# The real templates, cut and run
# ---------------------------------------------------------------------------


class Stream:
    """A TokenStream-like loader: a position over a fixed token array."""

    def __init__(self, device, n=4000):
        self.tokens = torch.arange(n, dtype=torch.int64) * 7 % 1009
        self.pos = 0
        self.device = device

    def next_batch(self, global_tokens, seq_len):
        k = global_tokens + 1
        if self.pos + k > self.tokens.numel():
            self.pos = 0
        chunk = self.tokens[self.pos : self.pos + k]
        self.pos += global_tokens
        return chunk[:-1].reshape(-1, seq_len).to(self.device), chunk[1:].reshape(-1, seq_len).to(self.device)


def _runtime(templates: list[str], options: dict) -> dict:
    """The runtime a script whose one call passes `options` gets, executed as a module."""
    facts = render.cut_facts(templates, {TRAIN: [options]})
    roots = {"_make_train_loader", "next_batch"} | ({"pos"} if "attrs" in options else set())
    body = render.runtime_block(templates, set(), False, ["TRAIN_PREFETCH"], facts, roots)
    code = cst.Module(body=body).code
    namespace: dict = {"__name__": "cut_runtime"}
    exec(compile(code, "<cut runtime>", "exec"), namespace)
    return namespace


def _threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "train-prefetch" and t.is_alive()]


VARIANTS = [
    pytest.param(["prefetch_loader"], {}, id="lean"),
    pytest.param(["prefetch_loader"], {"host_copy": False}, id="host-copy"),
    pytest.param(["prefetch_loader"], {"reshape_arg": 1}, id="reshape"),
    pytest.param(["prefetch_loader"], {"rollback": True}, id="rollback"),
    pytest.param(["prefetch_loader"], {"attrs": True, "replay": True}, id="attrs"),
]


@pytest.mark.parametrize("templates, options", VARIANTS)
def test_cut_runtime_hands_out_the_loaders_batches(templates, options):
    rt = _runtime(templates, options)
    cpu = torch.device("cpu")
    seq_lens = [8, 8, 16, 16, 16, 8, 8] if "reshape_arg" in options else [8] * 7
    args = [(64, s) for s in seq_lens] * 3
    direct = Stream(cpu)
    want = [direct.next_batch(*a) for a in args]
    first = rt["_make_train_loader"](lambda d: Stream(d), cpu, queue_depth=2, **options)
    for a in args[:3]:
        first.next_batch(*a)
    # The warm-up rebuild: the same variable, built again; the first worker must stop.
    loader = rt["_make_train_loader"](lambda d: Stream(d), cpu, queue_depth=2, **options)
    direct = Stream(cpu)
    want = [direct.next_batch(*a) for a in args]
    if "rollback" in options:
        args = [(64, 8)] * 4 + [(32, 8)] * 3 + [(64, 8)] * 4  # a batch-size switch rolls back
        direct = Stream(cpu)
        want = [direct.next_batch(*a) for a in args]
    for a, w in zip(args, want):
        got = loader.next_batch(*a)
        assert all(torch.equal(g, x) for g, x in zip(got, w))
    assert len(_threads()) == 1
    if "attrs" in options:
        assert loader.pos == direct.pos  # settles where the caller is
    else:
        with pytest.raises(AttributeError):
            loader.pos
    rt["_stop_workers"](list(rt["_running_workers"]), 3)
    assert not _threads()
    assert not rt["_running_workers"]


def test_lean_cut_keeps_no_option_code():
    facts = render.cut_facts(["prefetch_loader"], {TRAIN: [{"prefetch": Code("TRAIN_PREFETCH")}]})
    code = cst.Module(body=render.runtime_block(["prefetch_loader"], set(), False, [], facts, {"_make_train_loader", "next_batch"})).code
    for gone in ("_snapshot", "_SettlingLoader", "reshape", "rollback", '"""', "wait_full", "qsize", "_handed_out", "_rewind", "warnings", "_Built"):
        assert gone not in code, gone
    compile(code, "<lean>", "exec")
