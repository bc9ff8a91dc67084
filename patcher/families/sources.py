"""The families' verdicts on a survey's facts: which family each training data source is of, and what it gets.

The survey (`patcher/survey/`) records facts only: loader classes, constructions and
`next_batch` calls, the sites built from module-level generator functions. `judge`
(run by `registry.judge` right after the survey) gives each of them its family and the
verdicts that follow, in a frozen `Verdicts` beside the survey (`verdicts.py`): each
loader class's family and whether it prefetches (threads, or a family that prefetches
by design), each generator site's family / training / reason / staged (a site of a
generator function no family recognises is left out: it is not a data source we
know), and each construction's verdict (the survey's candidates, less the loaders
built inside a generator that runs ahead or is staged). `data_sources` gives
`train_prefetch` every training data variable with its family and that family's
`Plan`; `verified_sources` adds the staged generators, which verify drives too;
`module_loaders` the loader generators of a data-loader module.

Every function takes the family units to ask (`registry.UNITS`, in recognition
order): the registry passes them, so this module needs nothing above it.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING

import libcst as cst

from patcher.cst_walk import small_statements
from patcher.families.base import DataVariable, Family, ModuleLoader, Plan
from patcher.families.verdicts import ConstructionVerdict, SiteVerdict, Verdicts
from patcher.survey.sites import names_other_data

if TYPE_CHECKING:
    from patcher.survey.index import ScriptIndex
    from patcher.survey.loaders import LoaderClass
    from patcher.survey.survey import Survey


def loader_family(loader: LoaderClass, units: list[Family]) -> Family:
    """The family of a surveyed `LoaderClass`: the first "loader_class" unit that recognises it.

    Raises LookupError when none does (the units lack a catch-all)."""
    for unit in units:
        if not unit.generators and unit.recognise(loader):
            return unit
    raise LookupError(f"no family recognises the loader class {loader.name}")


def generator_family(function: cst.FunctionDef, units: list[Family]) -> Family | None:
    """The family of a module-level generator function: the first "generator" unit that
    recognises it, or None (then it is not a data source we know)."""
    return next((u for u in units if u.generators and u.recognise(function)), None)


def judge(survey: Survey, units: list[Family]) -> Verdicts:
    """The families' verdicts on `survey` (see the module's docstring); `survey` is not
    changed. Raises LookupError when no unit recognises a loader class."""
    families = {name: loader_family(info, units) for name, info in survey.loader_classes.items()}
    prefetching = frozenset(name for name, family in families.items() if survey.loader_classes[name].threaded or family.prefetches)
    iterators = _judge_iterators(survey, units)
    return Verdicts(
        survey=survey,
        families=MappingProxyType({name: family.name for name, family in families.items()}),
        prefetching=prefetching,
        iterators=iterators,
        constructions=_judge_constructions(survey, iterators),
    )


def _judge_iterators(survey: Survey, units: list[Family]) -> tuple[SiteVerdict, ...]:
    """The generator sites whose function a family recognises, each judged by its
    family: not the training data source when named for other data, else why it is not
    run ahead (`Family.refuse`) and whether its own copies get pinned staging (`Family.stages`)."""
    index = survey.collector
    functions = {f.name.value: f for f in survey.module.body if f in index.generator_functions}
    families = {name: generator_family(function, units) for name, function in functions.items()}
    judged = []
    for site in survey.iterators:
        family = families.get(site.function)
        if family is None:
            continue
        if names_other_data(site.target):
            judged.append(SiteVerdict(site, family.name, reason=f"`{site.target}` is not the training data source"))
            continue
        function = functions[site.function]
        reason = family.refuse(site, function, index)
        staged = family.stages is not None and family.stages(site, function, index, reason)
        judged.append(SiteVerdict(site, family.name, training=reason is None, reason=reason, staged=staged))
    return tuple(judged)


def _judge_constructions(survey: Survey, iterators: tuple[SiteVerdict, ...]) -> tuple[ConstructionVerdict, ...]:
    """Every construction's verdict: the survey's candidate, unless it is built inside a
    data generator that runs ahead as a whole (modded-nanogpt's `BOSFinder` in
    `distributed_data_generator`: not wrapped a second time) or whose copies are staged
    (its `Shard`)."""
    generators = {i.function: "stays on the training thread, its H2D copies staged" for i in iterators if i.staged}
    generators.update({i.function: "runs ahead as a whole" for i in iterators if i.training})
    verdicts = []
    for construction in survey.constructions:
        scope = construction.scope
        if construction.candidate and isinstance(scope, cst.FunctionDef) and scope.name.value in generators:
            reason = f"`{construction.target}` is built inside the data generator {scope.name.value}, which {generators[scope.name.value]}"
            verdicts.append(ConstructionVerdict(construction, False, reason))
        else:
            verdicts.append(ConstructionVerdict(construction, construction.candidate, construction.why_not))
    return tuple(verdicts)


def data_sources(verdicts: Verdicts, units: list[Family]) -> list[DataVariable]:
    """The training data variables of `verdicts`, each with its training constructions,
    its family and its family's `Plan` (producer, runtime and driver filled from the
    family where the plan names none): the data generators first, then the loaders,
    each kind by variable name."""
    variables = _variables(verdicts, units, [i for i in verdicts.iterators if i.training], verdicts.training_constructions())
    return [_planned(variable, verdicts) for variable in variables]


def verified_sources(verdicts: Verdicts, units: list[Family]) -> list[DataVariable]:
    """What `verify` drives: `data_sources`, then each staged generator variable (not run
    ahead, its own copies staged), whose plan is its family's refusal with the family's
    driver."""
    staged = _variables(verdicts, units, [i for i in verdicts.iterators if i.staged and not i.training], [])
    return data_sources(verdicts, units) + [replace(v, plan=_filled(Plan(refusal=v.sites[0].reason, line=v.line), v.family)) for v in staged]


def _variables(verdicts: Verdicts, units: list[Family], iterators: list[SiteVerdict], constructions: list) -> list[DataVariable]:
    """The variables of generator sites `iterators`, then those of loader `constructions`, each kind by name."""
    by_name = {u.name: u for u in units}
    variables = []
    for target in sorted({i.target for i in iterators}):
        sites = tuple(i for i in iterators if i.target == target)
        variables.append(DataVariable(target, sites, by_name[sites[0].family]))
    survey = verdicts.survey
    for target in sorted({c.target for c in constructions}):
        sites = tuple(c for c in constructions if c.target == target)
        loader = survey.loader_classes[sites[0].class_name]
        device_args = tuple(device_arg(site.call, loader) for site in sites) if loader.device_index is not None else ()
        variables.append(DataVariable(target, sites, by_name[verdicts.family_of(loader.name)], loader, device_args))
    return variables


def _planned(variable: DataVariable, verdicts: Verdicts) -> DataVariable:
    """`variable` with its family's plan."""
    return replace(variable, plan=_filled(variable.family.plan(variable, verdicts), variable.family))


