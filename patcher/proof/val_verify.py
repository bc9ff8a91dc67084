"""`verify` for evaluation loops: the patched loop feeds the model the original's (x, y).

For every loop `val_prefetch` rewrote, both scripts' loops are driven outside the
function for one rank: the function's parameters are stand-ins (the Hyperparameters
instance, rank, world size, a CPU device, synthetic validation tokens), the locals the
loop reads are evaluated from their one assignment in the function (the script's own
code), and the loop's own statements run from its first up to the ones that bind `x`
and `y` (the original's slice and `.to(...)`; the patched one's `_val_slice` and
`_val_prefetch`, on its worker thread). Every batch's x and y are compared: dtype,
shape and bytes, in order. The model is never called.
"""

from __future__ import annotations

import contextlib
import types

import libcst as cst
import libcst.matchers as m
import torch

from patcher.cst_walk import dotted_reads as _names_read, walk_own as _walk_own
from patcher.proof.compare import Difference, first_difference
from patcher.proof.data import val_tokens_for
from patcher.proof.harness import HarnessError
from patcher.proof.host_cuda import cuda_on_host, device_for
from patcher.proof.rank_compare import Plan
from patcher.proof.recipes import LoaderRecipe
from patcher.proof.script_eval import evaluate_script_code, survey_of
from patcher.survey.survey import Survey
from patcher.survey.val_survey import ValLoop, find_val_loops


BATCH_NAMES = ("x", "y")


def compare_val_loops(recipe: LoaderRecipe, patched_source: str, load, plan: Plan, seed: int, notes: list[str], edited: bool = False) -> tuple[int, Difference | None]:
    """The (x, y) batches of every evaluation loop val_prefetch rewrote (`edited`: every
    evaluation loop of a hand-edited script, paired by function and order), for every rank.

    load(rank) -> (original module, patched module) as that rank imports them; `plan`
    gives the ranks' Hyperparameters; validation tokens come from `seed`. Returns (batches compared, first difference or None). A loop that cannot be driven
    outside its function is noted, not failed.
    """
    try:
        pairs = val_loop_pairs(recipe.survey, patched_source, edited)
    except HarnessError as error:
        notes.append(f"validation batches not compared: {error}")
        return 0, None
    compared = 0
    for site, patched_survey, patched_function, patched_loop in pairs:
        for rank in range(plan.world_size):
            modules = load(rank)
            hparams = plan.hparams_for(rank)
            tokens = val_tokens_for(hparams, plan.world_size, seed)
            sides = ((recipe.survey, site.function_node, site.loop), (patched_survey, patched_function, patched_loop))

            def batches_of(side: int, host_cuda: bool):
                s, f, loop = sides[side]
                with cuda_on_host(notes) if host_cuda else contextlib.nullcontext():
                    return loop_batches(s, f, loop, function_namespace(modules[side], f, s.module.code_for_node, hparams, rank, plan.world_size, tokens, device_for(host_cuda)))

            phase = f"val:{site.function}"
            try:
                reference, reference_changed = batches_of(0, True)
                # The patched loop on the CUDA path driven with host memory (pinned staging,
                # copy stream), and for rank 0 also on a CPU device.
                runs = [(host_cuda, batches_of(1, host_cuda)) for host_cuda in ((True, False) if rank == 0 else (True,))]
            except Exception as error:  # the script's own code outside its function
                notes.append(f"validation batches of {site.function} (line {site.line}) not compared: {type(error).__name__}: {error}")
                break
            for host_cuda, (batches, changed) in runs:
                where = "the CUDA path (host memory)" if host_cuda else "a CPU device"
                if len(reference) != len(batches):
                    return compared, Difference(rank, phase, min(len(reference), len(batches)), 0, f"{len(reference)} batches vs {len(batches)}", where)
                for n, (expected, candidate) in enumerate(zip(reference, batches)):
                    diff = first_difference(expected, candidate)
                    if diff is not None:
                        return compared, Difference(rank, phase, n, diff[0], diff[1], where)
                if changed is not None and reference_changed is None:
                    return compared, Difference(rank, phase, changed, None, "changed after it was handed out, before the next batch was taken", where)
            compared += len(reference)
        else:
            notes.append(f"validation loop of {site.function} (line {site.line}): x, y of every batch compared on {plan.world_size} ranks, on the CUDA path driven with host memory (rank 0 also on a CPU device)")
    return compared, None


def val_loop_pairs(original: Survey, patched_source: str, edited: bool = False) -> list[tuple[ValLoop, Survey, cst.FunctionDef, cst.For]]:
    """(original loop, patched survey, patched function, patched loop) for each loop the
    patch rewrote; with `edited` (a hand-edited script), the k-th loop of the same
    function that copies a validation slice to the device, whatever its shape.

    Raises HarnessError when the patched script lacks one of them.
    """
    patched = survey_of(patched_source)
    if edited:
        theirs: dict[str, list[ValLoop]] = {}
        for loop in find_val_loops(patched):
            theirs.setdefault(loop.function, []).append(loop)
        pairs, used = [], {}
        for site in (s for s in find_val_loops(original) if s.reason is None):
            index = used.get(site.function, 0)
            if index >= len(theirs.get(site.function, [])):
                raise HarnessError(f"the edited script has no loop {index + 1} copying a validation slice to the device in {site.function}")
            used[site.function] = index + 1
            pairs.append((site, patched, theirs[site.function][index].function_node, theirs[site.function][index].loop))
        return pairs
    functions = {f.name.value: f for f in patched.collector.functions}
    pairs, used = [], {}
    for site in (s for s in find_val_loops(original) if s.reason is None):
        function = functions.get(site.function)
        loops = [n for n in _walk_own(function.body) if isinstance(n, cst.For) and m.findall(n.iter, m.Call(func=m.Name("_val_prefetch")))] if function else []
        index = used.get(site.function, 0)
        if index >= len(loops):
            raise HarnessError(f"the patched script has no rewritten loop {index + 1} in {site.function}")
        used[site.function] = index + 1
        pairs.append((site, patched, function, loops[index]))
    return pairs


