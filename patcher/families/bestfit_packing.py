"""Family `bestfit_packing`: nanochat's data-loader module (`nanochat/dataloader.py`), patched as a module.

karpathy/nanochat's `tokenizing_distributed_data_loader_with_state_bos_bestfit(tokenizer,
B, T, split, ..., device="cuda", resume_state_dict=None, ...)` is a generator: it draws
text from an inner generator reading parquet row groups (`_document_batches`), tokenizes
it (`tokenizer.encode(..., num_threads=...)`: the tokenizer has threads of its own),
packs documents by best fit in pure Python, copies the rows into one reused pinned
buffer and that into one reused device buffer (`non_blocking`), and yields views of it
plus the state dict `{pq_idx, rg_idx, epoch}` of that batch. `scripts/base_train.py`
imports it; the module is the file a nanochat user edits, so `patch-prefetch
nanochat/dataloader.py` patches the module (module mode).

Recognised by structure (libcst matchers, `loader_generators`): a module-level
generator function that calls `next()` on a module-level generator reading parquet row
groups (`.read_row_group(...)`), encodes with a tokenizer (`.encode(...)`), allocates a
pinned buffer (`pin_memory=`) and a buffer on its `device` parameter (`device=`), copies
into it with `non_blocking=`, and yields a tuple ending in a dict literal's name (the
state dict). Refused, with the reason: a `*args`/`**kwargs` or positional-only
signature, a device parameter used for more than the final copy (then the packing
itself would differ on the CPU), threads, a global RNG or a torch.distributed
collective in the loader (`generator.unsafe_reason`).

Module mode: the "module" driver's family (`module_sources`, reached through
`registry.module_loaders`), producer `_spawn_generator`, runtime `prefetch_lean` (the process producer, started by spawn).
Rewrite (`train_prefetch`, module mode): the loader's `def name(` becomes `def _original_name(` (nothing else
of it changes) and a new `def name(<the same parameters>)` follows it:
`yield from _spawn_generator(_original_name, {every argument by name}, "<device param>",
prefetch=TRAIN_PREFETCH, split_param="split", train_split="train",
every_split=TRAIN_PREFETCH_EVERY_SPLIT)` (`templates/prefetch_lean.py`: a spawned
process rebuilds the generator from its arguments and sends CPU batches; this process
does the pinned copy and the H2D). The split options are written where the loader
asserts its split parameter's values (`_training_split`): a build for another split (the
val loader nanochat rebuilds at every evaluation) runs the original in the training
process, where a child's start (seconds) would cost more than it gives back;
`TRAIN_PREFETCH_EVERY_SPLIT=1` spawns for every split. Other functions of the module that call `name` (the
`..._bos_bestfit` helper without the state) get the prefetched one.

As a family of generator functions (`recognise`, `refuse`): the inner parquet reader.
A site of it inside a recognised loader is refused (the loader runs whole in the
producer); any other site is judged as the `generator` family judges it and runs
ahead on a thread (its `Plan` names the `generator` family's producer, runtime and driver).
Verify: the "module" driver (`patcher/proof/module_verify.py`) for the module's loaders.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import walk
from patcher.families import generator
from patcher.families.base import SPAWN_GENERATOR, DataVariable, Family, ModuleLoader, Plan

if TYPE_CHECKING:
    from patcher.survey.index import ScriptIndex

READS_ROW_GROUPS = m.Call(func=m.Attribute(attr=m.Name("read_row_group")))
ENCODES = m.Call(func=m.Attribute(attr=m.Name("encode")))
PINNED = m.Call(args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("pin_memory")), m.ZeroOrMore()])
NON_BLOCKING_COPY = m.Call(func=m.Attribute(attr=m.Name("copy_")), args=[m.ZeroOrMore(), m.Arg(keyword=m.Name("non_blocking")), m.ZeroOrMore()])


def reads_row_groups(function: cst.FunctionDef) -> bool:
    """Whether `function` reads parquet row groups (`pf.read_row_group(i)`)."""
    return any(m.matches(n, READS_ROW_GROUPS) for n in walk(function))


def recognise(function: cst.FunctionDef) -> bool:
    """As a generator family: a generator function that reads parquet row groups (the inner reader)."""
    return reads_row_groups(function)


def refuse(site, function: cst.FunctionDef, index) -> str | None:
    """Why the inner reader's site is not run ahead on its own: it is read inside a loader
    generator that runs whole in a spawned producer; elsewhere the `generator` family's rules."""
    top = index.top_of.get(site.node)
    if isinstance(top, cst.FunctionDef):
        # top_of maps every node to its statement: each function once, not once per node
        functions = {id(s): s for s in index.top_of.values() if isinstance(s, cst.FunctionDef)}
        module = cst.Module(body=list(functions.values()))
        found = _judge(top, _reader_names(module))
        if found is not None and found.refusal is None:
            return f"`{site.target}` is read inside {top.name.value}, which runs whole in a spawned producer (module mode)"
    return generator.refuse(site, function, index)


