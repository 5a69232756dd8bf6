"""The shape of the code: no import cycle, library code never imports the testbed, decoding state kept off the
drafter."""

import ast
from pathlib import Path

import torch

from adaflash_hf import SpeculationRuntime, generate_batch
from adaflash_hf.online import OnlineSpecAdapter, OnlineSpecConfig

from .conftest import build_drafter, device_cost, make_tiny_target, speculate


PACKAGE = Path(__file__).resolve().parent.parent / "adaflash_hf"


def _import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> modules it imports (top-level or inside functions), within the package."""
    files = {}
    for f in root.rglob("*.py"):
        if f.parent.parent.name == "checkpoints":  # code copies next to checkpoints are data
            continue
        parts = f.relative_to(root.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f

    def resolve(module: str, node) -> list[str]:
        package = module if files[module].name == "__init__.py" else module.rsplit(".", 1)[0]
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            candidates = [name] + [f"{name}.{a.name}" for a in node.names]
        else:
            candidates = [a.name for a in node.names]
        found = []
        for c in candidates:
            while c and c not in files:
                c = c.rsplit(".", 1)[0] if "." in c else ""
            if c and c != module and not module.startswith(c + "."):
                found.append(c)
        return found

    return {m: {t for node in ast.walk(ast.parse(f.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom))
                for t in resolve(m, node)} for m, f in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_package_has_no_import_cycle():
    graph = _import_graph(PACKAGE)
    assert len(graph) > 40 and "adaflash_hf.bench.models" in graph["adaflash_hf.cli"]
    assert _cycles(graph) == []


# The experiment harness: the offline testbed, and the benches and CLIs that run on it.
HARNESS = ("adaflash_hf.testbed", "adaflash_hf.bench", "adaflash_hf.cli", "adaflash_hf.checkpoints.__main__")


def test_library_code_never_imports_the_testbed():
    graph = _import_graph(PACKAGE)
    harness = lambda m: any(m == h or m.startswith(h + ".") for h in HARNESS)  # noqa: E731
    library = {m: deps for m, deps in graph.items() if not harness(m)}
    assert "adaflash_hf.generation.cost_model" in library and "adaflash_hf.testbed.corpus" in graph
    leaks = {m: sorted(d for d in deps if d.startswith("adaflash_hf.testbed")) for m, deps in library.items()}
    # Two lazy imports on purpose: the label store refuses the testbed's held-out prompts (held-out evaluation must
    # stay held out, even for a caller who forgot), and a bench summary's "testbed:" target maps to its Hub id.
    allowed = {"adaflash_hf.training.label_store": ["adaflash_hf.testbed", "adaflash_hf.testbed.sources"],
               "adaflash_hf.hub": ["adaflash_hf.testbed.model"]}
    assert {m: d for m, d in leaks.items() if d} == allowed


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_decoding_leaves_no_attribute_on_the_drafter():
    """generate, generate_batch, a length head, an online adapter: nothing is written onto the drafter object
    besides its declared attributes (`generation_config`, `runtime`), which the user sets."""
    from adaflash_hf.models import AdaFlashLengthHead, AdaFlashLengthHeadConfig

    target = make_tiny_target(seed=3)
    drafter = build_drafter(target, block_size=4, hybrid_lookup=True, allow_no_draft=True)
    head = AdaFlashLengthHead(AdaFlashLengthHeadConfig(hidden_size=64, block_size=4, head_dim=8)).eval()
    SpeculationRuntime(length_head=head, cost_model=device_cost({1: {1: 1.0, 4: 1.1}, 8: {1: 2.0, 4: 2.4}})).attach(
        drafter)
    OnlineSpecAdapter.attach(drafter, OnlineSpecConfig())
    before = set(vars(drafter))
    prompt = torch.tensor([[1, 2, 3, 1, 2, 3, 4]])
    _, stats = speculate(target, prompt, drafter, max_new_tokens=12)
    generate_batch(target, drafter, [[1, 2, 3], [4, 5, 6, 4, 5]], 10)
    target.generate(prompt, assistant_model=drafter, max_new_tokens=6, speculation_type="dflash")
    assert set(vars(drafter)) == before and stats.rounds > 0
    assert {"generation_config", "runtime"} <= before
