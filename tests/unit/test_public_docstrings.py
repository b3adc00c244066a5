"""Every public name has a docstring, and every callable that raises documents it.

Every public name in ``elasticps.__init__`` has a
docstring (with shapes, units and errors), and the docs build from them.
These checks are inspect-based (objects, signatures and code objects), never
a regex over source files:

- ``elasticps.__all__`` and every module of :data:`PUBLIC_MODULES` that is
  importable: each public name (its ``__all__``, else the names it defines
  without a leading underscore) has its own, non-empty docstring: a class's
  ``__doc__`` is not inherited, so a subclass without one fails;
- every public method, classmethod, staticmethod and property defined in
  such a class (not inherited) has a docstring;
- a function or method whose own code raises an exception (a ``raise X``
  statement, not a bare re-raise nor an ``assert``) says so in a
  ``Raises:`` section (an override may rely on the section of the base
  method it overrides); for a class, a raising ``__init__`` or
  ``__post_init__`` is documented in the class or ``__init__`` docstring.

Modules of :data:`DOCSTRING_ONLY_MODULES` get the first two checks only.
Type aliases and constants are skipped: they cannot carry a docstring.
"""

from __future__ import annotations

import dis
import importlib
import importlib.util
import inspect
import typing
from collections.abc import Callable, Iterator
from types import CodeType, FunctionType, ModuleType
from typing import Any

import pytest

import elasticps

# Public modules whose API the user guide documents (docs/reference.md).
# A module that does not exist is skipped; once it exists, it is checked.
PUBLIC_MODULES = (
    "elasticps",
    "elasticps.errors",
    "elasticps.model_file",
    "elasticps.api.train",
    "elasticps.api.cluster",
    "elasticps.api.launch",
    "elasticps.events",
    "elasticps.parameters",
    "elasticps.updater",
    "elasticps.kvstore",
    "elasticps.dist",
    "elasticps.nn",
    "elasticps.tables",
    "elasticps.buffers",
    "elasticps.evaluate",
    "elasticps.launcher.kubernetes",
)
# Modules checked for docstrings only, not yet for their "Raises:" sections:
# the config dataclasses raise ConfigError from __post_init__ without saying
# so in their docstrings (reported to the lead; move them up once fixed).
DOCSTRING_ONLY_MODULES = ("elasticps.config",)

# Names that cannot carry a docstring of their own.
NOT_DOCUMENTABLE = frozenset({"__version__"})


def _exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _public_names(module: ModuleType) -> list[str]:
    exported = getattr(module, "__all__", None)
    if exported is not None:
        return [str(n) for n in exported if n not in NOT_DOCUMENTABLE]
    return sorted(
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == module.__name__
    )


def _own_doc(obj: object) -> str:
    """The object's own docstring (``__doc__``, never inherited from a base class)."""
    doc = getattr(obj, "__doc__", None)
    return doc.strip() if isinstance(doc, str) else ""


def _function(obj: object) -> FunctionType | None:
    """The plain function behind a function, method, classmethod, staticmethod or wrapper."""
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    if not callable(obj):
        return None
    obj = inspect.unwrap(obj)  # type: ignore[arg-type]
    return obj if isinstance(obj, FunctionType) else None


def raises_itself(func: Callable[..., object]) -> bool:
    """Whether ``func``'s own code has a ``raise X`` statement.

    A bare ``raise`` (re-raise, ``RAISE_VARARGS 0``) propagates and is not
    counted; an ``assert`` compiles to ``LOAD_ASSERTION_ERROR`` + ``RAISE_VARARGS``
    and is subtracted. Nested functions have their own code objects and are
    checked on their own, if public.
    """
    code: CodeType = func.__code__  # type: ignore[attr-defined]
    raises = asserts = 0
    for instruction in dis.get_instructions(code):
        if instruction.opname == "RAISE_VARARGS" and instruction.arg:
            raises += 1
        elif instruction.opname == "LOAD_ASSERTION_ERROR":
            asserts += 1
    return raises > asserts


def _documents_raises(doc: str) -> bool:
    return "Raises:" in doc


def _base_documents_raises(cls: type, name: str) -> bool:
    """Whether a base class documents the errors of method ``name`` that ``cls`` overrides.

    An override whose docstring says "See :meth:`Base.name`" inherits the
    base's contract, including its "Raises:" section.
    """
    for base in cls.__mro__[1:]:
        func = _function(vars(base).get(name))
        if func is not None and _documents_raises(_own_doc(func)):
            return True
    return False


def _class_members(cls: type) -> Iterator[tuple[str, object]]:
    for name, value in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(value, property) or _function(value) is not None:
            yield name, value


