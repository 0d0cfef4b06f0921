"""Code rewards the solution cannot reach: the share of a problem's tests it passes.

A test is an assertion, as MBPP (`test_list`, with `test_imports` / `test_setup_code`), HumanEval (`test`, which
defines check(candidate), with `entry_point`) and most code data sets write them. Each is split on the host from its
syntax tree alone (nothing is run here): every expression rooted in a name the solution defines runs in the
solution's sandbox through its first call (`add(1, 2)`; of `compress(s).startswith(t)` only `compress(s)`, the rest
applied to its plain result where the solution never ran; a chain rooted in a class the solution defines,
`Stack().push(3).peek()`, whole) and comes back as plain data (JSON with type tags: None,
bools, ints, floats, complex, strings, bytes, lists, tuples, dicts, sets, a subclass as its base, numpy values as
lists; anything else, an object, is an error); the
rest of the assertion, those values in their place, runs in a second sandbox that never imports the solution (a warm
worker, a fresh fork per call). The solution never sees an expected value, and what it returns is judged by code it
cannot touch: an object whose __eq__ is always True cannot even be sent back; a shadowed `sorted` or `math` shadows
nothing where the comparison runs; an early exit, a printed verdict or a forged answer line earns nothing. The
test's set-up (imports, helpers, oracles, expected data) runs only where the comparison runs; a set-up value a call
into the solution takes as its argument is sent to it as data.

Which names are the solution's: those an assertion uses without defining them, except builtins, names the test's
set-up defines, and standard-library modules used as modules (`math.isclose`); a problem whose function shadows a
builtin names it in `entry_point`. When a solution is graded, each such name must be one its own source binds at
its top level (or an entry point): a name bound where the source does not show it (`from math import *`, `exec`,
`globals().update`, a function's `global`) is nobody's, and a test that uses one fails. A test that cannot be split so (not one assertion; a call into the solution inside
a comprehension or lambda, whose variables exist only where the test runs; no call into the solution at all) is
refused when the problem is read, counted (Problem.unsplittable, reported as reward/unsplittable_tests), never run.

    read_problem(label)      -> Problem(setup, modules, tests, unsplittable)
    grade(code, problem)     -> the share of its tests passed, in [0, 1] (blocking: await molt.offload(grade, ...))
"""
import ast
import builtins
import json
import os
import sys
from dataclasses import dataclass, field

import molt

sandbox = molt.import_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox.py"))

VALUE_BYTES = 1 << 20  # one value sent back; a longer line is an error
WORKERS = int(os.environ.get("MOLT_GRADER_WORKERS", min(4, os.cpu_count() or 1)))


@dataclass
class Test:
    expr: str  # the assertion's expression, each solution part replaced by _molt_v{i}
    parts: list[str]  # the solution-rooted expressions, in that order
    names: set[str] = field(default_factory=set)  # the names it takes for the solution's
    # each part as (its root name, its chain through the first call, the rest of the chain over _molt_x)
    chains: list[tuple] = field(default_factory=list)
    given: set[str] = field(default_factory=set)  # the set-up's names its parts use (sent to them as data)


@dataclass
class Problem:
    setup: str = ""  # the test's own imports and helpers: run where the comparison runs (and before the parts)
    entries: set[str] = field(default_factory=set)  # names that are the solution's whatever else they are
    modules: list[str] = field(default_factory=list)  # standard modules the tests use without importing them
    tests: list[Test] = field(default_factory=list)
    unsplittable: int = 0


class Unsplittable(ValueError):
    pass


def read_problem(label: dict) -> Problem:
    """A problem's tests from its label: {"tests" | "test_list": [...], "setup" | "test_setup_code": str,
    "test_imports": [...]} or HumanEval's {"test": source with check(candidate), "entry_point": name}."""
    setup = "\n".join([*label.get("test_imports", []), label.get("setup") or label.get("test_setup_code") or ""])
    tests, entry = list(label.get("tests") or label.get("test_list") or []), label.get("entry_point")
    refused = 0
    if isinstance(label.get("test"), str) and isinstance(entry, str):
        more_setup, tests, refused = humaneval_tests(label["test"], entry)
        setup += "\n" + more_setup
    try:
        tree = ast.parse(setup)
    except SyntaxError as err:
        raise ValueError(f"the problem's test set-up does not parse: {err}") from None
    entries = set(entry if isinstance(entry, list) else [entry] if entry else [])
    problem, own = Problem(setup=setup, entries=entries, unsplittable=refused), defined_names(tree) - entries
    for test in tests:
        try:
            problem.tests.append(split_test(test, own, entries, problem.modules))
        except Unsplittable:
            problem.unsplittable += 1
    return problem


