"""How a script builds and feeds its training data source, read from its survey.

`LoaderRecipe`: a loader class built as `name = Cls(...)` (and rebuilt after the
warm-up), drawn from with `next_batch(...)`; `build` and `arguments` evaluate the
script's own expressions in a namespace that stands in for the enclosing function:
the Hyperparameters instance as `args`/`h`, `rank`, `world_size`, `device`, and the
run constants the expressions name (e.g. `grad_accum_steps = 8 // world_size`).
`patched_constructions` finds the patched script's counterparts of its constructions.
`IteratorRecipe`: a data generator built by a call and advanced with `next()` /
`.send(value)`, with the patched script's wrapped constructions and the values the
script sends.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import small_statements
from patcher.proof.harness import HarnessError, hparams_for
from patcher.proof.script_eval import evaluate_script_code, names_imported, survey_of
from patcher.survey.survey import Construction, Survey


@dataclass
class LoaderRecipe:
    """How a script builds and feeds its training loader.

    constructions: the training loader's construction sites in source order (the
    first builds it, later ones rebuild it). call: the training loop's `next_batch`
    call. varying: indices of per-step `next_batch` arguments.
    """

    survey: Survey
    constructions: list[Construction]
    call_args: list[str]
    varying: list[int] = field(default_factory=list)
    call_scope: object = None
    # "`name` = <code> (line N), ..." for every name evaluated from its one unconditional
    # assignment among several (a fresh run's value), for verify to report.
    assumed: list[str] = field(default_factory=list)

    @classmethod
    def from_source(cls, source: str) -> "LoaderRecipe":
        """Raises HarnessError when the script has no training loader with a next_batch call."""
        surveyed = survey_of(source)
        sites = sorted(surveyed.training_constructions(), key=lambda c: c.line)
        if not sites:
            reasons = "; ".join(sorted({c.reason for c in surveyed.constructions if c.reason})) or "no training loader found"
            raise HarnessError(reasons)
        # One variable's constructions: the one built most often (the warm-up rebuild),
        # the later one of a tie; a calibration function's `loader = ...` stays out.
        groups: dict = {}
        for site in sites:
            groups.setdefault((site.target, id(site.binding)), []).append(site)
        sites = max(reversed(list(groups.values())), key=len)
        calls = surveyed.calls_on(sites[0])
        call = calls[-1]  # the main loop's call comes after the warm-up's
        varying = [i for i, const in enumerate(call.constant) if not const]
        scope = surveyed.collector.scope_of.get(call.scope, surveyed.collector.module_scope)
        return cls(surveyed, sites, call.args, varying, scope)

    def namespace(self, module: types.ModuleType, hparams, rank: int, world_size: int, device) -> dict:
        """Names the construction and call expressions may use, as `main()` would have them."""
        ns = dict(module.__dict__)
        ns.update(args=hparams, h=hparams, hparams=hparams, rank=rank, world_size=world_size, local_rank=0, device=device, distributed=world_size > 1)
        if "grad_accum_steps" not in ns:
            # the script's own computation where the call's function makes one
            # (`grad_accum_steps = 8 // world_size`), else the Hyperparameters', else 8 // world_size
            try:
                if self.call_scope is None or self.call_scope.resolve("grad_accum_steps") in (None, self.survey.collector.module_scope):
                    raise HarnessError("no local grad_accum_steps")
                value = evaluate_script_code(self.survey, "grad_accum_steps", ns, self.call_scope)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise HarnessError("not a positive int")
            except (HarnessError, Exception):
                value = getattr(hparams, "grad_accum_steps", max(1, 8 // world_size))
            ns["grad_accum_steps"] = value
        return ns

    def build(self, site: Construction, ns: dict):
        """Evaluate construction `site`'s expression (the script's own code) in `ns`."""
        return self._eval_constant(self.survey.module.code_for_node(site.call), ns, scope=site.binding)

    def evaluate(self, code: str, ns: dict, scope=None):
        """Evaluate script code in `ns`, resolving run-constant locals through `scope`."""
        return self._eval_constant(code, ns, scope=scope)

    def arguments(self, ns: dict, step: int, seq_lens: list[int] | None = None) -> tuple:
        """`next_batch` arguments for `step`: run constants evaluated; a per-step one
        cycles every 5 calls through `seq_lens` (a sequence length) or through the
        Hyperparameters batch size and half of it (a token count)."""
        values = []
        for index, code in enumerate(self.call_args):
            if index in self.varying:
                schedule = seq_lens if "seq" in code or "len" in code else None
                hp = ns.get("args", ns.get("h"))
                if "tok" in code and hasattr(hp, "train_batch_tokens"):
                    schedule = [hp.train_batch_tokens, hp.train_batch_tokens // 2]
                if not schedule:
                    # neither a sequence length nor a token count (`grad_accum_steps =
                    # math.gcd(...)`): its value in a fresh run, from its assignment
                    try:
                        values.append(self._eval_constant(code, ns))
                        continue
                    except HarnessError:
                        raise HarnessError(f"next_batch argument `{code}` changes during the run; no schedule for it") from None
                values.append(schedule[(step // 5) % len(schedule)])
            else:
                values.append(self._eval_constant(code, ns))
        return tuple(values)

    def _eval_constant(self, code: str, ns: dict, scope=None):
        """Evaluate a run-constant expression; a local it names is evaluated from its one assignment."""
        return evaluate_script_code(self.survey, code, ns, scope if scope is not None else self.call_scope, assumed=self.assumed)


def patched_constructions(source: str, recipe: LoaderRecipe, original_source: str | None = None, side: str = "patched") -> list[str]:
    """Code of the patched script's constructions that stand where the original's
    training constructions stand, in the original's order.

    An original construction is the k-th `target = call(...)` assignment to its
    variable in its function (by qualified name); its patched counterpart is the k-th
    such assignment in the same function of the patched script. Assignments inside
    what the patch injected (top-level definitions the original does not have, e.g.
    the runtime's own `loader = ...`) never count. Without `original_source`, every
    assignment of the first construction's variable to a call of its class or of an
    injected function counts. Raises HarnessError when a construction has no
    counterpart (`side`: what the message calls the script, "patched" or "edited").
    """
    surveyed = survey_of(source)
    patched_module = surveyed.module
    if original_source is None:
        target = recipe.constructions[0].target
        names = {recipe.constructions[0].class_name} | top_level_names(patched_module)
        return [
            surveyed.module.code_for_node(assign.value)
            for assign, _scope in surveyed.collector.call_assigns
            if m.matches(assign.targets[0].target, m.Name(target)) and isinstance(assign.value.func, cst.Name) and assign.value.func.value in names
        ]
    injected = top_level_names(patched_module) - top_level_names(recipe.survey.module)
    patched_groups = _call_assign_groups(surveyed, injected)
    original_groups = _call_assign_groups(recipe.survey, set())
    found = []
    for site in recipe.constructions:
        key = next((k for k, assigns in original_groups.items() if any(a is site.node for a in assigns)), None)
        if key is None:
            raise HarnessError(f"construction of `{site.target}` (line {site.line}) not found among the original's assignments")
        position = [id(a) for a in original_groups[key]].index(id(site.node))
        candidates = patched_groups.get(key, [])
        if len(candidates) != len(original_groups[key]):
            where = f"in {key[0]}()" if key[0] else "at module level"
            raise HarnessError(f"the {side} script assigns `{site.target}` from a call {len(candidates)} times {where}, the original {len(original_groups[key])} times")
        found.append(surveyed.module.code_for_node(candidates[position].value))
    return found


def top_level_names(module: cst.Module) -> set[str]:
    """Names a module's top-level statements define: functions, classes, assigned names, imports."""
    names = set()
    for statement in small_statements(module.body):
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            names.add(statement.name.value)
        elif isinstance(statement, cst.Assign):
            for target in statement.targets:
                names.update(n.value for n in m.findall(target.target, m.Name()) if m.matches(target.target, m.Name() | m.Tuple() | m.List()))
        elif isinstance(statement, cst.AnnAssign) and isinstance(statement.target, cst.Name):
            names.add(statement.target.value)
        elif isinstance(statement, (cst.Import, cst.ImportFrom)) and not isinstance(statement.names, cst.ImportStar):
            names.update(names_imported(statement))
    return names


def _call_assign_groups(surveyed: Survey, skip_top_level: set[str]) -> dict:
    """{(qualified function name, variable): [Assign, ...]} of `variable = call(...)`
    assignments in source order, leaving out those inside a top-level definition named
    in `skip_top_level`."""
    groups: dict = {}
    for assign, scope in surveyed.collector.call_assigns:
        target = assign.targets[0].target
        if len(assign.targets) != 1 or not isinstance(target, cst.Name):
            continue
        top = surveyed.top_level_of(assign)
        if isinstance(top, (cst.FunctionDef, cst.ClassDef)) and top.name.value in skip_top_level:
            continue
        if isinstance(top, cst.SimpleStatementLine) and top_level_names(cst.Module([top])) & skip_top_level:
            continue
        groups.setdefault((_qualified_name(scope), target.value), []).append(assign)
    return groups


def _qualified_name(scope) -> str:
    """`outer.inner` for a function scope (classes included), "" for the module."""
    parts = []
    while scope is not None and scope.node is not None:
        parts.append(scope.node.name.value)
        scope = scope.parent
    return ".".join(reversed(parts))


@dataclass
class IteratorRecipe:
    """How a script builds its training data generator, and how the patched one does.

    target: the variable (`train_loader`); original / patched: the construction
    expressions, in source order, of the original and of the patched script;
    survey: the original's survey (for the module-level names the expressions use);
    sent: the expressions that may give the values the script passes to
    `target.send(value)` (see `_sent_value_codes`), in source order.
    """

    survey: Survey
    target: str
    original: list[str]
    patched: list[str]
    sent: list[str] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)  # as LoaderRecipe.assumed

    @classmethod
    def from_source(cls, original: str, patched: str) -> "IteratorRecipe":
        """Raises HarnessError when the original has no training generator the patch wrapped."""
        surveyed = survey_of(original)
        sites = [i for i in surveyed.iterators if i.training or i.staged]
        if not sites:
            reasons = sorted({i.reason for i in surveyed.iterators if i.reason})
            raise HarnessError("; ".join(reasons) or "no training loader or data generator found")
        target = sites[0].target
        codes = [surveyed.module.code_for_node(i.call) for i in sites if i.target == target]
        patched_survey = survey_of(patched)
        wrapped = [
            patched_survey.module.code_for_node(assign.value)
            for assign, _scope in patched_survey.collector.call_assigns
            if m.matches(assign, m.Assign(targets=[m.AssignTarget(m.Name(target))], value=m.Call(func=m.Name("_prefetch_iterator") | m.Name(sites[0].function))))
        ]
        if len(wrapped) != len(codes):
            raise HarnessError(f"the patched script builds `{target}` {len(wrapped)} times, the original {len(codes)}")
        sends = [c for i in sites if i.target == target for c in i.sends]
        return cls(surveyed, target, codes, wrapped, _sent_value_codes(surveyed, sends))

    def sent_values(self, module: types.ModuleType) -> list:
        """The values of `sent` that evaluate outside training (module-level names only)
        to something other than None, distinct, in order; the others are left out."""
        values = []
        for code in self.sent:
            try:
                value = self.evaluate(code, module)
            except HarnessError:
                continue
            if value is not None and value not in values:
                values.append(value)
        return values

    def evaluate(self, code: str, module: types.ModuleType):
        """Evaluate `code` in the module's globals; a module-level name it uses that the
        definitions-only import left out (`args = Hyperparameters()`) is evaluated from
        its one assignment in the original script first."""
        return evaluate_script_code(self.survey, code, module.__dict__, self.survey.collector.module_scope, assumed=self.assumed)


