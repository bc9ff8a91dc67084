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

import inspect
import os
import types
from dataclasses import dataclass, field

import libcst as cst
import libcst.matchers as m

from patcher.cst_walk import small_statements
from patcher.families.sources import imported_sources
from patcher.proof.harness import HarnessError, hparams_for, point_at_shards
from patcher.proof.script_eval import evaluate_script_code, names_imported, survey_of, verdicts_of
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
        verdicts = verdicts_of(source)
        surveyed = verdicts.survey
        sites = sorted(verdicts.training_constructions(), key=lambda c: c.line)
        if not sites:
            reasons = "; ".join(verdicts.construction_reasons()) or "no training loader found"
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
        accum = self._bind_locals(module, ns)
        if "grad_accum_steps" not in ns:
            # the script's own computation where the call's function makes one
            # (`grad_accum_steps = 8 // world_size`), else the Hyperparameters', else 8 // world_size
            try:
                if self.call_scope is None or self.call_scope.resolve(accum) in (None, self.survey.collector.module_scope):
                    raise HarnessError("no local grad_accum_steps")
                value = evaluate_script_code(self.survey, accum, ns, self.call_scope)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise HarnessError("not a positive int")
            except (HarnessError, Exception):
                value = getattr(hparams, "grad_accum_steps", max(1, 8 // world_size))
            ns["grad_accum_steps"] = ns[accum] = value
        self._point_configs(ns)
        return ns

    def _point_configs(self, ns: dict) -> None:
        """A configuration object the loader's construction reads its data path from, made
        by a local's assignment (`config = ExperimentConfig.from_env()`, read as
        `config.data.train_glob`), is evaluated into `ns` and its shard patterns, and those
        of the objects it holds, pointed at the synthetic shards, as the Hyperparameters'
        are (`hparams_for`)."""
        shards = str(getattr(ns.get("args"), "train_files", ""))
        site = self.constructions[0]
        scope = site.binding
        if "*" not in shards or scope is None or scope is self.survey.collector.module_scope:
            return
        for arg in site.call.args:
            root = arg.value
            while isinstance(root, cst.Attribute):
                root = root.value
            if root is arg.value or not isinstance(root, cst.Name) or root.value in _STAND_INS or scope.resolve(root.value) is not scope:
                continue
            try:
                config = self._eval_constant(root.value, ns, scope=scope)
            except Exception:  # evaluating the construction itself says why
                continue
            _point_config_at_shards(config, os.path.dirname(shards), shards)

    def _bind_locals(self, module: types.ModuleType, ns: dict) -> str:
        """Stand in `ns` for the locals of the function that builds and calls the loader
        where their names differ from the stand-ins' (a minified `main()`: `B =
        Hyperparameters()`, `p`, `S`, `U` passed as rank, world size and device) or
        shadow a module-level name (`B = float` at the top): a local passed where the
        loader's `__init__` or `next_batch` takes `rank`, `world_size`, `local_rank` or
        `device` is that stand-in, one assigned a Hyperparameters instance is `args`,
        and any other local with one plain assignment is dropped from `ns`, so that it
        is evaluated from that assignment, not read from the module's global of the same
        name. Returns the name `next_batch` gets its gradient accumulation from (the
        local passed for `grad_accum_steps`, else that name)."""
        cls = module.__dict__.get(self.constructions[0].class_name)
        roles: dict[str, str] = {}
        sites = [(self.constructions[0].binding, self.constructions[0].call.args, _parameters(cls, False))]
        sites.append((self.call_scope, [cst.Arg(cst.parse_expression(code)) for code in self.call_args], _parameters(getattr(cls, "next_batch", None), True)))
        accum = "grad_accum_steps"
        for scope, args, params in sites:
            if scope is None or scope is self.survey.collector.module_scope:
                continue
            for position, arg in enumerate(args):
                param = arg.keyword.value if arg.keyword is not None else (params[position] if position < len(params) else None)
                if not isinstance(arg.value, cst.Name) or param not in _STAND_INS or arg.value.value in _STAND_INS:
                    continue
                if scope.resolve(arg.value.value) is scope:
                    roles[arg.value.value] = param
                    if param == "grad_accum_steps":
                        accum = arg.value.value
            hp = self.survey.hyperparameters or _hyperparameters_by_use(self, module)
            for name, bindings in scope.bindings.items():
                # one plain assignment; a comprehension's variable of the same name (which
                # the survey binds in the function too) does not change it after
                assigns = [value for kind, value in bindings if kind == "assign"]
                if name in _STAND_INS or name in roles or len(assigns) != 1 or any(kind not in ("assign", "loop") for kind, _ in bindings):
                    continue
                value = assigns[0]
                if hp is not None and m.matches(value, m.Call(func=m.Name(hp.name), args=[])):
                    roles[name] = "args"
                elif name in ns and ns.get(name) is module.__dict__.get(name):
                    del ns[name]  # a module-level name this function's own assignment shadows
        for name, role in roles.items():
            if role == "grad_accum_steps":
                ns.pop(name, None)  # evaluated from the script's own computation
            elif role in ns:
                ns[name] = ns[role]
        return accum

    def build(self, site: Construction, ns: dict):
        """Evaluate construction `site`'s expression (the script's own code) in `ns`."""
        return self._eval_constant(self.survey.module.code_for_node(site.call), ns, scope=site.binding)

    def evaluate(self, code: str, ns: dict, scope=None):
        """Evaluate script code in `ns`, resolving run-constant locals through `scope`."""
        return self._eval_constant(code, ns, scope=scope)

    def arguments(self, ns: dict, step: int, seq_lens: list[int] | None = None) -> tuple:
        """`next_batch` arguments for `step`: run constants evaluated; a per-step one
        cycles every 5 calls through `seq_lens` (a sequence length) or through the
        Hyperparameters batch size and half of it (a token count; without one, the first
        value the script assigns to the argument and half of it). What an argument is
        comes from its code, else from the name of the `next_batch` parameter it is
        passed to. Raises HarnessError for a per-step argument with no schedule."""
        values = []
        for index, code in enumerate(self.call_args):
            if index in self.varying:
                # what the argument is, told by its code, else by the parameter it is
                # passed to (`cur_batch` passed as `global_tokens`: a token count)
                kind = code if any(word in code for word in ("seq", "len", "tok")) else self.parameter_of(index) or code
                schedule = seq_lens if "seq" in kind or "len" in kind else None
                hp = ns.get("args", ns.get("h"))
                if "tok" in kind and hasattr(hp, "train_batch_tokens"):
                    schedule = [hp.train_batch_tokens, hp.train_batch_tokens // 2]
                elif "tok" in kind:
                    # no Hyperparameters batch size (`config.train.train_batch_tokens`):
                    # the first value the script assigns to the argument, and half of it
                    full = self._first_int_assignment(code, ns)
                    schedule = [full, full // 2] if full else schedule
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

    def parameter_of(self, index: int) -> str:
        """The name of the loader's `next_batch` parameter that argument `index` of the
        training loop's call is passed to (surveyed), "" where there is none."""
        loader = self.survey.loader_classes.get(self.constructions[0].class_name)
        params = loader.next_batch_params if loader is not None else []
        return params[index] if index < len(params) else ""

    def _first_int_assignment(self, code: str, ns: dict) -> int | None:
        """The first positive int that an assignment to the local `code` in the calling
        function evaluates to outside the script (in source order), else None."""
        owner = self.call_scope.resolve(code) if self.call_scope is not None and code.isidentifier() else None
        for kind, value in owner.bindings.get(code, []) if owner is not None else []:
            if kind != "assign" or value is None:
                continue
            try:
                result = evaluate_script_code(self.survey, self.survey.module.code_for_node(value), ns, owner)
            except Exception:  # this assignment needs what only the run has (the step, a schedule)
                continue
            if isinstance(result, int) and not isinstance(result, bool) and result > 0:
                return result
        return None

    def _eval_constant(self, code: str, ns: dict, scope=None):
        """Evaluate a run-constant expression; a local it names is evaluated from its one assignment."""
        return evaluate_script_code(self.survey, code, ns, scope if scope is not None else self.call_scope, assumed=self.assumed)


def _point_config_at_shards(config, data_dir: str, pattern: str, depth: int = 0) -> None:
    """`point_at_shards` on a configuration object and on the objects its attributes hold
    (`config.data`), two levels down; a plain value, a module or a class is left alone."""
    if depth > 2 or isinstance(config, (str, bytes, int, float, bool, type, types.ModuleType, list, tuple, dict)) or config is None:
        return
    try:
        point_at_shards(config, data_dir, pattern)
    except HarnessError:  # no train_files of its own: its parts may hold the patterns
        pass
    for name in dir(config):
        if not name.startswith("_"):
            _point_config_at_shards(getattr(config, name, None), data_dir, pattern, depth + 1)


# The names `namespace` stands in for, as `main()` would have them.
_STAND_INS = frozenset({"args", "h", "hparams", "rank", "world_size", "local_rank", "device", "distributed", "grad_accum_steps"})


def _parameters(function, method: bool) -> list[str]:
    """The positional parameter names of `function` (a class: its `__init__`'s; `method`:
    without the first, `self`), [] when it has no readable signature."""
    try:
        names = [p.name for p in inspect.signature(function).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return []
    return names[1:] if method and not isinstance(function, type) else names


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
    `target.send(value)` (see `_sent_value_codes`), in source order; scope: where the
    first construction runs (a function's scope: `train()` builds it from its locals),
    None at module level; patched_survey, patched_scope: the same of the patched
    script, whose constructions see its own locals (a hand-edit may change them).
    """

    survey: Survey
    target: str
    original: list[str]
    patched: list[str]
    sent: list[str] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)  # as LoaderRecipe.assumed
    scope: object = None
    patched_survey: Survey | None = None
    patched_scope: object = None

    @classmethod
    def from_source(cls, original: str, patched: str) -> "IteratorRecipe":
        """Raises HarnessError when the original has no training generator the patch wrapped."""
        verdicts = verdicts_of(original)
        surveyed = verdicts.survey
        sites = [i for i in verdicts.iterators if i.training or i.staged]
        if not sites:
            reasons = verdicts.iterator_reasons()
            if not reasons and surveyed.loader_classes and not surveyed.constructions:
                # a loader class built some other way (a factory function's `return Cls(...)`):
                # the patch leaves it as it is, so no prefetch of it to verify
                names = ", ".join(surveyed.loader_classes)
                first = next(iter(surveyed.loader_classes))
                reasons = [f"{names} defined (line {surveyed.loader_classes[first].line}) but never built as `name = {first}(...)`, so patch-prefetch leaves the training loader as it is and there is no prefetch of it to verify; build it as `train_loader = {first}(...)` in the training function to have it prefetched and verified"]
            raise HarnessError("; ".join(reasons or imported_sources(surveyed)) or "no training loader or data generator found")
        target = sites[0].target
        codes = [surveyed.module.code_for_node(i.call) for i in sites if i.target == target]
        patched_survey = survey_of(patched)
        wrapped = [
            (assign, scope)
            for assign, scope in patched_survey.collector.call_assigns
            if m.matches(assign, m.Assign(targets=[m.AssignTarget(m.Name(target))], value=m.Call(func=m.Name("_prefetch_iterator") | m.Name(sites[0].function))))
        ]
        if len(wrapped) != len(codes):
            raise HarnessError(f"the patched script builds `{target}` {len(wrapped)} times, the original {len(codes)}")
        sends = [c for i in sites if i.target == target for c in i.sends]
        scope = sites[0].binding if sites[0].binding is not surveyed.collector.module_scope else None
        patched_scope = wrapped[0][1] if wrapped[0][1] is not patched_survey.collector.module_scope else None  # one per original site, so at least one
        codes_patched = [patched_survey.module.code_for_node(assign.value) for assign, _scope in wrapped]
        return cls(surveyed, target, codes, codes_patched, _sent_value_codes(surveyed, sends), scope=scope, patched_survey=patched_survey, patched_scope=patched_scope)

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

    def evaluate(self, code: str, module: types.ModuleType, side: int = 0):
        """Evaluate `code` in the module's globals; a module-level name it uses that the
        definitions-only import left out (`args = Hyperparameters()`) is evaluated from
        its one assignment in the script first: the original's (`side` 0), or the patched
        script's (`side` 1). Where the generator is built inside a function, in the names
        that function sees (`_function_namespace`)."""
        survey, scope = (self.patched_survey, self.patched_scope) if side and self.patched_survey is not None else (self.survey, self.scope)
        if scope is None:
            return evaluate_script_code(survey, code, module.__dict__, survey.collector.module_scope, assumed=self.assumed)
        return evaluate_script_code(survey, code, self._function_namespace(module, survey, scope), scope, assumed=self.assumed)

    def binds(self, name: str) -> bool:
        """True where the module, or the function that builds the generator, binds `name`."""
        return bool(self.survey.collector.module_scope.bindings.get(name) or (self.scope is not None and self.scope.bindings.get(name)))

    def _function_namespace(self, module: types.ModuleType, survey: Survey, scope) -> dict:
        """The names the construction sees inside its function: the module's globals,
        less the names the function assigns itself, which are evaluated from that
        assignment at each call (`rank = int(os.environ["RANK"])` reads the rank being
        driven). Its hyperparameters instance (`args = Hyperparameters()`) is made once
        and kept in the module, where the synthetic shards' paths are set on it; a
        parameter of the function is the module-level name of the same name
        (`train(args)`, called with the module's `args`)."""
        ns = dict(module.__dict__)
        module_scope = survey.collector.module_scope
        hp = survey.hyperparameters
        for name, bindings in scope.bindings.items():
            if all(kind == "param" for kind, _ in bindings):
                if name not in ns and module_scope.bindings.get(name):
                    try:
                        ns[name] = evaluate_script_code(survey, name, module.__dict__, module_scope, assumed=self.assumed)
                    except HarnessError:
                        pass  # evaluated where the construction uses it, and fails there with its reason
                continue
            if hp is not None and len(bindings) == 1 and m.matches(bindings[0][1], m.Call(func=m.Name(hp.name), args=[])):
                if name not in module.__dict__:
                    module.__dict__[name] = evaluate_script_code(survey, f"{hp.name}()", module.__dict__, module_scope)
                ns[name] = module.__dict__[name]
                continue
            ns.pop(name, None)
        return ns


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
    return hparams_for(recipe.survey.hyperparameters or _hyperparameters_by_use(recipe, module), module, world_size, data_dir)


def _hyperparameters_by_use(recipe: LoaderRecipe, module) -> types.SimpleNamespace | None:
    """The script's hyperparameters class where the survey found none by its name: the
    class the function that calls the loader instantiates, without arguments, as `args`,
    `h` or `hparams` (`args = HP()`), when the script defines it; else None."""
    scope = recipe.call_scope
    if scope is None:
        return None
    for name in ("args", "h", "hparams"):
        assigns = [value for kind, value in scope.bindings.get(name, []) if kind == "assign"]
        if len(assigns) == 1 and m.matches(assigns[0], m.Call(func=m.Name(), args=[])) and isinstance(module.__dict__.get(assigns[0].func.value), type):
            return types.SimpleNamespace(name=assigns[0].func.value)
    return None