def function_namespace(module: types.ModuleType, function: cst.FunctionDef, code_of, hparams, rank: int, world_size: int, val_tokens: torch.Tensor, device: torch.device | None = None) -> dict:
    """The module's globals plus stand-ins for `function`'s parameters, by name (`device`: the CPU unless given)."""
    ns = dict(module.__dict__)
    data = types.SimpleNamespace(val_tokens=val_tokens)
    known = {
        "args": hparams, "h": hparams, "hparams": hparams, "hyperparameters": hparams,
        "rank": rank, "world_size": world_size, "device": device if device is not None else torch.device("cpu"),
        "grad_accum_steps": getattr(hparams, "grad_accum_steps", max(1, 8 // world_size)),
        "val_tokens": val_tokens, "val_data": data,
    }
    params = function.params
    for param in list(params.posonly_params) + list(params.params) + list(params.kwonly_params):
        name = param.name.value
        if name in known:
            ns[name] = known[name]
        elif param.default is not None:
            ns[name] = eval(code_of(param.default), ns)
        else:
            ns[name] = None  # the model and lookup tables: not read by the batch builder
    return ns


def loop_batches(surveyed: Survey, function: cst.FunctionDef, loop: cst.For, ns: dict) -> tuple[list[tuple], int | None]:
    """Run `loop`'s iterable and its simple statements up to those that bind x and y.

    Returns (batches, changed): a private copy of each batch's (x, y) as the loop had it,
    and the index of the first batch whose tensors changed after that (looked at when
    the next batch is taken and after the last: a staging buffer reused too early), or None.

    First the function's statements before the loop run in `ns`, in order (those that
    fail outside the script, e.g. `model.eval()` with no model, are skipped); this
    defines the locals the loop reads and the patched `_val_slice`. A name still
    missing is evaluated from its one assignment. Compound statements inside the loop
    (`if end > n: continue`) are not run: both scripts' batches are compared for every
    start. Raises HarnessError when the loop binds no x and y in its simple statements.
    """
    module = surveyed.module
    scope = surveyed.collector.scope_of[function]
    body = loop.body.body if isinstance(loop.body, cst.IndentedBlock) else [loop.body]
    smalls = [small for stmt in body if isinstance(stmt, (cst.SimpleStatementLine, cst.SimpleStatementSuite)) for small in stmt.body]
    bound, steps, run = set(), [], []
    for small in smalls:
        run.append(small)
        steps.append(module.code_for_node(small.with_changes(semicolon=cst.MaybeSentinel.DEFAULT)))
        bound |= {n.value for t in m.findall(small, m.AssignTarget()) for n in m.findall(t, m.Name())}
        if set(BATCH_NAMES) <= bound:
            break
    if not set(BATCH_NAMES) <= bound:
        raise HarnessError(f"the loop in {function.name.value} binds no x and y in its simple statements")
    _run_before(function.body, loop, ns)
    for name in set(_names_read(loop.iter)) | {n for s in run for n in _names_read(s)}:
        if "." not in name and name not in ns and scope.resolve(name) is scope:
            try:
                evaluate_script_code(surveyed, name, ns, scope)
            except Exception:
                pass  # bound by the loop itself, or not needed for x and y
    target = module.code_for_node(loop.target)
    batches, held, changed = [], None, None
    code = compile("\n".join(steps), "<val loop body>", "exec")
    for item in evaluate_script_code(surveyed, module.code_for_node(loop.iter), ns, scope):
        if held is not None and changed is None and not _same(batches[-1], held):
            changed = len(batches) - 1
        ns["__item"] = item
        exec(f"{target} = __item", ns)
        exec(code, ns)
        held = tuple(ns[name] for name in BATCH_NAMES)
        batches.append(tuple(t.detach().clone() if isinstance(t, torch.Tensor) else t for t in held))
    if held is not None and changed is None and not _same(batches[-1], held):
        changed = len(batches) - 1
    return batches, changed


def _same(copies: tuple, live: tuple) -> bool:
    """True when the live tensors of a batch still hold the bytes of their copies."""
    for a, b in zip(copies, live):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.detach().cpu().contiguous().reshape(-1).view(torch.uint8), b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)):
                return False
    return True


def _run_before(block: cst.BaseSuite, loop: cst.For, ns: dict) -> bool:
    """Run the statements of `block` that come before `loop` (entering the block that holds
    it, such as `with torch.inference_mode():`); True once the loop is reached."""
    statements = block.body if isinstance(block, cst.IndentedBlock) else [block]
    for stmt in statements:
        if stmt is loop:
            return True
        if any(n is loop for n in _walk_own(stmt)):
            inner = getattr(stmt, "body", None)
            return inner is not None and _run_before(inner, loop, ns)
        try:
            exec(compile(cst.Module(body=[stmt.with_changes(leading_lines=[])]).code, "<before val loop>", "exec"), ns)
        except Exception:
            pass  # needs what only the running script has (the model, a process group)
    return False