def _filled(plan: Plan, family: Family) -> Plan:
    """`plan` with the family's producer, runtime and driver where it names none."""
    return replace(plan, producer=plan.producer or family.producer, runtime=plan.runtime or family.runtime, driver=plan.driver or family.driver)


def module_loaders(module: cst.Module, units: list[Family], index: ScriptIndex | None = None) -> list[ModuleLoader]:
    """The loader generators of the data-loader module `module` that the "module" families
    find (`Family.module_sources`), each with its family; empty for a training script.
    index: the survey's `ScriptIndex` of `module`, or None."""
    found = []
    for unit in units:
        if unit.module_sources is not None:
            found += [replace(loader, family=unit) for loader in unit.module_sources(module, index)]
    return found


def device_arg(call: cst.Call, cls: LoaderClass) -> int | None:
    """Index in call.args of the device argument of a construction of `cls` (positional at
    `cls.device_index`, or by the parameter's name), None where it passes none."""
    for index, arg in enumerate(call.args):
        if arg.keyword is not None and arg.keyword.value == cls.init_params[cls.device_index]:
            return index
    positional = [i for i, a in enumerate(call.args) if a.keyword is None and a.star == ""]
    if cls.device_index < len(positional):
        return positional[cls.device_index]
    return None


def imported_sources(survey: Survey) -> list[str]:
    """Why a script that builds no data source of its own has none to prefetch: one
    line per variable advanced with `next(variable)` and built by a function that the
    script imports with `from MODULE import function` (autoresearch's `train_loader =
    make_dataloader(...)` from `prepare`, nanochat's from `nanochat.dataloader`): its
    loader is in that module's file, which is what to patch."""
    advanced = {call.args[0].value.value for call, _scope in survey.collector.next_calls if call.args and isinstance(call.args[0].value, cst.Name)}
    imported = {}
    for statement in small_statements(survey.module.body):
        if isinstance(statement, cst.ImportFrom) and not isinstance(statement.names, cst.ImportStar):
            module = "." * len(statement.relative) + (survey.module.code_for_node(statement.module) if statement.module is not None else "")
            for alias in statement.names:
                imported[(alias.asname.name if alias.asname else alias.name).value] = (module, survey.line_of(statement))
    reasons = []
    for assign, _scope in survey.collector.call_assigns:
        target, call = assign.targets[0].target, assign.value
        if len(assign.targets) == 1 and isinstance(target, cst.Name) and target.value in advanced and isinstance(call.func, cst.Name) and call.func.value in imported:
            module, line = imported[call.func.value]
            reasons.append(f"`{target.value}` (line {survey.line_of(assign)}) is built by `{call.func.value}`, imported from `{module}` (line {line}): its loader is in that module's file; patch that file")
    return list(dict.fromkeys(reasons))
