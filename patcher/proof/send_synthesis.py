"""Stage changes for a data generator whose `.send(...)` values cannot be evaluated outside training.

modded-nanogpt's train_gpt.py drives its generator with
`train_loader.send(training_manager.train_loader_send_args)`: None within a stage, a
new `(num_tokens, max_seq_len, grad_accum_steps)` at a stage change. That attribute is
set by the training loop, so verify cannot evaluate it. What it can evaluate is the
generator's construction (`distributed_data_generator(args.train_files,
TRAINING_STAGES[0].batch_size, ..., grad_accum_steps=grad_accum_steps)`), and the
generator's own code says what a sent value means: the name bound by `x = yield ...`
and the names it is unpacked into (`new_num_tokens, new_max_seq_len, ... = x`), which
are tied back to the generator's parameters. From those, `synthesized_schedules` makes
stage changes: the token count scaled, the other values kept or scaled, so that each
candidate keeps the generator's divisibility rules; verify keeps only a candidate the
original generator accepts (`patcher.proof.verify`).
"""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst
import libcst.matchers as m

from patcher.proof.harness import HarnessError
from patcher.proof.recipes import IteratorRecipe


@dataclass
class SendProtocol:
    """What a generator does with a sent value.

    function: the generator's name; received: the name bound by `received = yield ...`;
    fields: the generator parameter each position of the sent value sets, in order (one
    field where the value is used whole); base: the value of each field as the last
    construction passes it (its parameter's default where it passes none)."""

    function: str
    received: str
    fields: list[str]
    base: dict


# Prefixes a generator gives the names it unpacks a sent value into (`new_num_tokens`).
_NEW_PREFIXES = ("new_", "next_", "sent_")


def send_protocol(recipe: IteratorRecipe, module) -> SendProtocol:
    """Read the generator the last construction calls (libcst) and evaluate its
    construction's arguments in `module`. Raises HarnessError, with the reason, when the
    generator or its `x = yield ...` cannot be found, a field of the sent value cannot be
    tied to a parameter, or an argument cannot be evaluated outside training."""
    call = cst.parse_expression(recipe.original[-1])
    if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Name):
        raise HarnessError(f"the construction `{recipe.original[-1]}` does not call a generator function by name")
    name = call.func.value
    functions = [f for f in recipe.survey.collector.functions if f.name.value == name]
    if len(functions) != 1:
        raise HarnessError(f"generator `{name}` not found (or defined more than once)")
    function = functions[0]
    received = [a.targets[0].target.value for a in m.findall(function, m.Assign(targets=[m.AssignTarget(m.Name())], value=m.Yield()))]
    if len(set(received)) != 1:
        raise HarnessError(f"`{name}` binds no one name from `x = yield ...`")
    params = [p.name.value for p in function.params.params]
    unpacked = [a.targets[0].target for a in m.findall(function, m.Assign(targets=[m.AssignTarget(m.Tuple() | m.List())], value=m.Name(received[0])))]
    names = [e.value.value for e in unpacked[0].elements] if unpacked and all(isinstance(e.value, cst.Name) for e in unpacked[0].elements) else [received[0]]
    fields = [_parameter_of(function, params, n) for n in names]
    missing = [n for n, f in zip(names, fields) if f is None]
    if missing:
        raise HarnessError(f"`{name}`: the sent value's {', '.join(f'`{n}`' for n in missing)} set no parameter of the generator that could be told")
    return SendProtocol(name, received[0], fields, _bound_arguments(recipe, module, function, call, set(fields)))


def _parameter_of(function: cst.FunctionDef, params: list[str], name: str) -> str | None:
    """The generator parameter a received name sets: the name itself, the target of
    `param = <expression starting with the name>`, or the name without a `new_` prefix."""
    if name in params:
        return name
    for assign in m.findall(function, m.Assign(targets=[m.AssignTarget(m.Name())])):
        target = assign.targets[0].target.value
        used = m.findall(assign.value, m.Name())
        if target in params and used and used[0].value == name:
            return target
    for prefix in _NEW_PREFIXES:
        if name.startswith(prefix) and name[len(prefix):] in params:
            return name[len(prefix):]
    return None


