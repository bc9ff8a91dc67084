"""Transform `py310_fstrings`: PEP 701 f-strings rewritten so Python 3.10 compiles them.

Python 3.12 (PEP 701) lets a replacement field reuse the f-string's own quote,
`f"{", ".join(xs)}"`; Python 3.10 and 3.11 stop at the inner quote. Five of the seven
wrapped parameter-golf leaderboard scripts do this inside their lzma payload, where
`py_compile` and ruff on the wrapper cannot see it. The rewrite changes quoting only:
the string literals (and nested f-strings) inside the replacement fields take the
other quote, `f"{', '.join(xs)}"`. Where one of them would need an escape in that
quote there is no 3.10 spelling without restructuring the code, and the site is
reported instead.

Backslashes, comments and line breaks inside a replacement field (also 3.12-only) cannot be fixed by
quoting; they are reported with their line and the output is not written.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from patcher.families import registry
from patcher.survey.survey import Survey
from patcher.transforms.base import Context, Feature, Note, replace_nodes

FEATURE = "py310_fstrings"


UNFIXABLE = {
    "backslash": "backslash inside a replacement field (PEP 701, Python 3.12+)",
    "comment": "comment inside a replacement field (PEP 701, Python 3.12+)",
    "newline": "line break inside a replacement field of a single-quoted f-string (PEP 701, Python 3.12+)",
}


class Unfixable(Exception):
    """A 3.12-only f-string form that quoting cannot fix (message names the form)."""


def apply(module: cst.Module, ctx: Context) -> tuple[cst.Module, list[Note]]:
    """Rewrite each PEP 701 f-string `find_pep701_fstrings` found."""
    sites = ctx.facts[FEATURE]
    if not sites:
        return module, [Note(FEATURE, False, "no Python 3.12-only f-string")]
    replacements, notes = {}, []
    for node in sites:
        line = ctx.survey.line_of(node)
        try:
            replacements[node] = rewrite(node, ctx.survey.module)
        except Unfixable as error:
            notes.append(Note(FEATURE, False, f"cannot rewrite for Python 3.10: {error}", line, unfixable=True))
            continue
        notes.append(Note(FEATURE, True, "nested same-quote f-string (PEP 701) requoted for Python 3.10", line))
    module = replace_nodes(module, replacements, ctx)
    return module, notes


def find_pep701_fstrings(survey: Survey) -> list[cst.FormattedString]:
    """The outermost f-strings that only Python 3.12+ parses (an inner one counts when its outer one is fine)."""
    module = survey.module
    found: list[cst.FormattedString] = []
    for node, outer in survey.collector.fstrings:
        if not any(o in found for o in outer) and pep701_kind(node, module) is not None:
            found.append(node)
    return found


def pep701_kind(node: cst.FormattedString, module: cst.Module) -> str | None:
    """Which Python 3.12-only form (PEP 701) a replacement field of `node` uses, or None.

    "quote": the f-string's own quote reused inside a field (`f"{", ".join(xs)}"`);
    "backslash", "comment", "newline" (in a single-quoted f-string): the other forms
    Python 3.10 and 3.11 reject, reported before "quote" when both occur. Fields
    nested in format specs count too.
    """
    quote = node.start.lstrip("fFrRbBuU")
    codes = [(part, module.code_for_node(part)) for part in _fstring_fields(node.parts)]
    # The forms quoting cannot fix first, so that a rewrite never hides one of them.
    for part, code in codes:
        if "\\" in code:
            return "backslash"
        if m.findall(part, m.Comment()):
            return "comment"
        if len(quote) == 1 and ("\n" in code or "\r" in code):
            return "newline"
    if any(quote in code for _, code in codes):
        return "quote"
    return None


def _fstring_fields(parts) -> list[cst.FormattedStringExpression]:
    """Replacement fields of an f-string, including those nested in format specs."""
    out = []
    for part in parts:
        if isinstance(part, cst.FormattedStringExpression):
            out.append(part)
            out.extend(_fstring_fields(part.format_spec or ()))
    return out


# Last: requotes the f-strings of the script as the other features left them.
UNIT = Feature(name=FEATURE, apply=apply, order=100, analyse=find_pep701_fstrings)


def requote(source: str) -> str | None:
    """`source` with its PEP 701 f-strings requoted (same AST), or None when that cannot make it compile here.

    What `check` imports and `verify` loads when the running Python cannot compile a
    Python 3.12-only script: the transform alone, on the whole source (no other feature,
    no runtime). None when `source` does not parse, a site is one quoting cannot fix
    (`Unfixable`), or the result still does not compile under the running Python.
    """
    try:
        module = cst.parse_module(source)
        verdicts = registry.judge(module)
        ctx = Context(verdicts, {FEATURE}, facts={FEATURE: find_pep701_fstrings(verdicts.survey)})
        module, notes = apply(module, ctx)
        if any(note.unfixable for note in notes):
            return None
        fixed = module.code
        compile(fixed, "requoted", "exec", dont_inherit=True)
    except Exception:
        return None
    return fixed


def rewrite(node: cst.FormattedString, module: cst.Module) -> cst.FormattedString:
    """Return `node` requoted so that Python 3.10 parses it; raises `Unfixable`."""
    quote = _quote(node)
    kind = pep701_kind(node, module)
    if kind in UNFIXABLE:
        raise Unfixable(UNFIXABLE[kind])
    if len(quote) == 3:
        return node
    other = "'" if quote == '"' else '"'
    return node.visit(_RequoteInner(node, quote, other))


def _quote(node: cst.FormattedString) -> str:
    return node.start.lstrip("fFrRbBuU")


class _RequoteInner(cst.CSTTransformer):
    """Give every string literal inside the replacement fields the other quote."""

    def __init__(self, outer: cst.FormattedString, quote: str, other: str):
        super().__init__()
        self.outer, self.quote, self.other = outer, quote, other

    def leave_SimpleString(self, original_node, updated_node):
        prefix = updated_node.prefix
        body = updated_node.value[len(prefix) + len(updated_node.quote) : -len(updated_node.quote)]
        if updated_node.quote != self.quote:
            if self.quote in body:
                raise Unfixable("a string inside a replacement field holds the f-string's own quote (no Python 3.10 spelling)")
            return updated_node
        if self.other in body or "\\" in body:
            raise Unfixable("a string inside a replacement field would need an escape in the other quote (no Python 3.10 spelling)")
        return updated_node.with_changes(value=f"{prefix}{self.other}{body}{self.other}")

    def leave_FormattedString(self, original_node, updated_node):
        if original_node is self.outer:
            return updated_node
        quote = _quote(updated_node)
        if quote == self.quote:
            texts = [p.value for p in updated_node.parts if isinstance(p, cst.FormattedStringText)]
            if any(self.other in t for t in texts):
                raise Unfixable("a nested f-string holds the other quote character (no Python 3.10 spelling)")
            prefix = updated_node.start[: -len(quote)]
            return updated_node.with_changes(start=prefix + self.other, end=self.other)
        return updated_node
