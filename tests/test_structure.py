"""How the package is wired, checked from its source: techniques reach measurement through its public seam only.

``memtrim.measure.hooks`` is what techniques tell the trackers (issue 12, item 1); everything else under
``memtrim.measure`` is the tracker's own. A module outside ``measure/`` may import ``memtrim.measure`` or
``memtrim.measure.hooks`` and, from them, only names those modules list in ``__all__``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import memtrim

SRC = Path(memtrim.__file__).parent
PUBLIC_MEASURE = ("memtrim.measure", "memtrim.measure.hooks")


def _module_name(relative: Path) -> str:
    parts = ("memtrim", *relative.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _outside_measure() -> list[Path]:
    return [p for p in sorted(SRC.rglob("*.py")) if "measure" not in p.relative_to(SRC).parts[:1]]


def _violations(relative: Path, source: str) -> list[str]:
    """Each import of, or attribute read from, measurement internals in one file (``relative`` to the package)."""
    name = _module_name(relative)
    package = name if relative.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(source, filename=str(relative))
    found: list[str] = []
    aliases: dict[str, str] = {}  # local name -> public measure module it is bound to

    def check_module(target: str, line: int) -> bool:
        if target == "memtrim.measure" or target.startswith("memtrim.measure."):
            if target not in PUBLIC_MEASURE:
                found.append(f"{relative}:{line} imports {target}")
                return False
            return True
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if check_module(alias.name, node.lineno) and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            target = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            if not (target == "memtrim.measure" or target.startswith("memtrim.measure.")):
                # `from memtrim import measure` / `from .. import measure`: a module bound to a name
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    if check_module(full, node.lineno):
                        aliases[alias.asname or alias.name] = full
                continue
            if not check_module(target, node.lineno):
                continue
            exported = set(importlib.import_module(target).__all__)
            for alias in node.names:
                if alias.name not in exported:
                    found.append(f"{relative}:{node.lineno} imports {alias.name} from {target}, "
                                 "which is not in its __all__")
                elif f"{target}.{alias.name}" in PUBLIC_MEASURE:
                    aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            target = aliases[node.value.id]
            if node.attr not in importlib.import_module(target).__all__:
                found.append(f"{relative}:{node.lineno} reads {target}.{node.attr}, "
                             "which is not in its __all__")
    return found


def test_the_check_sees_private_imports():
    """The checker itself: each way of reaching a private name is reported, public names are not."""
    source = (
        "from ...measure import _hooks\n"
        "from ...measure.tracker import tensors_in\n"
        "from ...measure.hooks import _active, hold_for_backward\n"
        "from ...measure import hooks as mh\n"
        "mh._local\n"
        "mh.current()\n"
        "import memtrim.measure.tracker\n"
    )
    found = _violations(Path("techniques", "optim", "probe.py"), source)
    assert [f.split(" ")[0] for f in found] == [f"techniques/optim/probe.py:{n}" for n in (1, 2, 3, 7, 5)], found
    assert not any("current" in f or "hold_for_backward" in f for f in found), found


def test_no_module_outside_measure_reaches_its_internals():
    found = [v for path in _outside_measure() for v in _violations(path.relative_to(SRC), path.read_text())]
    assert not found, "techniques must use memtrim.measure.hooks (the public seam):\n" + "\n".join(found)


def test_the_seam_is_documented():
    from memtrim.measure import hooks

    for name in hooks.__all__:
        assert getattr(hooks, name).__doc__, name
    assert set(hooks.Category) == set(memtrim.CATEGORIES)
    assert hooks.Category.GRADIENTS == "gradients" and str(hooks.Category.GRADIENTS) == "gradients"