def _bound_arguments(recipe: IteratorRecipe, module, function: cst.FunctionDef, call: cst.Call, wanted: set[str]) -> dict:
    """{parameter: value} for the parameters in `wanted`, from the call's positional and
    keyword arguments or the parameter's default. Raises HarnessError when one cannot be
    evaluated."""
    params = function.params.params
    codes = {}
    for position, arg in enumerate(a for a in call.args if a.keyword is None and not a.star):
        if position < len(params):
            codes[params[position].name.value] = arg.value
    for arg in call.args:
        if arg.keyword is not None:
            codes[arg.keyword.value] = arg.value
    for param in params:
        if param.name.value not in codes and param.default is not None:
            codes[param.name.value] = param.default
    values = {}
    for name in wanted:
        if name not in codes:
            raise HarnessError(f"the construction passes no `{name}` and the generator has no default for it")
        values[name] = recipe.evaluate(cst.Module([]).code_for_node(codes[name]), module)
    return values


def synthesized_schedules(protocol: SendProtocol) -> list[tuple[str, list]]:
    """Candidate stage changes, best first: (how they were made, [value sent at the first
    change, at the second]). The token count is the field with the largest int value; it
    is scaled by 2, then by 3/2 (3 times the construction's: a multiple of what the
    generator accepted stays divisible by what it divides by), the next largest int field
    doubled in the first candidate; the other fields keep their values. Empty where no
    field holds a positive int."""
    ints = sorted((v, f) for f, v in protocol.base.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0)
    if not ints:
        return []
    tokens = ints[-1][1]
    second = ints[-2][1] if len(ints) > 1 else None

    def value(scaled: dict) -> object:
        fields = [scaled.get(f, protocol.base[f]) for f in protocol.fields]
        return tuple(fields) if len(protocol.fields) > 1 or protocol.fields[0] != protocol.received else fields[0]

    base = protocol.base
    candidates = []
    if second is not None and second != tokens and base[second] > 1:
        candidates.append((f"`{tokens}` x2 and `{second}` x2, then `{tokens}` x3", [value({tokens: 2 * base[tokens], second: 2 * base[second]}), value({tokens: 3 * base[tokens], second: 2 * base[second]})]))
    candidates.append((f"`{tokens}` x2, then x3", [value({tokens: 2 * base[tokens]}), value({tokens: 3 * base[tokens]})]))
    candidates.append((f"`{tokens}` x2, then back", [value({tokens: 2 * base[tokens]}), value({})]))
    return candidates


def may_send_none(recipe: IteratorRecipe) -> bool:
    """Whether the script's `target.send(value)` may pass None: a literal None among what
    the argument may be (a conditional, a name assigned None), or an attribute argument
    (`manager.send_args`) that the script assigns None somewhere (`self.send_args = None`)."""
    surveyed = recipe.survey
    scopes = dict(surveyed.collector.send_calls)

    def none_in(expr, scope, depth) -> bool:
        if m.matches(expr, m.Name("None")):
            return True
        if isinstance(expr, cst.IfExp):
            return none_in(expr.body, scope, depth) or none_in(expr.orelse, scope, depth)
        if isinstance(expr, cst.Name) and depth < 3:
            home = scope.resolve(expr.value)
            return home is not None and any(kind == "assign" and value is not None and none_in(value, home, depth + 1) for kind, value in home.bindings[expr.value])
        if isinstance(expr, cst.Attribute):
            pattern = m.Assign(targets=[m.AssignTarget(m.Attribute(attr=m.Name(expr.attr.value)))], value=m.Name("None"))
            return bool(m.findall(surveyed.module, pattern))
        return False

    for call, scope in scopes.items():
        target = call.func.value if isinstance(call.func, cst.Attribute) else None
        if m.matches(target, m.Name(recipe.target)) and call.args and none_in(call.args[0].value, scope, 0):
            return True
    return False
