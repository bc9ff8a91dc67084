"""The H2D copies of a data generator that pinned staging may rewrite, by shape.

`staged_copies` finds a generator's `x.to(device, non_blocking=True)` calls and
`DEVICE_TARGET` says which target is a device; the `generator` family reads them to
say whether a site is staged (`Family.stages`), the `pinned_staging` transform to
rewrite them. Shapes of code, not a family: kept here so that the transform names no family.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import walk

# `x.to(device, non_blocking=True)` / `x.to(device=device, non_blocking=True)`: an H2D
# copy whose only options are the device and non_blocking (no dtype, copy or format).
H2D_COPY = m.Call(
    func=m.Attribute(attr=m.Name("to")),
    args=[m.Arg(keyword=m.Name("device")) | m.Arg(keyword=None, star=""), m.Arg(keyword=m.Name("non_blocking"), value=m.Name("True"))],
)


# The target of a `.to(..., non_blocking=True)` that is a device, whatever it is called
# on: `device=` (torch's keyword for it; a value that is no device raises in the
# original and in `_pinned_h2d` alike), or positionally a string ("cuda", f"cuda:{rank}")
# or `torch.device(...)`. A positional name or attribute may hold a dtype or a tensor
# (`x.to(torch.float16)`, `x.to(other)`: a cast): not proven a device.
DEVICE_TARGET = m.Arg(keyword=m.Name("device")) | m.Arg(
    keyword=None, value=m.SimpleString() | m.ConcatenatedString() | m.FormattedString() | m.Call(func=m.Attribute(value=m.Name("torch"), attr=m.Name("device")))
)


def staged_copies(function: cst.FunctionDef) -> list[cst.Call]:
    """The `.to(device, non_blocking=True)` calls in `function`, in source order."""
    return [node for node in walk(function) if isinstance(node, cst.Call) and m.matches(node, H2D_COPY)]


def device_copies(function: cst.FunctionDef) -> list[cst.Call]:
    """The `staged_copies` of `function` whose target is a device (`DEVICE_TARGET`): what pinned staging rewrites."""
    return [call for call in staged_copies(function) if m.matches(call.args[0], DEVICE_TARGET)]