def plan(variable: DataVariable, verdicts) -> Plan:
    """A reader site outside any loader generator: run ahead on a thread, as the `generator`
    family does, with that family's producer, runtime and driver."""
    unit = generator.UNIT
    return replace(generator.plan(variable, verdicts), producer=unit.producer, runtime=unit.runtime, driver=unit.driver)


def loader_generators(module: cst.Module, index: ScriptIndex | None = None) -> list[ModuleLoader]:
    """The module-level loader generators of this family in `module`, each with its device
    parameter, or the reason it is left alone (`split`: `_training_split`).

    index: the survey's `ScriptIndex` of `module`, whose generator functions narrow the
    search to the module-level functions that yield (in their body or in a nested def)
    without walking the others; without it every module-level function is walked."""
    functions = _yielding_functions(module, index)
    readers = {f.name.value for f in functions if reads_row_groups(f)}
    found = []
    for function in functions:
        judged = _judge(function, readers)
        if judged is not None:
            found.append(judged)
    return found


def _yielding_functions(module: cst.Module, index: ScriptIndex | None) -> list[cst.FunctionDef]:
    """The module-level functions of `module` that yield, in source order."""
    functions = [s for s in module.body if isinstance(s, cst.FunctionDef)]
    if index is None:
        return [f for f in functions if _yields(f)]
    yielding = {index.top_of.get(g) for g in index.generator_functions}
    return [f for f in functions if f in yielding]


def _reader_names(module: cst.Module) -> set[str]:
    """Names of the module-level generator functions that read parquet row groups."""
    return {f.name.value for f in _yielding_functions(module, None) if reads_row_groups(f)}


def _yields(function: cst.FunctionDef) -> bool:
    return any(isinstance(n, (cst.Yield)) for n in walk(function))


def _judge(function: cst.FunctionDef, readers: set[str]) -> ModuleLoader | None:
    """The verdict on one module-level function: None when it is not of this shape."""
    nodes = list(walk(function))
    drawn = {
        n.targets[0].target.value
        for n in nodes
        if m.matches(n, m.Assign(targets=[m.AssignTarget(target=m.Name())], value=m.Call(func=m.Name())))
        and n.value.func.value in readers
    }
    shape = (
        _yields(function)
        and drawn
        and any(m.matches(n, m.Call(func=m.Name("next"), args=[m.Arg(value=m.Name())])) and n.args[0].value.value in drawn for n in nodes)
        and any(m.matches(n, ENCODES) for n in nodes)
        and any(m.matches(n, PINNED) for n in nodes)
        and any(m.matches(n, NON_BLOCKING_COPY) for n in nodes)
        and _yields_state(nodes)
    )
    if not shape:
        return None
    params = function.params
    names = [p.name.value for p in params.params + params.kwonly_params]
    devices = sorted({n.value.value for n in nodes if m.matches(n, m.Arg(keyword=m.Name("device"), value=m.Name()))} & set(names))
    if params.posonly_params or isinstance(params.star_arg, cst.Param) or params.star_kwarg is not None:
        return ModuleLoader(function, None, f"{function.name.value} takes *args, **kwargs or positional-only parameters; its arguments cannot be passed by name to a spawned producer")
    if len(devices) != 1:
        return ModuleLoader(function, None, f"{function.name.value} has no single device parameter passed as `device=` to its buffer")
    device = devices[0]
    misuse = _device_misuse(nodes, device)
    if misuse:
        return ModuleLoader(function, device, f"{function.name.value} uses `{device}` {misuse}; built on the CPU in a producer its batches could differ")
    unsafe = generator.unsafe_reason(function)
    if unsafe:
        # the generator family speaks of a thread; here the producer is a spawned process
        return ModuleLoader(function, device, unsafe.replace("a background thread would change the draw order", "a spawned producer draws from its own RNG state"))
    return ModuleLoader(function, device, split=_training_split(nodes, names))


