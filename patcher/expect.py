"""What to expect before renting GPUs: one report line per training loader.

For the token loaders of parameter-golf (`tokenstream`, `coprime`, `shuffled`: `x` and `y`
as int64, built in fresh pageable tensors, one `.to(device)` each), the bytes each rank
copies host-to-device per micro-step, read from the script: the `next_batch` call's first
argument as a `Hyperparameters` attribute with an integer env default (`TRAIN_BATCH_TOKENS`,
524,288 in the root script) and `grad_accum_steps = N // world_size` (N = 8 there: a
rank's micro-batch is an eighth of the step's tokens whatever the number of GPUs). Then whether
the copies are pinned, the synchronisations the step loop makes (`.item()`,
`torch.cuda.synchronize()`, each every step or under a condition), and what the premise
measurements imply. For a `DocumentPackingLoader` (pinned by its own thread), what changes.
For modded-nanogpt's generator and nanochat's loader, what was measured on those scripts.

Figures (`PREMISE`): host milliseconds blocked by one copy behind 20 ms of queued
kernels, one H200, 2026-11-27 (docs/measurements.md, bench/results/
gpu_proof_h200_2026-11-27.json). Step times (`STEP_MS`): the public parameter-golf
figures in /docs (649.7 ms a step on 1×H100, 83.5 ms on 8×H100).
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import walk
from patcher.families.verdicts import Verdicts
from patcher.survey.sites import names_other_data

# bytes per copy -> (pageable, pinned) host ms blocked behind 20 ms of queued kernels, one H200
PREMISE = {64 * 1024: (0.069, 0.050), 1 << 20: (0.127, 0.028), 8 << 20: (21.332, 0.035)}
# GPUs -> a parameter-golf step, ms (public: 1×H100 649.7 ms/step; 8×H100 83.5 ms/step)
STEP_MS = {1: 649.7, 8: 83.5}
TOKEN_FAMILIES = {"tokenstream", "coprime", "shuffled"}
SYNC = m.Call(func=m.Attribute(attr=m.Name("item")), args=[]) | m.Call(func=m.Attribute(value=m.Attribute(value=m.Name("torch"), attr=m.Name("cuda")), attr=m.Name("synchronize")))
MEASURED = {
    "generator": "measured on modded-nanogpt's own generator (one H200, 23 ms of queued GPU work): 18.95 ms -> 1.34 ms of host time per `.send()`",
    "bestfit_packing": "measured on nanochat's own loader as base_train calls it (one H200, 60 ms of queued GPU work): 58.73 ms -> 0.88 ms of host time per `next()`",
}


def expectations(verdicts: Verdicts, applied: set[str]) -> list[str]:
    """One line per training loader (construction or generator site) of a known
    family, saying what a GPU run can expect: bytes copied H2D per micro-step per rank,
    pinned or pageable (before and after the patch's `applied` features), the syncs of
    the step loop, and the premise figures. [] for a script with none."""
    survey = verdicts.survey
    lines = []
    seen = set()
    for construction in verdicts.training_constructions():
        family = verdicts.family_of(construction.class_name)
        calls = survey.calls_on(construction)
        if family not in TOKEN_FAMILIES | {"document_packing"} or not calls or construction.target in seen:
            continue
        seen.add(construction.target)
        if family == "document_packing":
            moved = "its H2D copies now on the copy stream" if "copy_stream" in applied else "its H2D copies unchanged"
            lines.append(f"`{construction.target}` ({construction.class_name}): its own thread builds and pins the batches ahead (pinned in the original), {moved}; bytes per micro-step vary with the packing (not read); {_syncs(survey, calls[-1].node)}; run `ab` to know")
            continue
        lines.append(_token_loader_line(survey, construction.target, calls[-1], applied))
    for site in verdicts.iterators:
        if site.target in seen or names_other_data(site.target):
            continue
        seen.add(site.target)
        if site.family == "generator" and applied & {"train_prefetch", "pinned_staging"}:
            uses = [send.node if hasattr(send, "node") else send for send in site.sends]
            syncs = f"; {_syncs(survey, uses[-1])}" if uses else ""
            lines.append(f"`{site.target}` ({site.family}): {MEASURED[site.family]}{syncs}; run `ab` to know")
    if "train_prefetch" in applied:
        from patcher.families.registry import module_loaders

        for loader in module_loaders(survey.module, survey.collector):
            if loader.refusal is None and loader.family is not None and loader.family.name in MEASURED:
                lines.append(f"`{loader.function.name.value}` ({loader.family.name}): {MEASURED[loader.family.name]}; syncs are the training script's (nanochat's base_train: one a step, for its `dt`); run `ab` to know")
    return lines


def _token_loader_line(survey, target: str, call, applied: set[str]) -> str:
    found = _micro_batch_tokens(survey, call)
    syncs = _syncs(survey, call.node)
    after = "pinned, on the copy stream" if "copy_stream" in applied else "pinned" if "train_prefetch" in applied else "pageable"
    if found is None:
        return f"`{target}`: x and y as int64, pageable in the original, {after} patched (bytes per micro-step not read from the script); {syncs}; run `ab` to know"
    tokens, micro = found
    per_copy = tokens * 8
    measured = min((size for size in PREMISE if size >= per_copy), default=max(PREMISE))  # the next size up: an upper figure
    pageable, pinned = PREMISE[measured]
    shares, worst = [], 0.0
    for gpus, step in STEP_MS.items():
        if micro % gpus == 0:
            held = 2 * pageable * (micro // gpus)
            worst = max(worst, 100 * held / step)
            shares.append(f"{held:.2f} ms a step on {gpus} GPU{'s' if gpus > 1 else ''} ({micro // gpus} micro-step{'s' if micro // gpus > 1 else ''}; {100 * held / step:.1f} % of parameter-golf's {step} ms step there)")
    return (
        f"`{target}`: {_size(2 * per_copy)} H2D per micro-step per rank ({tokens:,} tokens, x and y as int64, 2 copies), "
        f"pageable in the original, {after} patched; {syncs}; premise, one H200 behind 20 ms of queued kernels: a "
        f"{_size(measured)} pageable copy blocks the host about {pageable:.2f} ms, a pinned one {pinned:.2f} ms: "
        f"the original's copies hold the host at most {', '.join(shares)}; "
        f"{'expect under 1 % of a step' if worst < 1 else f'expect at most about {worst:.0f} % of a step'}; run `ab` to know"
    )


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n // 1024} KiB"


def _micro_batch_tokens(survey, call) -> tuple[int, int] | None:
    """(tokens of one rank's micro-batch, micro-batches a step across ranks): the call's
    first argument (`args.NAME`) as a Hyperparameters attribute with an integer env
    default, divided by N where the script computes `grad_accum_steps = N // world_size`;
    None where either is missing."""
    from patcher.transforms.env_toggles import env_idiom_call

    hp = survey.hyperparameters
    first = call.node.args[0].value if call.node.args else None
    if hp is None or not isinstance(first, cst.Attribute):
        return None
    name, default = first.attr.value, None
    for node in walk(hp.node.body):
        if isinstance(node, cst.Assign) and len(node.targets) == 1 and m.matches(node.targets[0].target, m.Name(name)):
            found = env_idiom_call(node.value, name)
            default = int(found.args[1].value.evaluated_value) if found is not None else None
    split = m.Assign(targets=[m.AssignTarget(m.Name("grad_accum_steps"))], value=m.BinaryOperation(left=m.Integer(), operator=m.FloorDivide(), right=m.Name("world_size")))
    micro = next((int(n.value.left.evaluated_value) for n in walk(survey.module) if m.matches(n, split)), None)
    return (default // micro, micro) if default is not None and micro else None


def _syncs(survey, node: cst.CSTNode) -> str:
    """The `.item()` / `torch.cuda.synchronize()` calls of the outermost loop around
    `node` in its function (the step loop): how many run every step, how many under a
    condition, with their lines."""
    loop = _outermost_loop(survey.module, node)
    if loop is None:
        return "syncs per step: no step loop around the loader's use found"
    every, some = [], []
    stack = [(loop.body, False)]
    while stack:
        current, conditional = stack.pop()
        if isinstance(current, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            continue
        if m.matches(current, SYNC):
            (some if conditional else every).append(survey.line_of(current))
        inner = conditional or isinstance(current, (cst.If, cst.Try, cst.IfExp, cst.BooleanOperation))
        for child in current.children:
            stack.append((child, inner if child is not getattr(current, "test", None) else conditional))
    said = [f"{len(every)} every step (line {', '.join(map(str, sorted(every)))})" if every else "none every step"]
    if some:
        said.append(f"{len(some)} under a condition (line {', '.join(map(str, sorted(some)))})")
    return f"syncs in the step loop (`.item()`, `torch.cuda.synchronize()`): {', '.join(said)}"


def _outermost_loop(module: cst.Module, node: cst.CSTNode) -> cst.CSTNode | None:
    """The outermost `for`/`while` of the function (or module) holding `node` that contains it."""
    stack = [(module, None)]
    while stack:
        current, outer = stack.pop()
        if current is node:
            return outer
        if isinstance(current, cst.FunctionDef):
            outer = None
        elif isinstance(current, (cst.For, cst.While)) and outer is None:
            outer = current
        stack.extend((child, outer) for child in current.children)
    return None
