"""The public namespaces: ``__all__`` is exactly what the package defines, every name resolves, and importing a
submodule never shadows a public name (as httpx's tests/test_exported_members.py pins its own)."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import pytest

import weightcache
import weightcache.backends

#: Subpackages exported on purpose: ``weightcache.quant.register`` is how a user adds a method.
EXPORTED_MODULES = {weightcache: {"quant"}, weightcache.backends: set()}
#: Private-looking names that are public.
EXPORTED_DUNDERS = {"__version__"}
#: What ``from __future__ import annotations`` binds in every module.
FUTURE = "annotations"


def defined_names(package: ModuleType) -> set[str]:
    """The public names ``package`` defines itself (not its submodules), plus those it loads on first use."""
    names = {
        name
        for name, value in vars(package).items()
        if (not name.startswith("_") or name in EXPORTED_DUNDERS)
        and name != FUTURE
        and not isinstance(value, ModuleType)
    }
    return names | set(getattr(package, "_LAZY", {})) | EXPORTED_MODULES[package]


def submodules(package: ModuleType) -> list[str]:
    """Every submodule but ``__main__`` (importing it runs the CLI)."""
    found = pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
    return [info.name for info in found if not info.name.endswith(".__main__")]


@pytest.mark.parametrize("package", [weightcache, weightcache.backends], ids=lambda p: p.__name__)
def test_all_is_what_the_package_defines(package: ModuleType) -> None:
    assert len(package.__all__) == len(set(package.__all__))
    assert set(package.__all__) == defined_names(package)
    for name in package.__all__:
        value = getattr(package, name)
        assert not isinstance(value, ModuleType) or name in EXPORTED_MODULES[package], name


@pytest.mark.parametrize("package", [weightcache, weightcache.backends], ids=lambda p: p.__name__)
def test_no_submodule_shadows_a_public_name(package: ModuleType) -> None:
    """Import every submodule (each sets itself as an attribute of its package); the public names stay what they
    were: ``import weightcache.api`` leaves ``weightcache.attach`` the function."""
    before = {name: getattr(package, name) for name in package.__all__}
    for name in submodules(package):
        importlib.import_module(name)
    for name, value in before.items():
        assert getattr(package, name) is value, f"{package.__name__}.{name} is shadowed by a submodule"
    clashes = {n.rpartition(".")[2] for n in submodules(package)} & set(package.__all__)
    assert clashes <= EXPORTED_MODULES[package]


def test_lazy_names_come_from_their_modules() -> None:
    for name, module in weightcache._LAZY.items():
        assert getattr(weightcache, name) is getattr(importlib.import_module(f"weightcache.{module}"), name)
    assert callable(weightcache.attach) and weightcache.attach.__module__ == "weightcache.api"
