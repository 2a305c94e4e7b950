"""platform/ARCHITECTURE.md names what the code has: every package and top-level module of
``apiary`` (in the package table, on the layer the import contract gives it), the layers in the
contract's order, every flow module in flows/, every store model class, and only ``apiary.*``
names that exist."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "platform"
DOC = SOURCE / "ARCHITECTURE.md"


def doc() -> str:
    return DOC.read_text()


def packages() -> list[str]:
    """Every package and top-level module of apiary but ``__init__`` (``__main__`` included)."""
    base = SOURCE / "apiary"
    found = [p.name for p in base.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    found += [p.stem for p in base.glob("*.py") if p.stem != "__init__"]
    return sorted(found)


def layers_contract() -> dict:
    """The one import-linter contract of type ``layers`` in pyproject.toml."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = [c for c in config["contracts"] if c["type"] == "layers"]
    assert len(contracts) == 1, "pyproject.toml's [tool.importlinter] needs one layers contract"
    assert contracts[0]["containers"] == ["apiary"]
    return contracts[0]


def contract_layers() -> list[list[str]]:
    """The layers contract's layers, high to low, each as its package names."""
    return [[name.strip() for name in re.split(r"[|:]", layer)] for layer in layers_contract()["layers"]]


def table_rows() -> dict[str, list[str]]:
    """The package table (the section "Packages and their contracts"): ``{name: [cells]}`` for each
    row whose first cell is ``apiary.<name>``."""
    m = re.search(r"^## Packages and their contracts\n(.*?)(?=^## )", doc(), re.S | re.M)
    assert m, "the section '## Packages and their contracts' is missing"
    rows = {}
    for line in m.group(1).splitlines():
        m = re.match(r"\|\s*`apiary\.([A-Za-z_]+)`\s*\|", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in line.strip().strip("|").split("|")]
    return rows


def store_models() -> list[str]:
    tree = ast.parse((SOURCE / "apiary" / "store" / "models.py").read_text())
    return sorted(n.name for n in tree.body if isinstance(n, ast.ClassDef)
                  and any(isinstance(b, ast.Name) and b.id == "Base" for b in n.bases))


def test_every_package_has_a_row_on_its_layer() -> None:
    layers = contract_layers()
    layer_of = {name: i for i, layer in enumerate(layers, 1) for name in layer}
    rows = table_rows()
    missing = [p for p in packages() if p not in rows]
    assert not missing, f"packages without a row in {DOC.name}'s package table: {missing}"
    unlayered = [p for p in packages() if p not in layer_of]
    assert not unlayered, f"packages without a layer in pyproject.toml's layers contract: {unlayered}"
    wrong = {p: (rows[p][1], layer_of[p]) for p in packages() if rows[p][1] != str(layer_of[p])}
    assert not wrong, f"the layer column (second) disagrees with the contract, {{package: (doc, contract)}}: {wrong}"
    gone = sorted(set(rows) - set(packages()))
    assert not gone, f"rows for packages that do not exist: {gone}"


def test_the_layers_block_is_the_contract() -> None:
    m = re.search(r"<!-- layers -->\n```\n(.*?)```", doc(), re.S)
    assert m, "the layers block (<!-- layers --> and a fenced block) is missing"
    listed = [line.split(".", 1)[1].split("  ")[0].strip() for line in m.group(1).splitlines() if line.strip()]
    assert listed == layers_contract()["layers"]


def test_every_flow_module_is_named() -> None:
    flows = sorted(p.name for p in (ROOT / "flows").glob("*.py"))
    assert flows
    missing = [f for f in flows if f"`flows/{f}`" not in doc()]
    assert not missing, f"flow modules not named (as `flows/<file>`) in {DOC.name}: {missing}"


def test_every_store_model_is_named() -> None:
    models = store_models()
    assert "Job" in models and "Token" in models
    missing = [m for m in models if f"`{m}`" not in doc()]
    assert not missing, f"store models not named in {DOC.name}: {missing}"


def _defined(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def unknown_names(text: str) -> list[str]:
    """Each ``apiary.a.b.C`` in backticks whose module path does not exist, or whose first name
    after the module is not defined at the module's top level."""
    bad = []
    for name in sorted(set(re.findall(r"`(apiary(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", text))):
        parts = name.split(".")
        path = SOURCE
        rest = parts
        for i, part in enumerate(parts):
            if (path / part / "__init__.py").exists():
                path, rest = path / part, parts[i + 1:]
            elif (path / f"{part}.py").exists():
                path, rest = path / f"{part}.py", parts[i + 1:]
                break
            else:
                break
        if rest:
            module = path / "__init__.py" if path.is_dir() else path
            if rest[0] not in _defined(module):
                bad.append(name)
    return bad


def test_the_name_checker_sees_missing_modules_and_names() -> None:
    assert unknown_names("`apiary.store.unit.UnitOfWork` `apiary.errors` `apiary.store.Job`") == []
    assert unknown_names("`apiary.store.nope` `apiary.store.unit.Nope` `apiary.nothing`") == [
        "apiary.nothing", "apiary.store.nope", "apiary.store.unit.Nope"]


@pytest.mark.parametrize("path", [DOC])
def test_every_apiary_name_in_the_doc_exists(path: Path) -> None:
    bad = unknown_names(path.read_text())
    assert not bad, f"{path.name} names modules or attributes that do not exist: {bad}"
