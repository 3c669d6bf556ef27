"""No import cycle among chatrl's modules, counting imports inside functions too (an ast walk)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "chatrl"


def module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """chatrl module → the chatrl modules it imports anywhere in its file (``from a import b``
    counts as importing ``a.b`` when that is a module, else ``a``)."""
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != mod and t != "chatrl":
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (c := visit(n)):
                return c
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_chatrl_modules_import_no_cycle():
    graph = import_graph()
    assert "chatrl.distributed.dist" in graph and graph["chatrl.step3_ppo.main"], "the walk found the package's imports"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def step_of(module: str) -> str | None:
    """The step package a module belongs to (``chatrl.step3_ppo``), or None for library code."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and parts[1].startswith("step") else None


def test_layers():
    """The layer rules of docs/architecture.md: library code (train.py's plan, chatrl.pipeline, included)
    never imports a step package, no step imports another, the RL maths and the token maths import
    only what is below them, and the hybrid engine takes its token maths from below."""
    graph = import_graph()
    for mod, targets in graph.items():  # no exception: a command of a step's starts it by module name
        for t in targets:
            if step_of(t) is not None:
                assert step_of(mod) == step_of(t), f"{mod} imports the step package of {t}"
    assert not any(step_of(t) for t in graph["chatrl.tools.replay"])
    assert {"chatrl.pipeline.plan", "chatrl.pipeline.presets", "chatrl.pipeline.evaluation"} <= set(graph)
    assert "chatrl.rl.algorithms" in graph["chatrl.pipeline.plan"]  # the walk reads the planner
    for mod in (m for m in graph if m.startswith("chatrl.pipeline")):  # the step parsers come in as an argument
        evaluation = {t for t in graph[mod] if t.startswith("chatrl.eval")}
        assert evaluation <= {"chatrl.eval.settings"}, f"{mod} imports {evaluation} (only the evaluation's block)"
    assert graph["chatrl.logprobs"] == set()
    for mod in (m for m in graph if m.startswith("chatrl.rl")):
        allowed = {m for m in graph if m.startswith("chatrl.rl")} | {"chatrl.logprobs", "chatrl.errors"}
        assert graph[mod] <= allowed, f"{mod} imports {graph[mod] - allowed} (the RL maths is pure)"
    assert "chatrl.logprobs" in graph["chatrl.hybrid_engine.decode"]
    assert "chatrl.models.reward_model" in graph["chatrl.step3_ppo.engine"]  # the reward model is library code


def tool_of(module: str) -> str | None:
    """The leaf tool a module is (``chatrl.tools.report``), or None."""
    return module if module.startswith("chatrl.tools.") else None


def test_leaf_tools_are_imported_by_nothing():
    """A leaf tool (``chatrl/tools/``: the report, the inspector, the replay, the web chat, the reward
    server, the template checker) is a command: no module of chatrl imports one, another tool included;
    the tools' package itself holds no code."""
    graph = import_graph()
    assert {"chatrl.tools.report", "chatrl.tools.web_chat", "chatrl.tools.inspector"} <= set(graph)
    for mod, targets in graph.items():
        for t in targets:
            assert tool_of(t) is None, f"{mod} imports the leaf tool {t}"
    assert graph["chatrl.tools"] == set()


def test_no_module_is_named_after_the_standard_library():
    """No chatrl module or package shares a name with a standard-library module (``http``, ``token``,
    ``logging``...): a reader would take one for the other, and a script beside it would shadow it."""
    import sys

    names = [(p, part) for p in PKG.rglob("*.py") for part in p.relative_to(PKG).with_suffix("").parts]
    clashes = sorted({f"{p.relative_to(PKG.parent)}" for p, part in names if part in sys.stdlib_module_names})
    assert not clashes, clashes


def test_the_top_level_shows_the_parts():
    """chatrl's top level holds at most 15 modules; the rest sits in packages named for what they are
    (docs/architecture.md)."""
    top = sorted(p.stem for p in PKG.glob("*.py") if p.name != "__init__.py")
    assert len(top) <= 15, top


def test_chatrl_imports_sit_at_module_tops():
    """chatrl's own imports are at the top of each module, where the graph can be read; only heavy
    third-party libraries (deepspeed, transformers, peft, ...) may be imported inside functions."""
    inside = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    names = ([sub.module or ""] if isinstance(sub, ast.ImportFrom) else
                             [a.name for a in sub.names] if isinstance(sub, ast.Import) else [])
                    if any(n == "chatrl" or n.startswith("chatrl.") for n in names):
                        inside.append(f"{path.relative_to(PKG.parent)}:{sub.lineno}")
    assert not inside, inside


def test_deepspeed_workarounds_live_in_one_module():
    """What chatrl changes in DeepSpeed is in chatrl.distributed.deepspeed_patches alone."""
    markers = ("build_shm_op", "reduce_scatter_function", "muon_optimizer", "allreduce_gradients")
    found = [f"{p.relative_to(PKG.parent)}: {m}" for p in PKG.rglob("*.py") if p.name != "deepspeed_patches.py"
             for m in markers if m in p.read_text()]
    assert not found, found


ROOT = PKG.parent
STEP_PACKAGES = ("step1_sft", "step2_reward", "step2_dpo", "step3_ppo")


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> int:
    """A function's parameters, ``self``/``cls`` not counted, ``*args`` and ``**kwargs`` one each."""
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def test_parameter_count_sees_every_kind_of_parameter():
    fn = ast.parse("def f(self, a, /, b, *c, d, **e): pass").body[0]
    assert parameter_count(fn) == 5
    assert parameter_count(ast.parse("lambda x, y=1: x").body[0].value) == 2


def test_no_function_takes_more_than_ten_parameters():
    """Settings travel as their typed blocks (chatrl.config) or a small dataclass naming what they are
    (sampling, loss, episodes, the ranks), not as long lists of loose arguments."""
    files = [p for base in ("chatrl", "tests", "scripts", "bench") for p in (ROOT / base).rglob("*.py")]
    files += [ROOT / "train.py", ROOT / "chat.py"]
    over = [f"{p.relative_to(ROOT)}:{n.lineno} {getattr(n, 'name', 'lambda')} ({parameter_count(n)})"
            for p in files for n in ast.walk(ast.parse(p.read_text(), str(p)))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and parameter_count(n) > 10]
    assert over == []


def chatrl_imports(path: Path) -> set[str]:
    """The distinct ``chatrl`` modules a file imports (``from chatrl.distributed import dist`` counts ``chatrl.distributed.dist``)."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(n, ast.ImportFrom) and n.module and (n.module + ".").startswith("chatrl."):
            out |= {f"chatrl.{a.name}" for a in n.names} if n.module == "chatrl" else {n.module}
        elif isinstance(n, ast.Import):
            out |= {a.name for a in n.names if (a.name + ".").startswith("chatrl.")}
    return out


def test_step3_program_reads_top_to_bottom():
    """Step 3's program wires parts that their own modules build (the hybrid engine's sampler, the
    reward's kinds, the settings' checks and plan, the engines): few imports, and no function of a step
    program longer than a screen."""
    imports = chatrl_imports(PKG / "step3_ppo" / "main.py")
    assert "chatrl.step3_ppo.trainer" in imports and len(imports) <= 12, sorted(imports)
    long = [f"{p.relative_to(ROOT)}:{n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for package in STEP_PACKAGES for p in (PKG / package).glob("*.py")
            for n in ast.walk(ast.parse(p.read_text(), str(p)))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 70]
    assert long == []
