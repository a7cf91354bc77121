"""The packages import only downward: every import of every .py file, parsed with ``ast``.

Layers, bottom to top (a layer may always import itself):

    collectives                 parallelisms/collectives.py, the one door to torch.distributed's
                                collectives: nothing of the project; every layer but models may import it
    models                      nothing of the project but models
    parallelisms                models
    moevement.base              operators.py, failures.py, topology.py: nothing of the project
    moevement.storage           base
    moevement.checkpoint        storage, base
    moevement.recovery          checkpoint, storage, base
    moevement (the package, strategy, clean)
                                all of moevement
    baselines                   moevement
    simulator                   baselines, moevement
    trainer                     everything above this line
    eval, benchmarks, train.py, tests
                                anything

moevement, baselines and simulator know operators and tensors, never model classes: none of them
imports ``models``, ``parallelisms`` (but its collectives) or ``trainer``. Module-level and function-level
imports count alike.

Inside the trainer layer, the parts of `NO_CYCLE` import one way only: of trainer.lifecycle, trainer.records,
trainer.run and trainer.estimates each may import the ones before it and not the reverse; trainer.data may
import trainer.config and not the reverse.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest

from tests.helpers import DEBUG_CONFIG, module_name, python_files, recoveries, run_cli

ROOT = Path(__file__).resolve().parents[1]

# layer -> the modules it holds (a module and everything under it; the longest prefix wins)
LAYERS: dict[str, tuple[str, ...]] = {
    "collectives": ("parallelisms.collectives",),
    "models": ("models",),
    "parallelisms": ("parallelisms",),
    "moevement.base": ("moevement.operators", "moevement.failures", "moevement.topology"),
    "moevement.storage": ("moevement.storage",),
    "moevement.checkpoint": ("moevement.checkpoint",),
    "moevement.recovery": ("moevement.recovery",),
    # the top of moevement: the package itself, strategy.py, clean.py (a CLI) and any other module placed
    # directly in moevement/ (which then may import all of moevement, and no lower layer may import it)
    "moevement": ("moevement", "moevement.strategy", "moevement.clean"),
    "baselines": ("baselines",),
    "simulator": ("simulator",),
    "trainer": ("trainer",),
    "top": ("eval", "benchmarks", "train", "tests"),
}

MOEVEMENT = frozenset(layer for layer in LAYERS if layer.startswith("moevement"))
# moevement knows operators and tensors: no model class, no parallelism; its collectives go through the one door
BELOW_MOEVEMENT: frozenset[str] = frozenset({"collectives"})

# layer -> the other layers it may import
MAY_IMPORT: dict[str, frozenset[str]] = {
    "collectives": frozenset(),
    "models": frozenset(),
    "parallelisms": frozenset({"models", "collectives"}),
    "moevement.base": BELOW_MOEVEMENT,
    "moevement.storage": BELOW_MOEVEMENT | {"moevement.base"},
    "moevement.checkpoint": BELOW_MOEVEMENT | {"moevement.storage", "moevement.base"},
    "moevement.recovery": BELOW_MOEVEMENT | {"moevement.checkpoint", "moevement.storage", "moevement.base"},
    "moevement": BELOW_MOEVEMENT | MOEVEMENT,
    "baselines": BELOW_MOEVEMENT | MOEVEMENT,
    "simulator": BELOW_MOEVEMENT | MOEVEMENT | {"baselines"},
    "trainer": frozenset({"collectives", "models", "parallelisms", "baselines", "simulator"}) | MOEVEMENT,
    "top": frozenset(LAYERS),
}


def layer_of(module: str) -> str | None:
    """The layer holding ``module`` (longest matching prefix), or None when no layer does."""
    best, best_len = None, -1
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    return best


def imported_modules(source: str, module: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``source`` (any depth), relative ones resolved against
    ``module``; ``from a import b`` names ``a.b`` when that is a module of ``known``. ``__future__`` is skipped."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            if base == "__future__":
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}" if base else alias.name
                out.append((node.lineno, full if full in known else base))
    return out


def violations(files: list[Path]) -> list[str]:
    """One ``file: imports X (layer A may not import layer B)`` per forbidden import, and one line per
    project file no layer holds."""
    modules = {module_name(p, ROOT): p for p in files}
    roots = {m.split(".")[0] for m in modules}
    out = []
    for module, path in modules.items():
        rel = path.relative_to(ROOT)
        layer = layer_of(module)
        if layer is None:
            out.append(f"{rel}: in no layer (add {module!r} to LAYERS in tests/test_layering.py)")
            continue
        is_package = path.name == "__init__.py"
        for line, target in imported_modules(path.read_text(), module, is_package, set(modules)):
            if target.split(".")[0] not in roots:
                continue  # the standard library or a third-party package
            target_layer = layer_of(target)
            if target_layer is None:
                out.append(f"{rel}:{line}: imports {target} (in no layer)")
            elif target_layer != layer and target_layer not in MAY_IMPORT[layer]:
                out.append(f"{rel}:{line}: imports {target} (layer {layer} may not import layer {target_layer})")
    return out


def test_every_layer_has_rules():
    assert set(MAY_IMPORT) == set(LAYERS)
    assert all(allowed <= set(LAYERS) for allowed in MAY_IMPORT.values())


def test_imports_only_go_down():
    files = python_files(ROOT)
    assert ROOT / "moevement" / "operators.py" in files and ROOT / "train.py" in files
    found = violations(files)
    assert not found, f"{len(found)} layering violation(s):\n" + "\n".join(found)


def write_tree(root: Path, sources: dict[str, str]) -> None:
    """A project of `sources` (path -> text) under `root`, for the checkers' own tests."""
    for name, text in sources.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_checker_flags_upward_imports(tmp_path, monkeypatch):
    """The checker itself: an upward import, a model import from moevement and a relative import are caught."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    sources = {
        "models/__init__.py": "",
        "trainer/__init__.py": "",
        "moevement/__init__.py": "",
        "moevement/operators.py": "",
        "moevement/failures.py": "from moevement import operators\n",
        "moevement/recovery/__init__.py": "",
        "moevement/recovery/fetch.py": "from . import replay\nfrom ..storage.snapshot import Snapshot\n",
        "moevement/recovery/replay.py": "",
        "moevement/storage/__init__.py": "",
        "moevement/storage/snapshot.py": "def f():\n    from moevement.recovery import fetch\n",
        "moevement/checkpoint/__init__.py": "import models\nimport torch\n",
    }
    write_tree(tmp_path, sources)
    assert sorted(violations(python_files(tmp_path))) == [
        "moevement/checkpoint/__init__.py:1: imports models (layer moevement.checkpoint may not import layer models)",
        "moevement/storage/snapshot.py:2: imports moevement.recovery.fetch "
        "(layer moevement.storage may not import layer moevement.recovery)",
    ]


# Parts of the trainer layer that must not import each other both ways: the lower one of each pair is
# named first (the records write what the lifecycle's lines say, the run wires the lifecycle and the records,
# the estimates size what the run builds; the config aggregates the data's section, which only the data
# preparation's command line reads back).
ONE_WAY: tuple[str, ...] = ("trainer.lifecycle", "trainer.records", "trainer.run", "trainer.estimates")
NO_CYCLE: tuple[tuple[str, str], ...] = (*itertools.combinations(ONE_WAY, 2), ("trainer.config", "trainer.data"))


def imports_between(files: list[Path], importer: str, imported: str) -> list[str]:
    """``file:line: imports X`` for every import (any depth, ``TYPE_CHECKING`` ones too) by a module of
    ``importer`` (a module and everything under it) of a module of ``imported``."""
    modules = {module_name(p, ROOT): p for p in files}

    def inside(module: str, prefix: str) -> bool:
        return module == prefix or module.startswith(prefix + ".")

    out = []
    for module, path in modules.items():
        if inside(module, importer):
            imports = imported_modules(path.read_text(), module, path.name == "__init__.py", set(modules))
            rel = path.relative_to(ROOT)
            out += [f"{rel}:{line}: imports {target}" for line, target in imports if inside(target, imported)]
    return out


def cycles(files: list[Path]) -> list[str]:
    """For each pair of `NO_CYCLE` that imports each other both ways, its upward imports (the lower part's)."""
    out = []
    for lower, upper in NO_CYCLE:
        if imports_between(files, upper, lower):
            out += imports_between(files, lower, upper)
    return out


def test_the_lifecycle_and_the_run_and_the_config_and_the_data_import_one_way():
    found = cycles(python_files(ROOT))
    assert not found, "import cycle(s) inside the trainer:\n" + "\n".join(found)


def test_checker_flags_a_cycle(tmp_path, monkeypatch):
    """The cycle check itself: each direction alone passes, both ways fail on the lower part's import."""
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    sources = {
        "trainer/__init__.py": "",
        "trainer/config.py": "",
        "trainer/data/__init__.py": "",
        "trainer/data/corpus.py": "from trainer.config import DataConfig\n",
        "trainer/lifecycle/__init__.py": "",
        "trainer/lifecycle/survival.py": "",
        "trainer/run/__init__.py": "",
        "trainer/run/event_log.py": "from trainer.lifecycle import survival\n",
    }
    write_tree(tmp_path, sources)
    assert cycles(python_files(tmp_path)) == []
    (tmp_path / "trainer/lifecycle/survival.py").write_text("def f():\n    from trainer.run import event_log\n")
    upward = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import trainer.data\n"
    (tmp_path / "trainer/config.py").write_text(upward)
    assert sorted(cycles(python_files(tmp_path))) == [
        "trainer/config.py:3: imports trainer.data",
        "trainer/lifecycle/survival.py:2: imports trainer.run.event_log",
    ]


def assert_calls_only_downward(rows: list[list[str]]) -> None:
    """Calls between project modules never go back and forth (A calls B and B calls A), and every module
    that calls another is on the failure path that docs/design/failure-path.md lists."""
    calls = {(caller, callee) for caller, callee, _ in rows if caller not in ("None", callee)}
    assert ("moevement/recovery/localized.py", "moevement/recovery/conversion.py") in calls, "trace is empty"
    back_and_forth = sorted(f"{a} <-> {b}" for a, b in calls if (b, a) in calls and a < b)
    assert not back_and_forth, back_and_forth
    design = (ROOT / "docs" / "design" / "failure-path.md").read_text()
    listed = design[design.index("<!-- failure-path: begin") : design.index("<!-- failure-path: end")]
    callers = {caller for caller, _ in calls}
    unlisted = sorted(m for m in callers if f"`{m}`" not in listed and f"`{m.split('/', 1)[1]}`" not in listed)
    assert not unlisted, f"modules on the failure path that docs/design/failure-path.md does not list: {unlisted}"


def traced_run(tmp_path, *fault: str, start: str = "recover") -> tuple[str, list[list[str]]]:
    """A pp=2 moevement run with `fault`, rank 1's main thread traced from `MoEvement.<start>`."""
    trace = tmp_path / "trace"
    trace.mkdir()
    out = run_cli(
        *("--config", DEBUG_CONFIG, "--training.steps", "12", "--training.val_every", "0", "--parallelism.pp", "2"),
        *("--checkpoint.strategy", "moevement", "--checkpoint.window", "3", *fault),
        *("--checkpoint.host_dir", str(tmp_path / "shm"), "--metrics.tensorboard", "false"),
        nproc=2,
        env={"PYTHONPATH": str(ROOT / "tests" / "call_trace"), "CALL_TRACE_DIR": str(trace), "CALL_TRACE_FROM": start},
    ).stdout
    return out, [line.split("\t") for line in (trace / "rank1.tsv").read_text().splitlines()]


@pytest.mark.slow  # about 25 s; the imports' direction is checked in the default suite
def test_localized_recovery_calls_only_downward(tmp_path):
    """From the failure to the next iteration, the failed rank's calls go only downward (see above), so that
    docs/design/failure-path.md's list follows the code."""
    out, rows = traced_run(tmp_path, "--fault.at", "10:1")
    assert any((r.step, r.ranks) == (10, (1,)) for r in recoveries(out)), out
    assert_calls_only_downward(rows)


@pytest.mark.slow
def test_a_replacement_after_a_real_death_calls_only_downward(tmp_path):
    """Rank 1 really dies and its rank shell's standby replaces it in place: the replacement's rejoin (from
    `MoEvement.resume` to training on) calls only downward too."""
    out, rows = traced_run(tmp_path, "--fault.kill", "10:1:backward", start="resume")
    assert any((r.step, r.ranks, r.restart) == (10, (1,), "replaced") for r in recoveries(out)), out
    assert_calls_only_downward(rows)