def humaneval_tests(source: str, entry: str) -> tuple[str, list[str], int]:
    """HumanEval's test program -> (its set-up: everything but check, plus check's imports; check's assertions with
    the candidate renamed to the entry point; how many assertions were refused). A check that does more than assert
    (a loop, an assignment) is refused whole: its assertions may depend on what it did."""
    tree = ast.parse(source)
    check = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "check"), None)
    if check is None or not check.args.args:
        raise ValueError("a HumanEval test needs a check(candidate) function")
    candidate = check.args.args[0].arg
    setup = [ast.unparse(n) for n in tree.body if n is not check]
    asserts, other = [], 0
    for node in check.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            setup.append(ast.unparse(node))
        elif isinstance(node, ast.Assert):
            for name in (n for n in ast.walk(node) if isinstance(n, ast.Name) and n.id == candidate):
                name.id = entry
            asserts.append(ast.unparse(node))
        elif not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)):  # a docstring is harmless
            other += 1
    if other:
        return "\n".join(setup), [], sum(isinstance(n, ast.Assert) for n in ast.walk(check))
    return "\n".join(setup), asserts, 0


def defined_names(tree: ast.AST) -> set[str]:
    """Every name a piece of code binds (imports, definitions, assignments), anywhere in it."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
    return names


def top_level_names(code: str, classes: bool = False) -> set[str]:
    """The names a solution's source binds at its top level (in if / try / with / for blocks too, not inside a
    function, class, lambda or comprehension), or only its classes; none if it does not parse."""
    try:
        todo, names = list(ast.parse(code).body), set()
    except SyntaxError:
        return set()
    scopes = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names |= {node.name} if not classes or isinstance(node, ast.ClassDef) else set()
        elif classes:
            todo += [n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt)]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name != "*"}
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            names.add(node.id)
        elif not isinstance(node, scopes):
            todo += ast.iter_child_nodes(node)
    return names


def split_test(test: str, own: set[str], entries: set[str], modules: list[str]) -> Test:
    """One assertion -> its expression with the solution's parts cut out (Unsplittable if it cannot be). own: names
    the test itself defines; entries: names that are the solution's whatever else they are; standard modules the
    test uses as modules are appended to `modules`."""
    try:
        body = ast.parse(test).body
    except SyntaxError:
        raise Unsplittable(test) from None
    if len(body) != 1 or not isinstance(body[0], (ast.Assert, ast.Expr)):
        raise Unsplittable(test)
    expr = body[0].test if isinstance(body[0], ast.Assert) else body[0].value
    bound = defined_names(expr) | {a.arg for n in ast.walk(expr) if isinstance(n, ast.Lambda) for a in
                                   [*n.args.posonlyargs, *n.args.args, *n.args.kwonlyargs, n.args.vararg, n.args.kwarg]
                                   if a is not None}
    used = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)} - bound
    as_modules = {n.value.id for n in ast.walk(expr) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                  and n.value.id in sys.stdlib_module_names}
    cut = Cut(used - ((own | set(dir(builtins)) | as_modules) - entries), bound)
    expr = cut.visit(expr)
    if not cut.parts:
        raise Unsplittable(test)  # it tests nothing of the solution's
    modules += sorted(m for m in (as_modules & used) - own - entries if m not in modules)
    return Test(ast.unparse(expr), [part for part, _ in cut.parts], set(cut.solution),
                [(root_name(node), *first_call(node)) for _, node in cut.parts],
                {n.id for _, node in cut.parts for n in ast.walk(node) if isinstance(n, ast.Name)} & own)


def root_name(node: ast.AST) -> str | None:
    """The name an expression's chain of calls, attributes and subscripts starts from: f in f(1)[0].x."""
    while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def first_call(node: ast.AST) -> tuple[str, str]:
    """A solution-rooted chain -> (the chain through its first call, the rest over _molt_x): compress('ab').upper()
    -> ("compress('ab')", "_molt_x.upper()"); no call: (the chain, "_molt_x")."""
    whole, inner, first = ast.unparse(node), node, None
    while isinstance(inner, (ast.Call, ast.Attribute, ast.Subscript)):
        first = inner if isinstance(inner, ast.Call) else first
        inner = inner.func if isinstance(inner, ast.Call) else inner.value
    prefix = ast.unparse(first) if first is not None else whole
    return (prefix, "_molt_x" + whole[len(prefix):]) if whole.startswith(prefix) else (whole, "_molt_x")


