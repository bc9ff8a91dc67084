"""Transform `pinned_staging`: a data generator's own H2D copies made asynchronous through pinned memory.

For a training data generator that is not run ahead because its threads load only
shards (`SiteVerdict.staged`, see `patcher/families/generator.py`; modded-nanogpt's
current `distributed_data_generator`), each `x.to(device, non_blocking=True)` in the
generator (the device and non_blocking only: `families.copies.staged_copies`)
whose target is a device (`copies.DEVICE_TARGET`) becomes `_pinned_h2d(x, device,
staging=<TRAIN_PINNED_STAGING>, copy_stream=<TRAIN_COPY_STREAM>)`, the target passed
as the original passes it (positionally or as `device=`; runtime:
`templates/pinned_staging.py`). A positional target that is not a device literal
(`torch.float16`, another tensor, a name the tool cannot tell) makes the call a cast:
it is left as it is, and a note says so. The generator itself, its shard threads and
the training loop's `.send(...)` stay as they are, so the batches are the original's
and a new batch size takes effect at the batch the original gives it to. On a machine
without CUDA, with the toggle at 0, or for a receiver that is not a plain tensor (a
batch object with its own `.to()`), the call is the original `.to(...)`.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from patcher.families.copies import DEVICE_TARGET, staged_copies
from patcher.transforms.base import Context, Feature, Note, Toggle, replace_nodes

FEATURE = "pinned_staging"


def apply(module: cst.Module, ctx: Context) -> tuple[cst.Module, list[Note]]:
    """Route the staged generators' `.to(device, non_blocking=True)` copies through `_pinned_h2d`."""
    survey = ctx.survey
    if not survey.uses_torch:
        return module, [Note(FEATURE, False, "script does not use torch (MLX or other framework)")]
    verdicts = ctx.verdicts
    staged = [i for i in verdicts.iterators if i.staged]
    if not staged:
        return module, _pinned_already(verdicts) or [Note(FEATURE, False, "no data generator that builds its batches on the training thread while its threads load shards")]
    functions = {f.name.value: f for f in survey.module.body if isinstance(f, cst.FunctionDef)}
    notes, replacements = [], {}
    for name in sorted({i.function for i in staged}, key=lambda n: survey.line_of(functions[n])):
        rewritten, casts = [], []
        for call in staged_copies(functions[name]):
            target = call.args[0]
            if not m.matches(target, DEVICE_TARGET):
                casts.append(Note(FEATURE, False, f"generator {name}: `{module.code_for_node(call)}` left as it is: its target `{module.code_for_node(target.value)}` "
                                  "is not a device literal (a string, torch.device(...) or device=), and a dtype or a tensor there makes it a cast", survey.line_of(call)))
                continue
            device = module.code_for_node(target.value)
            options = {"staging": ctx.toggle_value("TRAIN_PINNED_STAGING"), "copy_stream": ctx.toggle_value("TRAIN_COPY_STREAM") if "copy_stream" in ctx.enabled else False}
            arguments = [module.code_for_node(call.func.value), device if target.keyword is None else f"device={device}"]
            replacements[call] = ctx.runtime_call("_pinned_h2d", arguments, options)
            rewritten.append(call)
        if rewritten:
            lines = ", ".join(str(survey.line_of(c)) for c in rewritten)
            targets = ", ".join(sorted({f"`{i.target}`" for i in verdicts.iterators if i.function == name}))
            notes.append(Note(FEATURE, True, f"generator {name} ({targets}): H2D copies at line {lines} through pinned memory on the copy stream, on the training thread (no producer: see train_prefetch)", survey.line_of(functions[name])))
        notes += casts
    if not replacements:
        return module, notes
    ctx.need("pinned_staging")
    return replace_nodes(module, replacements, ctx), notes


# `t.pin_memory()` or a factory's `pin_memory=True`-style argument.
PINS = m.Call(func=m.Attribute(attr=m.Name("pin_memory"))) | m.Arg(keyword=m.Name("pin_memory"))


def _pinned_already(verdicts) -> list[Note]:
    """Notes for training loaders that build batches ahead on their own threads into
    pinned memory (parameter-golf's `DocumentPackingLoader`): not staged again."""
    notes = []
    for name in sorted({c.class_name for c in verdicts.training_constructions()}):
        cls = verdicts.survey.loader_classes[name]
        if verdicts.prefetches(name) and m.findall(cls.node, PINS):
            notes.append(Note(FEATURE, False, f"{name} pins each batch on its own thread (`.pin_memory()`: torch's caching host allocator reuses those blocks once their copies finish) and its H2D copies, from that pinned memory, are copy_stream's: no pageable copy left to stage", cls.line))
    return notes


TOGGLES = (Toggle("TRAIN_PINNED_STAGING", 1, "a data generator's own H2D copies through pinned memory on the copy stream", position=11),)
UNIT = Feature(FEATURE, apply, order=25, toggles=TOGGLES, runtime={"pinned_staging": ("staging",)}, injected="_pinned_h2d")