def _sent_value_codes(surveyed: Survey, sends: list[cst.Call]) -> list[str]:
    """Source of what each `target.send(value)` may pass: the argument itself, or for a
    name the values assigned to it in its scope, and both branches of a conditional
    (`(bs, seq_len) if step == k else None`); the literal None left out."""
    scopes = dict(surveyed.collector.send_calls)
    codes: list[str] = []

    def add(expr: cst.BaseExpression, scope, depth: int) -> None:
        if m.matches(expr, m.Name("None")):
            return
        if isinstance(expr, cst.IfExp):
            add(expr.body, scope, depth)
            add(expr.orelse, scope, depth)
            return
        home = scope.resolve(expr.value) if isinstance(expr, cst.Name) and depth < 3 else None
        if home is not None:
            for kind, value in home.bindings[expr.value]:
                if kind == "assign" and value is not None:
                    add(value, home, depth + 1)
            return
        code = surveyed.module.code_for_node(expr)
        if code not in codes:
            codes.append(code)

    for call in sends:
        add(call.args[0].value, scopes[call], 0)
    return codes


def hparams_factory(recipe: LoaderRecipe, module, world_size: int, data_dir: str):
    """`rank -> Hyperparameters instance` for a simulated world of `world_size` ranks,
    the script's data paths pointed at the synthetic shards in `data_dir`."""
    return hparams_for(recipe.survey.hyperparameters, module, world_size, data_dir)
