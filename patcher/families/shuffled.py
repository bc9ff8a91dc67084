"""Family `shuffled`: parameter-golf's `ShuffledSequenceLoader(h, device)` (April records).

Recognised: a loader class named `ShuffledSequenceLoader` that uses no threads
(`next_batch(global_tokens, grad_accum_steps)`, per-rank shards, its own
`np.random.Generator`, a module-level memmap cache). Refusals: those of every loader
rebuilt on the CPU (`loader_plan.py`); the GPTQ calibration loader `calib_loader` is
not the training loader (survey).

Producer: `_make_train_loader`, on the forked producer `prefetch_lean` by default: the
child process runs the script's own `next_batch` at no GIL cost to the training loop,
and every byte counts against the artifact cap. With `--producer-toggles` it runs on
the thread runtime `prefetch_loader` (one worker thread) and, when its `next_batch` is
exactly the known shape (below), the tuning toggle `TRAIN_PREFETCH_NUMPY`: the batch
is planned (the RNG draws, in order) and gathered in numpy
(`templates/shuffled_assembly.py`).
Verify: the "loader_class" driver.

Strict recognition of the `next_batch` whose batches numpy can assemble:
`templates/shuffled_assembly.py` rebuilds one known `next_batch` in two steps (the
RNG draws in their order, then a vectorised gather of the token windows). That is
exact only for that very code, so a class is recognised only when its `next_batch`
is, statement for statement and expression for expression, `SHUFFLED_NEXT_BATCH`
below: formatting, comments, parentheses, `;`-joined lines, one-line suites, type
annotations and a docstring may differ; names, operators, constants and the order of
statements may not. The one free name is the shard getter (`_get_shard_memmap` in the
records), which must be a function defined at module level. The script must import
`numpy as np` and `torch` (the names the pattern uses).

Anything else (an extra statement, another dtype, another draw) is not recognised, and
the prefetch worker calls the script's own `next_batch`; `Recognition.reason` says where
the code first differs.
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass

import libcst as cst

from patcher.cst_walk import small_statements
from patcher.families.base import MAKE_TRAIN_LOADER, DataVariable, Family, Plan
from patcher.families.loader_plan import plan_rebuilt_on_cpu

GETTER = "MEMMAP_GETTER"  # the pattern's placeholder for the shard getter's name

SHUFFLED_NEXT_BATCH = f"""
def next_batch(self, global_tokens, grad_accum_steps):
    device_tokens = global_tokens // (self.world_size * grad_accum_steps)
    device_batch_size = device_tokens // self.seq_len
    remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
    x = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
    y = torch.empty((device_batch_size, self.seq_len), dtype=torch.int64)
    for bi in range(device_batch_size):
        total = remaining.sum()
        if total <= 0:
            for si in range(len(self.files)):
                self._reset_shard(si)
            remaining = np.array([len(s) for s in self.start_inds], dtype=np.float64)
            total = remaining.sum()
        probs = remaining / total
        si = int(self.rng.choice(len(self.files), p=probs))
        start_ind = self.start_inds[si].pop()
        remaining[si] -= 1
        mm = {GETTER}(self.files[si])
        window = torch.as_tensor(np.array(mm[start_ind:start_ind + self.seq_len + 1], dtype=np.int64))
        x[bi] = window[:-1]
        y[bi] = window[1:]
    return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
"""

# Fields that hold only formatting (whitespace, comments, separators, parentheses).
_FORMATTING = {"lpar", "rpar", "leading_lines", "lines_after_decorators", "header", "footer", "indent", "trailing_whitespace", "semicolon", "comma"}


@dataclass
class Recognition:
    """getter: the shard getter's name when recognised, else None; reason: why not; node: where the code first differs."""

    getter: str | None
    reason: str | None = None
    node: cst.CSTNode | None = None

    @property
    def recognised(self) -> bool:
        return self.getter is not None


class _Mismatch(Exception):
    def __init__(self, node, what):
        super().__init__(what)
        self.node, self.what = node, what


def recognise_shuffled(cls: cst.ClassDef, module: cst.Module) -> Recognition:
    """Whether `cls.next_batch` is exactly the known ShuffledSequenceLoader `next_batch`."""
    method = next((s for s in _statements(cls.body) if isinstance(s, cst.FunctionDef) and s.name.value == "next_batch"), None)
    if method is None:
        return Recognition(None, f"{cls.name.value} has no next_batch method")
    if method.decorators or method.asynchronous is not None:
        return Recognition(None, "next_batch is decorated or async", method)
    params = method.params
    if [p.name.value for p in params.params] != ["self", "global_tokens", "grad_accum_steps"] or any(p.default is not None for p in params.params) or params.posonly_params or params.kwonly_params or not isinstance(params.star_arg, cst.MaybeSentinel) or params.star_kwarg is not None:
        return Recognition(None, "next_batch's parameters are not (self, global_tokens, grad_accum_steps)", method)
    missing = [name for name, alias in (("numpy", "np"), ("torch", None)) if not _imports(module, name, alias)]
    if missing:
        return Recognition(None, f"the script does not import {' and '.join(missing)} under the names next_batch uses")
    pattern = cst.parse_module(SHUFFLED_NEXT_BATCH).body[0]
    captured: dict[str, str] = {}
    try:
        _same_suite(pattern.body, method.body, captured)
    except _Mismatch as mismatch:
        return Recognition(None, f"next_batch differs from the known ShuffledSequenceLoader shape ({mismatch.what})", mismatch.node)
    getter = captured[GETTER]
    if not any(isinstance(s, cst.FunctionDef) and s.name.value == getter for s in module.body):
        return Recognition(None, f"the shard getter `{getter}` is not a function defined at module level", method)
    return Recognition(getter)


