"""Threads a loader class reaches outside its own classes.

A loader that creates a `Thread` or an executor in its own methods is seen by
`loaders.py` (`THREAD_NAMES` among the names it calls). The same threads can come
from elsewhere in the script: a module-level helper function that the loader calls
(directly or through other helpers) starts one; a module-level name is bound to an
executor or a thread (`POOL = ThreadPoolExecutor(2)`, then `POOL.submit(...)` in
`next_batch`); the loader builds a class of the script that derives from
`threading.Thread`. Threads are not copied by `fork`: a forked producer would wait
forever on a pool whose workers stayed in the training process. `ThreadReach` finds
such a path from each method of the loader and says it as the refusal reads.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import libcst as cst

from patcher.cst_walk import children, dotted, small_statements, walk, walk_own
from patcher.survey.index import ScriptIndex

# Names whose call creates threads (or an executor's worker threads / processes).
THREAD_NAMES = {"ThreadPoolExecutor", "Thread", "ProcessPoolExecutor"}
# Module-level functions and classes followed from a loader's method, at most.
MAX_DEPTH = 6


def thread_kind(called: str) -> str:
    """What a call of the dotted name `called` (last part in `THREAD_NAMES`) creates:
    "a thread", "a thread pool" or "a process pool"."""
    last = called.split(".")[-1]
    return {"ThreadPoolExecutor": "a thread pool", "ProcessPoolExecutor": "a process pool"}.get(last, "a thread")


class ThreadReach:
    """The module-level facts about threads in one script, and the paths to them from a loader.

    Built once per survey from the module, its `ScriptIndex` and `line_of` (node ->
    1-based line). functions / classes: the module-level `def`s and `class`es by name
    (the last definition of a name wins, as in Python). thread_classes: the classes
    among them that derive from `threading.Thread` (directly or through another), each
    with the base it names. bound_threads: module-level names bound to a thread, an
    executor or an instance of a thread class, each with what it is and its line.
    """

    def __init__(self, module: cst.Module, index: ScriptIndex, line_of: Callable[[cst.CSTNode], int]):
        self.index, self.line_of = index, line_of
        self.functions: dict[str, cst.FunctionDef] = {}
        self.classes: dict[str, cst.ClassDef] = {}
        for stmt in module.body:
            if isinstance(stmt, cst.FunctionDef):
                self.functions[stmt.name.value] = stmt
            elif isinstance(stmt, cst.ClassDef):
                self.classes[stmt.name.value] = stmt
        self.thread_classes = self._thread_classes()
        self.bound_threads: dict[str, tuple[str, int]] = {}
        for stmt in small_statements(module.body):
            if isinstance(stmt, cst.Assign):
                targets = [t.target for t in stmt.targets]
            elif isinstance(stmt, cst.AnnAssign) and stmt.value is not None:
                targets = [stmt.target]
            else:
                continue
            what = self._creates(stmt.value)
            if what is not None:
                for target in targets:
                    if isinstance(target, cst.Name):
                        self.bound_threads[target.value] = (what, line_of(stmt))
        self._globals: dict[cst.FunctionDef, set[str]] = {}

    def _thread_classes(self) -> dict[str, str]:
        """Module-level classes deriving from `threading.Thread`, each with the base it names."""
        found: dict[str, str] = {}
        changed = True
        while changed:  # a subclass of a subclass, in any order of definition
            changed = False
            for name, cls in self.classes.items():
                if name in found:
                    continue
                for base in cls.bases:
                    base_name = dotted(base.value)
                    if base.keyword is None and (base_name.split(".")[-1] == "Thread" or base_name in found):
                        found[name] = base_name
                        changed = True
                        break
        return found

    def _creates(self, value: cst.BaseExpression) -> str | None:
        """What a module-level value creates when it is a thread, an executor or a
        thread-class instance: "a thread pool built at module level (ThreadPoolExecutor)"; else None."""
        if not isinstance(value, cst.Call):
            return None
        called = dotted(value.func)
        if called.split(".")[-1] in THREAD_NAMES:
            return f"{thread_kind(called)} built at module level ({called})"
        if isinstance(value.func, cst.Name) and called in self.thread_classes:
            return f"a thread built at module level ({called}, a subclass of {self._thread_root(called)})"
        return None

    def _thread_root(self, name: str) -> str:
        """The `threading.Thread` base that the thread class `name` derives from, as written."""
        seen = set()
        while name in self.thread_classes and name not in seen:
            seen.add(name)
            name = self.thread_classes[name]
        return name

    def reached(self, loader_classes: list[cst.ClassDef]) -> str | None:
        """Where the methods of `loader_classes` (the loader and the script classes it
        builds) reach a thread outside those classes, as the refusal says it, or None.

        Follows, breadth first and at most `MAX_DEPTH` deep, the module-level functions
        a method names (calls them, or hands them on as a callback) and the module-level
        classes it builds; stops at the first reached function that starts a thread, the
        first use of a module-level thread or executor, the first thread class built. A
        loader that is itself a thread (a subclass of `threading.Thread`) says so.
        """
        own = {id(cls) for cls in loader_classes}
        loader = loader_classes[0].name.value
        if loader in self.thread_classes:
            return f"`{loader}` is a subclass of {self._thread_root(loader)}: a forked producer would not have its thread; not wrapped"
        for cls in loader_classes:
            body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else []
            for stmt in body:
                if isinstance(stmt, cst.FunctionDef):
                    found = self._search(stmt, f"{cls.name.value}.{stmt.name.value}", own)
                    if found is not None:
                        return found
        return None

    def _search(self, start: cst.FunctionDef, origin: str, own: set[int]) -> str | None:
        queue: deque[tuple[cst.FunctionDef, tuple[str, ...]]] = deque([(start, ())])
        seen = {id(start)}
        while queue:
            function, path = queue.popleft()
            if path:  # a function or class outside the loader's own classes: its own thread calls count
                for node in walk(function):
                    if isinstance(node, cst.Call) and dotted(node.func).split(".")[-1] in THREAD_NAMES:
                        called = dotted(node.func)
                        return _reason(origin, path, f"starts {thread_kind(called)} ({called}, line {self.line_of(node)})", thread_kind(called))
            for name, scope, called in self._reads(function):
                if not self._module_level(name, scope):
                    continue
                if name in self.bound_threads:
                    what, line = self.bound_threads[name]
                    return _reason(origin, path, f"uses `{name}` (line {line}), {what}", what.split(" built")[0])
                if called and name in self.thread_classes:
                    cls = self.classes[name]
                    return _reason(origin, path, f"builds `{name}` (line {self.line_of(cls)}), a subclass of {self._thread_root(name)}", "a thread")
                if len(path) >= MAX_DEPTH:
                    continue
                if name in self.functions and id(self.functions[name]) not in seen:
                    target = self.functions[name]
                    seen.add(id(target))
                    queue.append((target, path + (f"`{name}` (line {self.line_of(target)})",)))
                elif called and name in self.classes and id(self.classes[name]) not in own:
                    cls = self.classes[name]
                    step = path + (f"`{name}` (line {self.line_of(cls)})",)
                    body = cls.body.body if isinstance(cls.body, cst.IndentedBlock) else []
                    for method in body:
                        if isinstance(method, cst.FunctionDef) and id(method) not in seen:
                            seen.add(id(method))
                            queue.append((method, step))
        return None

    def _module_level(self, name: str, scope) -> bool:
        """Whether `name`, read in `scope`, is the module's binding of it (`global` included)."""
        where = scope.resolve(name)
        if where is self.index.module_scope:
            return True
        if where is not None and isinstance(where.node, cst.FunctionDef):
            return name in self._declared_global(where.node)
        return False

    def _declared_global(self, function: cst.FunctionDef) -> set[str]:
        if function not in self._globals:
            self._globals[function] = {item.name.value for node in walk_own(function) if isinstance(node, cst.Global) for item in node.names}
        return self._globals[function]

    def _reads(self, function: cst.FunctionDef):
        """(name, scope, called) for each name `function` reads, nested functions included:
        attribute names, keywords, parameters, annotations and imports are not reads;
        `called` when the name is the callee of a call (`helper(...)`)."""
        module_scope = self.index.module_scope
        stack: list[tuple[cst.CSTNode, object]] = [(function, self.index.scope_of.get(function, module_scope))]
        while stack:
            node, scope = stack.pop()
            if isinstance(node, cst.Name):
                yield node.value, scope, False
            elif isinstance(node, cst.Call) and isinstance(node.func, cst.Name):
                yield node.func.value, scope, True
                stack.extend((arg, scope) for arg in reversed(node.args))
            elif isinstance(node, (cst.Attribute, cst.Arg)):
                stack.append((node.value, scope))
            elif isinstance(node, cst.Param):
                if node.default is not None:
                    stack.append((node.default, scope))
            elif isinstance(node, cst.FunctionDef):
                inner = self.index.scope_of.get(node, scope)
                stack.append((node.body, inner))
                stack.append((node.params, inner))
                stack.extend((d, scope) for d in reversed(node.decorators))
            elif isinstance(node, cst.ClassDef):
                stack.append((node.body, scope))
                stack.extend((b, scope) for b in reversed(node.bases))
            elif not isinstance(node, (cst.Annotation, cst.Import, cst.ImportFrom, cst.Global, cst.Nonlocal)):
                stack.extend((child, scope) for child in reversed(children(node)))


def _reason(origin: str, path: tuple[str, ...], end: str, kind: str) -> str:
    """The refusal: "`L.next_batch` reaches `f` (line 40), which starts a thread (...):
    a forked producer would not have it; not wrapped"."""
    missing = "it" if kind == "a thread" else "its workers"
    if not path:
        return f"`{origin}` {end}: a forked producer would not have {missing}; not wrapped"
    return f"`{origin}` reaches {', then '.join(path)}, which {end}: a forked producer would not have {missing}; not wrapped"