class Cut(ast.NodeTransformer):
    """Replaces each largest expression rooted in one of the solution's names by _molt_v{i}, keeping (its source, its
    node)."""

    def __init__(self, solution: set[str], bound: set[str]):
        self.solution, self.bound, self.parts = solution, bound, []

    def visit(self, node):
        if isinstance(node, ast.expr) and root_name(node) in self.solution:
            if {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & self.bound:
                raise Unsplittable("a call into the solution uses a variable the test binds")
            self.parts.append((ast.unparse(node), node))
            return ast.copy_location(ast.Name(f"_molt_v{len(self.parts) - 1}", ast.Load()), node)
        return self.generic_visit(node)


# Plain data as JSON with type tags (i int, f float, c complex, b bytes, t tuple, s set, fs frozenset, d dict), and
# back: the solution's values to the checker, the set-up's argument values to the solution.
ENCODE = r'''
# plain types, in the order they are tried (bool before int); a subclass (a Counter, a namedtuple, an int with its
# own __eq__) is sent as its plain base, so nothing but plain data reaches the comparison
_PLAIN = [(bool, None), (int, "i"), (float, "f"), (complex, "c"), (str, None), (bytes, "b"), (list, None),
          (tuple, "t"), (set, "s"), (frozenset, "fs"), (dict, "d")]
def _plain(v, depth=0):
    if depth > 100:
        raise ValueError("nested too deep")
    if v is None:
        return None
    base, tag = next(((t, tag) for t, tag in _PLAIN if isinstance(v, t)), (None, None))
    if base is None and callable(getattr(v, "tolist", None)):  # numpy arrays and scalars
        return _plain(v.tolist(), depth + 1)
    if base is None:
        raise TypeError(f"not plain data: {type(v).__name__}")
    if base is dict:
        payload = [[_plain(k, depth + 1), _plain(x, depth + 1)] for k, x in dict.items(v)]
    elif base in (list, tuple, set, frozenset):
        payload = [_plain(x, depth + 1) for x in base.__iter__(v)]
    elif base is complex:
        payload = [complex(v).real.hex(), complex(v).imag.hex()]
    else:
        payload = base(v) if tag is None else hex(int(v)) if base is int else base(v).hex()
    return payload if tag is None else {tag: payload}
'''
DECODE = r'''
def _value(x, depth=0):
    if depth > 100:
        raise ValueError("nested too deep")
    if x is None or type(x) in (bool, str):
        return x
    if type(x) is list:
        return [_value(v, depth + 1) for v in x]
    (tag, v), = x.items()
    if tag in ("t", "s", "fs"):
        return {"t": tuple, "s": set, "fs": frozenset}[tag](_value(i, depth + 1) for i in v)
    if tag == "d":
        return {_value(k, depth + 1): _value(w, depth + 1) for k, w in v}
    return {"i": lambda: int(v, 16), "f": lambda: float.fromhex(v), "b": lambda: bytes.fromhex(v),
            "c": lambda: complex(float.fromhex(v[0]), float.fromhex(v[1]))}[tag]()
'''

# Runs in the solution's sandbox: the solution (never the test's set-up: its helpers, oracles and expected data stay
# where the comparison runs; the set-up's values a part names come as data), then each part, whose value goes back
# over fd 3 as one JSON line as soon as it is known (a later part that hangs keeps the earlier ones). The solution may
# forge these lines: it can only claim values, which is all returning them does.
HARNESS = ENCODE + DECODE + r'''
import importlib, json, os, sys
_req = json.loads(sys.stdin.read())
_ns = {"__name__": "__main__"}
try:
    exec(compile(_req["code"], "<solution>", "exec"), _ns)
except BaseException:
    pass
for _name in _req["modules"]:
    try:
        _ns.setdefault(_name, importlib.import_module(_name))
    except BaseException:
        pass
_given = {}  # the set-up's values the parts name (their arguments), as data
for _name, _v in _req["given"].items():
    try:
        _given[_name] = _value(_v)
    except BaseException:
        pass
for _part in _req["parts"]:
    try:
        _line = json.dumps(_plain(eval(_part, {**_ns, **_given})))
    except BaseException as _err:
        _line = json.dumps({"error": type(_err).__name__})
    os.write(3, _line.encode() + b"\n")
'''

# Runs in the checker's worker, which never sees the solution: the set-up's values the parts name, as data; then each
# test's expression with the plain values read back in place of the solution's parts (the rest of each chain applied
# here).
CHECKER = ENCODE + DECODE + r'''
import importlib, json

def _passes(ns, test):
    try:  # a part that raised came back as {"error": ...}, which no tag reads: the test fails
        values = {f"_molt_v{i}": eval(tail, {**ns, "_molt_x": _value(json.loads(line))})
                  for i, (line, tail) in enumerate(zip(test["values"], test["tails"]))}
        return bool(eval(test["expr"], {**ns, **values}))
    except Exception:
        return False

def _given(ns, name):
    try:
        return [(name, _plain(ns[name]))]
    except Exception:
        return []  # not plain data (a function): the part naming it fails

def handler(req):
    ns = {"__name__": "__main__"}
    for name in req["modules"]:
        ns[name] = importlib.import_module(name)
    exec(compile(req["setup"], "<test set-up>", "exec"), ns)
    if "given" in req:
        return {"given": dict(pair for name in req["given"] for pair in _given(ns, name))}
    return {"passed": [_passes(ns, test) for test in req["tests"]]}
'''
CHECKERS = sandbox.WorkerPool(CHECKER, WORKERS)


def grade(code: str, problem: Problem, timeout: float = sandbox.TIMEOUT) -> float:
    """The share of the problem's (splittable) tests the solution passes. Raises SandboxError when a sandbox cannot
    start and RuntimeError when the test's own set-up fails where the comparison runs: those are not the solution's
    failures."""
    if not problem.tests:
        return 0.0
    # a chain rooted in a class the solution defines runs whole where the solution runs (its objects cannot leave);
    # any other runs there through its first call only, its plain result taking the rest of the chain here
    classes = top_level_names(code, classes=True)
    sent = [(part, "_molt_x") if root in classes else (prefix, tail)
            for t in problem.tests for part, (root, prefix, tail) in zip(t.parts, t.chains)]
    parts, given = [part for part, _ in sent], sorted({n for t in problem.tests for n in t.given})
    values = CHECKERS.call({"setup": problem.setup, "modules": problem.modules, "given": given}, timeout) \
        if given else {"given": {}}
    if "given" not in values:
        raise RuntimeError(f"the tests' own set-up failed where they are checked: {values.get('error')}")
    request = {"code": code, "modules": problem.modules, "parts": parts, "given": values["given"]}
    _, _, back, _, _ = sandbox.run(HARNESS, json.dumps(request).encode(), timeout,  # what the parts may send back
                                   side=len(parts) * (VALUE_BYTES + 1))
    lines = [x.decode(errors="replace") if len(x) <= VALUE_BYTES else '{"error": "too long"}'
             for x in back.split(b"\n")[:len(parts)]]
    lines += ['{"error": "no value"}'] * (len(parts) - len(lines))
    tests, at = [], 0
    for t in problem.tests:
        tests.append({"expr": t.expr, "values": lines[at:at + len(t.parts)],
                      "tails": [tail for _, tail in sent[at:at + len(t.parts)]]})
        at += len(t.parts)
    verdict = CHECKERS.call({"setup": problem.setup, "modules": problem.modules, "tests": tests}, timeout)
    if "passed" not in verdict:
        if verdict.get("timeout"):
            return 0.0  # the values it sent made the comparison too slow
        raise RuntimeError(f"the tests' own code failed where they are checked: {verdict.get('error')}")
    known = top_level_names(code) | problem.entries  # a test using a name nobody is known to bind fails
    return sum(ok and t.names <= known for ok, t in zip(verdict["passed"], problem.tests)) / len(problem.tests)
