"""Is it one file? Warnings for code a script needs from other files at run time.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping


import libcst as cst
import libcst.matchers as m
from libcst.metadata import MetadataWrapper, ParentNodeProvider, PositionProvider

from patcher import cst_walk
from patcher.cst_walk import dotted
from patcher.check.compile_check import EMPTY, parse_known


_BOM = "\ufeff"


# --------------------------------------------------------------------------- self-contained

_CODE_EXTS = frozenset({".py", ".pyc", ".pyx", ".so", ".cu", ".cuh", ".cpp", ".cc", ".c", ".h", ".hpp"})
_FILE_ANCHOR = m.Name("__file__") | m.Subscript(
    value=m.Attribute(value=m.Name("sys"), attr=m.Name("argv")),
    slice=[m.SubscriptElement(slice=m.Index(value=m.Integer("0")))],
)
_READ_METHODS = frozenset({"read", "read_text", "read_bytes", "readlines"})


def self_contained_warnings(source: str, path: str | os.PathLike, wrapped: bool = False, known: Mapping[str, cst.Module] = EMPTY) -> list[str]:
    """One-line warnings for code the script needs from other files at run time: the
    texts of `self_contained_findings`."""
    return [text for _, text in self_contained_findings(source, path, wrapped, known)]


def self_contained_findings(source: str, path: str | os.PathLike, wrapped: bool = False, known: Mapping[str, cst.Module] = EMPTY) -> list[tuple[tuple[str, str], str]]:
    """(key, one-line warning) for code the script needs from other files at run time.
    The key, ("imports", module) or ("reads", file), names the finding without its line,
    so that a patched script's warnings can be matched with its original's.

    source: the code (payload for a wrapped script). path: the script's file, whose
    folder is searched for sibling modules. Warns for an import (anywhere in the code)
    of a module that exists beside the script as `<name>.py`, a package or an extension
    module, and for a path built from `__file__` or `sys.argv[0]` that names a code file
    (`.py`, `.so`, `.cu`, ...). Data paths (glob patterns, `.bin`, `data/`) and reading
    the script itself are not warned about. Lines are payload lines when `wrapped`.
    known: as for `_parse`.
    """
    module = parse_known(source[1:] if source.startswith(_BOM) else source, known)
    if module is None:
        return []
    script = Path(path)
    found = _Findings(script.name)
    cst_walk.visit(module, found)
    imports = [(node, name) for node, name in found.imports if _sibling_module(script, name)]
    anchors = found.anchors if found.code_literals else []  # no code-file name, no path to one
    if not imports and not anchors:
        return []
    meta = MetadataWrapper(module, unsafe_skip_copy=True)
    positions = meta.resolve(PositionProvider)
    parents = meta.resolve(ParentNodeProvider)
    where = "payload line" if wrapped else "line"
    out: list[tuple[tuple[str, str], str]] = []
    for node, name in imports:
        sibling = _sibling_module(script, name)
        out.append((("imports", name), (
            f"not self-contained: {where} {positions[node].start.line} imports {name}, "
            f"which is {sibling.name} beside the script; the submission must be one file"
        )))
    for line, target in _file_built_paths(module, anchors, parents, positions, script.name):
        out.append((("reads", target), (
            f"not self-contained: {where} {line} reads {target} through a path built from the "
            f"script's own location; inline it"
        )))
    return list(dict.fromkeys(out))


class _Findings(cst.CSTVisitor):
    """One pass: absolute imports (statement, top-level module name), `__file__` /
    `sys.argv[0]` anchors, and whether any string literal names a code file."""

    def __init__(self, script_name: str):
        self.script_name = script_name
        self.imports: list[tuple[cst.CSTNode, str]] = []
        self.anchors: list[cst.CSTNode] = []
        self.code_literals = False

    def visit_Import(self, node: cst.Import) -> None:
        self.imports.extend((node, dotted(alias.name).split(".")[0]) for alias in node.names)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if not node.relative and node.module is not None:
            self.imports.append((node, dotted(node.module).split(".")[0]))

    def visit_Name(self, node: cst.Name) -> None:
        if node.value == "__file__":
            self.anchors.append(node)

    def visit_Subscript(self, node: cst.Subscript) -> None:
        if m.matches(node, _FILE_ANCHOR):
            self.anchors.append(node)

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        if not self.code_literals:
            self.code_literals = bool(_code_file_names([node], self.script_name))


def _sibling_module(script: Path, name: str) -> Path | None:
    """The file or package beside `script` that `import name` would load, if any."""
    folder = script.parent
    candidates = [folder / f"{name}.py", folder / name / "__init__.py"]
    candidates += sorted(folder.glob(f"{name}.*.so")) + [folder / f"{name}.so"]
    for candidate in candidates:
        if candidate.is_file() and candidate.resolve() != script.resolve():
            return candidate if candidate.name != "__init__.py" else candidate.parent
    return None


def _file_built_paths(module, anchors, parents, positions, script_name: str) -> list[tuple[int, str]]:
    """(line, code file) for each path expression built from the script's location.

    The expression around an anchor is followed up through calls, attributes, operators
    and arguments; names assigned such a path (`here = os.path.dirname(__file__)`) become
    anchors too. String literals naming a code file in it are reported, except the
    argument replaced in `.replace(old, new)` and the script's own name.
    """
    found: list[tuple[int, str]] = []
    seen_names: set[str] = set()
    frontier = list(anchors)
    for _ in range(4):  # names assigned from anchors, a few levels deep
        new_names = []
        for anchor in frontier:
            top = _expression_top(anchor, parents)
            for literal in _code_literals(top, script_name):
                found.append((positions[top].start.line, literal))
            assigned = _assigned_name(top, parents)
            if assigned and assigned not in seen_names and not _is_read(top):
                seen_names.add(assigned)
                new_names.append(assigned)
        if not new_names:
            break
        frontier = [n for n in m.findall(module, m.Name()) if n.value in new_names and not _is_store(n, parents)]
    return list(dict.fromkeys(found))


def _expression_top(node: cst.CSTNode, parents) -> cst.CSTNode:
    """The largest expression around `node`: climbs through calls, attributes, operators,
    arguments and container elements; stops at statements, assignments and with-items."""
    carriers = (cst.BaseExpression, cst.Arg, cst.BaseElement, cst.BaseDictElement, cst.SubscriptElement, cst.BaseSlice)
    top = node
    while isinstance(parents.get(top), carriers):
        top = parents[top]
    return top


def _code_literals(top: cst.CSTNode, script_name: str) -> list[str]:
    """Code-file names among the string literals of a path expression."""
    replaced = {
        id(call.args[0].value)
        for call in m.findall(top, m.Call(func=m.Attribute(attr=m.Name("replace"))))
        if call.args
    }
    return _code_file_names([n for n in m.findall(top, m.SimpleString()) if id(n) not in replaced], script_name)


def _code_file_names(literals, script_name: str) -> list[str]:
    """The values of `literals` that name a code file other than the script itself."""
    out = []
    for node in literals:
        try:
            value = node.evaluated_value
        except Exception:  # an unusual literal (bytes with escapes, ...): not a path
            continue
        if not isinstance(value, str) or _is_data_path(value) or os.path.splitext(value)[1].lower() not in _CODE_EXTS:
            continue
        if os.path.basename(value) != script_name:
            out.append(value)
    return out


def _is_data_path(value: str) -> bool:
    value = value.replace("\\", "/")
    return any(c in value for c in "*?[") or ".bin" in value or "data/" in value


def _assigned_name(top: cst.CSTNode, parents) -> str | None:
    """`x` when `top` is the value of `x = top`."""
    parent = parents.get(top)
    if isinstance(parent, cst.Assign) and len(parent.targets) == 1 and isinstance(parent.targets[0].target, cst.Name):
        return parent.targets[0].target.value
    return None


def _is_read(top: cst.CSTNode) -> bool:
    """`open(...).read()`, `Path(...).read_text()`: a file's contents, not a path."""
    return isinstance(top, cst.Call) and isinstance(top.func, cst.Attribute) and top.func.attr.value in _READ_METHODS


def _is_store(name: cst.Name, parents) -> bool:
    parent = parents.get(name)
    return isinstance(parent, cst.AssignTarget)