def _imports(module: cst.Module, name: str, alias: str | None) -> bool:
    """`import name` (or `import name as alias`) among the module's top-level statements."""
    for stmt in module.body:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, cst.Import):
                    for item in small.names:
                        as_name = item.asname.name.value if item.asname is not None else None
                        if cst.Module([]).code_for_node(item.name) == name and as_name == alias:
                            return True
    return False


def _statements(suite) -> list[cst.CSTNode]:
    """The statements of a block, a `;`-joined line counted as its small statements."""
    if isinstance(suite, cst.SimpleStatementSuite):
        return list(suite.body)
    return small_statements(suite.body)


def _without_docstring(statements: list) -> list:
    if statements and isinstance(statements[0], cst.Expr) and isinstance(statements[0].value, (cst.SimpleString, cst.ConcatenatedString)):
        return statements[1:]
    return statements


def _same_suite(pattern, actual, captured) -> None:
    want, got = _statements(pattern), _without_docstring(_statements(actual))
    for index, (p, a) in enumerate(zip(want, got)):
        _same(p, a, captured)
    if len(want) != len(got):
        extra = got[len(want)] if len(got) > len(want) else (got[-1] if got else actual)
        raise _Mismatch(extra, f"{len(got)} statements where the known shape has {len(want)}")


def _same(pattern, actual, captured) -> None:
    """Raise _Mismatch unless `actual` is `pattern` up to formatting."""
    if type(pattern) is not type(actual):
        raise _Mismatch(actual, f"{_describe(actual)} where the known shape has {_describe(pattern)}")
    if isinstance(pattern, cst.Name):
        if pattern.value == GETTER:
            if captured.setdefault(GETTER, actual.value) != actual.value:
                raise _Mismatch(actual, f"`{actual.value}` where the shard getter is `{captured[GETTER]}`")
        elif pattern.value != actual.value:
            raise _Mismatch(actual, f"`{actual.value}` where the known shape has `{pattern.value}`")
        return
    if isinstance(pattern, (cst.Integer, cst.Float, cst.Imaginary)):
        if ast.literal_eval(pattern.value) != ast.literal_eval(actual.value):
            raise _Mismatch(actual, f"{actual.value} where the known shape has {pattern.value}")
        return
    if isinstance(pattern, cst.SimpleString):
        if pattern.evaluated_value != actual.evaluated_value:
            raise _Mismatch(actual, f"{actual.value} where the known shape has {pattern.value}")
        return
    for f in dataclasses.fields(pattern):
        if f.name in _FORMATTING or "whitespace" in f.name:
            continue
        p, a = getattr(pattern, f.name), getattr(actual, f.name)
        if isinstance(p, cst.BaseSuite):
            if not isinstance(a, cst.BaseSuite):
                raise _Mismatch(actual, f"a different {f.name}")
            _same_suite(p, a, captured)
        elif isinstance(p, (list, tuple)):
            if not isinstance(a, (list, tuple)) or len(p) != len(a):
                raise _Mismatch(actual, f"{len(a) if isinstance(a, (list, tuple)) else 'no'} {f.name} where the known shape has {len(p)}")
            for x, y in zip(p, a):
                _same(x, y, captured)
        elif isinstance(p, cst.CSTNode):
            _same(p, a, captured)
        elif p != a and not (isinstance(p, cst.MaybeSentinel) and isinstance(a, cst.MaybeSentinel)):
            raise _Mismatch(actual, f"a different {f.name}")


def _describe(node) -> str:
    if isinstance(node, cst.CSTNode):
        code = cst.Module([]).code_for_node(node).strip().splitlines()
        text = code[0].replace(GETTER, "<shard getter>") if code else ""
        return f"`{text[:60]}`" if text else type(node).__name__
    return repr(node)


def recognise(loader) -> bool:
    """A `ShuffledSequenceLoader` that uses no threads."""
    return not loader.prefetches and loader.name == "ShuffledSequenceLoader"


def plan(variable: DataVariable, ctx) -> Plan:
    """That of every loader rebuilt on the CPU; with the producer toggles, the numpy
    assembly where `next_batch` is the known shape (`recognise_shuffled`)."""
    recognition = recognise_shuffled(variable.loader.node, ctx.survey.module) if ctx.producer_toggles else None
    return plan_rebuilt_on_cpu(variable, ctx, recognition, _assembly_note(variable.loader, recognition, ctx))


def _assembly_note(cls, recognition: Recognition | None, ctx) -> str:
    """What the report says of the numpy assembly ("" without the producer toggles)."""
    if recognition is None:
        return ""
    if recognition.recognised:
        return f"; {cls.name}.next_batch recognised: batches planned in its RNG order and gathered in numpy (TRAIN_PREFETCH_NUMPY)"
    where = f" at line {ctx.survey.line_of(recognition.node)}" if recognition.node is not None else ""
    return f"; numpy assembly not used: {recognition.reason}{where}; the worker calls the script's own next_batch"


UNIT = Family("shuffled", "loader_class", recognise, plan, producer=MAKE_TRAIN_LOADER, runtime="prefetch_lean", order=40)
