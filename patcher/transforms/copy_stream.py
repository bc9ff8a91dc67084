"""Transform `copy_stream`: the training loader's H2D copies go through `_h2d`.

In the loader class's `next_batch`, each `t.to(self.device, non_blocking=True)`
becomes `_h2d(t, self.device, <TRAIN_COPY_STREAM>)` (runtime:
`templates/copy_stream.py`): on CUDA the copy runs on a dedicated stream, the compute
stream `wait_stream`s on it and `record_stream` guards the result; on the CPU, or
with the toggle off, it is the original call. Applies to loaders that already
prefetch too (their batches still cross H2D on the compute stream). A prefetched data
generator's copies need no rewrite: `_prefetch_iterator` runs the generator on the copy
stream (noted here, switched by the same toggle).
"""

from __future__ import annotations

import libcst as cst

from patcher.transforms.base import Context, Feature, Note, Toggle, replace_nodes

FEATURE = "copy_stream"


def apply(module: cst.Module, ctx: Context) -> tuple[cst.Module, list[Note]]:
    """Route the training loader's `.to(self.device, non_blocking=True)` through `_h2d`."""
    survey = ctx.survey
    if not survey.uses_torch:
        return module, [Note(FEATURE, False, "script does not use torch (MLX or other framework)")]
    verdicts = ctx.verdicts
    classes = {c.class_name for c in verdicts.training_constructions()}
    notes, replacements = [], {}
    if "train_prefetch" in ctx.enabled:
        for site in (i for i in verdicts.iterators if i.training):
            ctx.toggle("TRAIN_COPY_STREAM")
            notes.append(Note(FEATURE, True, f"`{site.target}` (generator {site.function}): its own H2D copies run on the copy stream, on the prefetch thread", site.line))
    if "pinned_staging" in ctx.enabled:
        for site in {i.function: i for i in reversed(verdicts.iterators) if i.staged and i.target.startswith("train")}.values():
            notes.append(Note(FEATURE, True, f"`{site.target}` (generator {site.function}): its own H2D copies run on the copy stream, through pinned staging", site.line))
    if not classes:
        return module, notes or [Note(FEATURE, False, "no training loader construction found")]
    for name in sorted(classes):
        cls = survey.loader_classes[name]
        if cls.device_index is None and cls.cuda_in_next_batch and "train_prefetch" in ctx.enabled and not (verdicts.prefetches(name) or cls.unsafe):
            ctx.toggle("TRAIN_COPY_STREAM")
            notes.append(Note(FEATURE, True, f"{name}.next_batch moves its batch to the GPU itself: those copies run on the copy stream, on the prefetch thread", cls.line))
            continue
        if not cls.h2d_calls:
            notes.append(Note(FEATURE, False, f"{name}.next_batch has no `.to(self.device, non_blocking=True)` copy", cls.line))
            continue
        toggle = ctx.toggle("TRAIN_COPY_STREAM")
        for call in cls.h2d_calls:
            tensor = module.code_for_node(call.func.value)
            device = module.code_for_node(call.args[0].value)
            replacements[call] = ctx.runtime_call("_h2d", [tensor, device, toggle])
        lines = ", ".join(sorted({str(survey.line_of(c)) for c in cls.h2d_calls}, key=int))
        notes.append(Note(FEATURE, True, f"{name}.next_batch H2D at line {lines} on the copy stream", cls.line))
    if replacements:
        ctx.need("copy_stream")
        module = replace_nodes(module, replacements, ctx)
    return module, notes


# after train_prefetch: its notes say which copies the prefetch thread makes
UNIT = Feature(FEATURE, apply, order=20, toggles=(Toggle("TRAIN_COPY_STREAM", 1, "host-to-device copies of training batches on a dedicated CUDA stream", position=2),), runtime={"copy_stream": ()}, injected="_h2d")