def problems_of(qualname: str, obj: object) -> list[str]:
    """Every docstring problem of one public object (empty if it is fine)."""
    found: list[str] = []
    if inspect.ismodule(obj) or not (inspect.isclass(obj) or callable(obj)):
        return found  # modules are checked on their own; constants cannot carry one
    if typing.get_origin(obj) is not None:
        return found  # a type alias such as Callable[[Event], None] cannot carry one
    doc = _own_doc(obj)
    if not doc:
        found.append(f"{qualname}: no docstring")
    if inspect.isclass(obj):
        init_doc = _own_doc(vars(obj).get("__init__"))
        for hook in ("__init__", "__post_init__"):
            func = _function(vars(obj).get(hook))
            if (
                func is not None
                and func.__module__ == obj.__module__  # not typing.Protocol's own
                and raises_itself(func)
                and not (_documents_raises(doc) or _documents_raises(init_doc))
            ):
                found.append(f"{qualname}: {hook} raises but no 'Raises:' section")
        for name, member in _class_members(obj):
            member_name = f"{qualname}.{name}"
            if isinstance(member, property):
                if not _own_doc(member.fget):
                    found.append(f"{member_name}: property without docstring")
                continue
            func = _function(member)
            assert func is not None
            member_doc = _own_doc(func)
            if not member_doc:
                found.append(f"{member_name}: no docstring")
            elif (
                raises_itself(func)
                and not getattr(func, "__isabstractmethod__", False)
                and not _documents_raises(member_doc)
                and not _base_documents_raises(obj, name)
            ):
                found.append(f"{member_name}: raises but no 'Raises:' section")
        return found
    func = _function(obj)
    if func is not None and doc and raises_itself(func) and not _documents_raises(doc):
        found.append(f"{qualname}: raises but no 'Raises:' section")
    return found


EXISTING = [name for name in PUBLIC_MODULES if _exists(name)]
EXISTING_DOCSTRING_ONLY = [name for name in DOCSTRING_ONLY_MODULES if _exists(name)]


def test_the_package_exports_names_that_exist() -> None:
    missing = [name for name in elasticps.__all__ if not hasattr(elasticps, name)]
    assert not missing, f"in elasticps.__all__ but not defined: {missing}"
    assert len(set(elasticps.__all__)) == len(elasticps.__all__)


@pytest.mark.parametrize("module_name", EXISTING + EXISTING_DOCSTRING_ONLY)
def test_public_module_has_a_docstring(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert _own_doc(module), f"module {module_name} has no docstring"


@pytest.mark.parametrize("module_name", EXISTING)
def test_every_public_name_is_documented_with_its_errors(module_name: str) -> None:
    module = importlib.import_module(module_name)
    found: list[str] = []
    for name in _public_names(module):
        found += problems_of(f"{module_name}.{name}", getattr(module, name))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module_name", EXISTING_DOCSTRING_ONLY)
def test_every_public_name_has_a_docstring(module_name: str) -> None:
    module = importlib.import_module(module_name)
    found = [
        problem
        for name in _public_names(module)
        for problem in problems_of(f"{module_name}.{name}", getattr(module, name))
        if "Raises:" not in problem
    ]
    assert not found, "\n".join(found)


# --- the checker itself ------------------------------------------------------


# Defined from source with exec: pytest rewrites the asserts of a test module
# into ``if not ...: raise AssertionError``, which would hide what is tested.
_SAMPLES = """
def documented_raiser(x):
    \"\"\"Return x.

    Raises:
        ValueError: x is negative.
    \"\"\"
    if x < 0:
        raise ValueError(x)
    return x


def undocumented_raiser(x):
    \"\"\"Return x.\"\"\"
    if x < 0:
        raise ValueError(x) from None
    return x


class Store:
    \"\"\"A store.\"\"\"

    def init(self, x):
        \"\"\"Set x.

        Raises:
            KeyError: x is already set.
        \"\"\"


class MemoryStore(Store):
    \"\"\"A store in memory.\"\"\"

    def init(self, x):
        \"\"\"See Store.init.\"\"\"
        raise KeyError(x)


def asserts_and_reraises(x):
    \"\"\"Return 1 // x.\"\"\"
    assert x >= 0, "negative"
    try:
        return 1 // x
    except ZeroDivisionError:
        raise
"""
_samples: dict[str, Any] = {}
exec(compile(_SAMPLES, "<docstring samples>", "exec"), {}, _samples)


class _Base:
    """A documented base."""


class _Undocumented(_Base):
    def method(self) -> None:
        pass


def test_checker_flags_an_undocumented_raise_and_accepts_a_documented_one() -> None:
    assert raises_itself(_samples["documented_raiser"])
    assert raises_itself(_samples["undocumented_raiser"])
    assert problems_of("f", _samples["documented_raiser"]) == []
    assert problems_of("g", _samples["undocumented_raiser"]) == [
        "g: raises but no 'Raises:' section"
    ]


def test_checker_ignores_asserts_and_bare_reraises() -> None:
    assert not raises_itself(_samples["asserts_and_reraises"])
    assert problems_of("h", _samples["asserts_and_reraises"]) == []


def test_checker_does_not_inherit_a_class_docstring() -> None:
    assert problems_of("C", _Undocumented) == ["C: no docstring", "C.method: no docstring"]


def test_checker_accepts_an_override_documented_by_its_base_method() -> None:
    assert problems_of("MemoryStore", _samples["MemoryStore"]) == []
