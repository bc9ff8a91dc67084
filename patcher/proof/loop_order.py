"""Where a training loop uses a batch relative to fetching the next one.

A loop that fetches batch n+1 before it has used batch n (`next_x, next_y =
loader.next_batch(...)`, then `loss = model(x, y)`, then `x, y = next_x, next_y`) needs
batch n to stay as it was across the next call. A loader that hands out views of a
buffer it refills (nanochat's device buffer) keeps that promise only until its next
call: in such a loop the model trains on the next batch's data. `verify` of a
hand-edited script asks this of the edited loop, so that it compares each batch where
the loop uses it.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import walk


def early_fetch_line(survey, calls: list) -> int | None:
    """The line where a loop reads a batch after the `next_batch` call that fetched the
    next one (`calls`: the surveyed `CallSite`s of the training loader), or None where
    every batch is used before the next is fetched. Only the names the fetch binds and
    their plain aliases (`x, y = next_x, next_y`) are followed."""
    for call in calls:
        line = _early_use(survey, call.node)
        if line is not None:
            return line
    return None


def _early_use(survey, call: cst.Call) -> int | None:
    for block in (n for n in walk(survey.module) if isinstance(n, cst.IndentedBlock)):
        body = list(block.body)
        at = next((i for i, s in enumerate(body) if isinstance(s, cst.SimpleStatementLine) and any(n is call for n in walk(s))), None)
        if at is None:
            continue
        fetched = _assigned(body[at])
        for j in range(at + 1, len(body)):
            aliased = _alias_of(body[j], fetched)
            if not aliased:
                continue
            for between in body[at + 1 : j]:
                read = next((n for n in walk(between) if isinstance(n, cst.Name) and n.value in aliased), None)
                if read is not None:
                    return survey.line_of(read)
        return None
    return None


def _assigned(statement: cst.SimpleStatementLine) -> set[str]:
    """The plain names a statement's assignments bind."""
    return {n.value for small in statement.body if isinstance(small, cst.Assign) for t in small.targets for n in walk(t.target) if isinstance(n, cst.Name)}


def _alias_of(statement: cst.BaseStatement, names: set[str]) -> set[str]:
    """The names `statement` binds to a plain copy of `names` (`x, y = next_x, next_y`; `x = nx`), else empty."""
    if not isinstance(statement, cst.SimpleStatementLine):
        return set()
    bound = set()
    for small in statement.body:
        if not isinstance(small, cst.Assign):
            continue
        values = [e.value for e in small.value.elements] if isinstance(small.value, cst.Tuple) else [small.value]
        if values and all(m.matches(v, m.Name()) and v.value in names for v in values):
            bound |= {n.value for t in small.targets for n in walk(t.target) if isinstance(n, cst.Name)} - names
    return bound