# The split value a training loop builds its long-lived loader with.
TRAINING_SPLIT = "train"


def _training_split(nodes, names: list[str]) -> tuple[str, str] | None:
    """(parameter, "train") where the loader asserts that one of its parameters is one of
    a list or tuple of string literals containing "train" (nanochat: `assert split in
    ["train", "val"]`), else None.

    Why: a training script builds the training loader once and draws from it for the
    whole run, but may build a loader of another split at every evaluation (nanochat's
    `build_val_loader`); a spawned producer's start (importing torch and pyarrow, seconds)
    is paid back only by the long-lived one. The runtime spawns for the training value
    only and runs any other split's build in the training process, as the original."""
    for n in nodes:
        if not m.matches(n, m.Assert(test=m.Comparison(left=m.Name(), comparisons=[m.ComparisonTarget(operator=m.In(), comparator=m.List() | m.Tuple())]))):
            continue
        param = n.test.left.value
        values = [e.value for e in n.test.comparisons[0].comparator.elements]
        if param in names and values and all(isinstance(v, cst.SimpleString) for v in values) and TRAINING_SPLIT in {v.evaluated_value for v in values}:
            return param, TRAINING_SPLIT
    return None


def _yields_state(nodes) -> bool:
    """A `yield a, b, state` whose last element names a dict literal assigned in the function."""
    dicts = {n.targets[0].target.value for n in nodes if m.matches(n, m.Assign(targets=[m.AssignTarget(target=m.Name())], value=m.Dict()))}
    return any(
        m.matches(n, m.Yield(value=m.Tuple())) and m.matches(n.value.elements[-1].value, m.Name()) and n.value.elements[-1].value.value in dicts
        for n in nodes
    )


def _device_misuse(nodes, device: str) -> str | None:
    """How the device parameter is used beyond the final copy, or None.

    Allowed: `device=<param>` (the device buffer), and `flag = <param> == "..."` where
    `flag` is read only as `pin_memory=` / `non_blocking=` / `device=` (pinning and the
    copy's blocking, which change no value)."""
    as_device = {id(n.value) for n in nodes if m.matches(n, m.Arg(keyword=m.Name("device"), value=m.Name(device)))}
    flags, in_flags = set(), set()
    for n in nodes:
        if m.matches(n, m.Assign(targets=[m.AssignTarget(target=m.Name())], value=m.Comparison(left=m.Name(device)))):
            flags.add(n.targets[0].target.value)
            in_flags.add(id(n.value.left))
    flag_uses = {id(n.value) for n in nodes if m.matches(n, m.Arg(keyword=m.Name("pin_memory") | m.Name("non_blocking") | m.Name("device"), value=m.Name()))}
    keywords = {id(n.keyword) for n in nodes if isinstance(n, cst.Arg) and n.keyword is not None}
    for n in nodes:
        if id(n) in keywords:
            continue
        if isinstance(n, cst.Name) and n.value == device and id(n) not in as_device | in_flags and not _is_param_name(n, nodes):
            return "beyond the device buffer's `device=` and a pinning flag"
        if isinstance(n, cst.Name) and n.value in flags and id(n) not in flag_uses and not any(m.matches(a, m.AssignTarget(target=m.Name(n.value))) and a.target is n for a in nodes):
            return f"through `{n.value}` beyond `pin_memory=` / `non_blocking=`"
    return None


def _is_param_name(name: cst.Name, nodes) -> bool:
    return any(isinstance(p, cst.Param) and p.name is name for p in nodes)


UNIT = Family("bestfit_packing", "module", recognise, plan, producer=SPAWN_GENERATOR, runtime="prefetch_lean", order=5, kind="generator", refuse=refuse, module_sources=loader_generators, competition="nanochat")
