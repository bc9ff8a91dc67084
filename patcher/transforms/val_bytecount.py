"""Transform `val_bytecount`: the bits-per-byte byte counting can run on the host.

The three statements of parameter-golf's `eval_val` that count the target tokens'
bytes on the GPU (`patcher/survey/val_survey.py` finds and checks them)

    token_bytes = base_bytes_lut[tgt_ids].to(dtype=torch.int16)
    token_bytes += (has_leading_space_lut[tgt_ids] & ~is_boundary_token_lut[prev_ids]).to(dtype=torch.int16)
    val_byte_count += token_bytes.to(torch.float64).sum()

become

    if <VAL_BYTECOUNT_DEVICE> == "cpu":
        val_byte_count += _val_byte_count(val_tokens[raw_start:raw_end], base_bytes_lut, has_leading_space_lut, is_boundary_token_lut)
    else:
        <the three statements, unchanged>

(runtime: `templates/val_bytecount.py`), where `val_tokens[raw_start:raw_end]` is the
batch's own slice, still on the host. Applied only where `prev_ids` and `tgt_ids` are
the batch's `local[:-1]` and `local[1:]` (reshaped or flattened) and the accumulator is
a `torch.zeros` tensor, so the integer count, and `val_bpb`, are bit-identical.
"""

from __future__ import annotations

import libcst as cst

from patcher.transforms.base import Context, Feature, Note, Toggle, Tracking, edit_tops
from patcher.survey.val_survey import find_val_loops

FEATURE = "val_bytecount"


def apply(module: cst.Module, ctx: Context) -> tuple[cst.Module, list[Note]]:
    """Give every checked byte-counting site a host branch. Returns (module, notes)."""
    survey = ctx.survey
    if not survey.uses_torch:
        return module, [Note(FEATURE, False, "script does not use torch (MLX or other framework)")]
    sites = [s for s in find_val_loops(survey) if s.over_range]
    if not sites:
        return module, [Note(FEATURE, False, "no evaluation loop that copies a token slice to the device per batch")]
    notes, plans = [], {}
    for site in sites:
        if site.bytes is None:
            notes.append(Note(FEATURE, False, site.bytes_reason, site.line))
            continue
        plans[site.bytes.statements[0]] = (site, _host_branch(site, module, ctx))
        notes.append(Note(FEATURE, True, f"{site.function}: byte counting at line {site.bytes.line} switchable to the host", site.bytes.line))
    if plans:
        ctx.need("val_bytecount")
        tops = {survey.top_level_of(site.loop) for site, _ in plans.values()}
        module = edit_tops(module, ctx, tops, _SplitBlocks(plans))
    return module, notes


# before val_prefetch, which rebuilds the loops whose statements this edits
UNIT = Feature(FEATURE, apply, order=50, toggles=(Toggle("VAL_BYTECOUNT_DEVICE", "cuda", "where validation counts target bytes: cuda, or cpu from the host slice", position=7),), runtime={"val_bytecount": ()}, injected="_val_byte_count", diagnostic=True)


def _host_branch(site, module: cst.Module, ctx: Context) -> cst.If:
    """`if <toggle> == "cpu": acc += _val_byte_count(...)` with an empty else, filled in later."""
    quote = ctx.code('"', "'")
    toggle = ctx.toggle("VAL_BYTECOUNT_DEVICE")
    call = cst.Module([]).code_for_node(ctx.runtime_call("_val_byte_count", [module.code_for_node(site.window)] + site.bytes.luts))
    acc = site.bytes.accumulator
    if ctx.minified:
        code = f"if {toggle}=={quote}cpu{quote}:{acc}+={call}\nelse:pass\n"
    else:
        code = f"if {toggle} == {quote}cpu{quote}:\n    {acc} += {call}\nelse:\n    pass\n"
    return cst.parse_statement(code)


class _SplitBlocks(Tracking):
    """In each block holding the three statements: the lines before them, the `if`/`else`
    with them in the else branch, the lines after them."""

    def __init__(self, plans: dict):
        super().__init__()
        self.plans = plans

    def prepare(self, ctx: Context) -> None:
        super().prepare(ctx)
        self.by_first = {id(ctx.resolve(site.bytes.statements[0])): (site, branch) for site, branch in self.plans.values()}
        self._changed = [ctx.resolve(s) for site, _ in self.plans.values() for s in site.bytes.statements]

    def targets(self) -> list[cst.CSTNode]:
        return self._changed  # their blocks, which leave_IndentedBlock splits, hold them

    def leave_IndentedBlock(self, original_node, updated_node):
        # Identity lives in original_node; updated_node holds fresh copies at the same positions.
        old_lines = [(i, s) for i, s in enumerate(original_node.body) if isinstance(s, cst.SimpleStatementLine)]
        flat = [(i, j, small) for i, line in old_lines for j, small in enumerate(line.body)]
        start = next((k for k, (_, _, small) in enumerate(flat) if id(small) in self.by_first), None)
        if start is None:
            return updated_node
        site, branch = self.by_first[id(flat[start][2])]
        positions = {(i, j) for i, j, _ in flat[start : start + 3]}
        holding = sorted({i for i, _ in positions})
        three = [updated_node.body[i].body[j] for i, j, _ in flat[start : start + 3]]
        holding_lines = [updated_node.body[i] for i in holding]
        body = []
        for i, stmt in enumerate(updated_node.body):
            if i not in holding:
                body.append(stmt)
                continue
            split = min(j for (k, j) in positions if k == i)
            before = [small for j, small in enumerate(stmt.body) if j < split and (i, j) not in positions]
            after = [small for j, small in enumerate(stmt.body) if j > split and (i, j) not in positions]
            if before:
                body.append(stmt.with_changes(body=_without_last_semicolon(before), trailing_whitespace=cst.TrailingWhitespace()))
            if i == holding[0]:
                leading = [] if before else stmt.leading_lines
                body.append(branch.with_changes(leading_lines=leading, orelse=branch.orelse.with_changes(body=self._else_body(three, holding_lines, branch))))
            if after:
                body.append(cst.SimpleStatementLine(body=after, trailing_whitespace=stmt.trailing_whitespace))
        return updated_node.with_changes(body=body)

    def _else_body(self, three, holding, branch) -> cst.BaseSuite:
        """The three statements as the else branch: their own lines when each had one, else one line."""
        if isinstance(branch.orelse.body, cst.SimpleStatementSuite):
            return cst.SimpleStatementSuite(body=_without_last_semicolon(three, ""), leading_whitespace=cst.SimpleWhitespace(""))
        if len(holding) == 3 and all(len(line.body) == 1 for line in holding):
            return cst.IndentedBlock(body=[holding[0].with_changes(leading_lines=[])] + holding[1:])
        return cst.IndentedBlock(body=[cst.SimpleStatementLine(body=_without_last_semicolon(three, " "))])


def _without_last_semicolon(smalls, between: str | None = None) -> list:
    """`smalls` for one line: the last without a semicolon; with `between`, the others joined by `;` + between."""
    if between is not None:
        semicolon = cst.Semicolon(whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace(between))
        smalls = [s.with_changes(semicolon=semicolon) for s in smalls]
    return list(smalls[:-1]) + [smalls[-1].with_changes(semicolon=cst.MaybeSentinel.DEFAULT)]
