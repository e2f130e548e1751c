"""The public surface explains itself in ``help()``: every public class and function of fastdp has a docstring of its
own (a method without one shows nn.Module's generic text there), and ``fastdp.DataParallel``'s docstring lists every
constructor argument with its default, as its signature gives them."""

import dataclasses
import inspect
import re

import fastdp
import fastdp.balance
import fastdp.comm
import fastdp.distributed

PUBLIC_MODULES = (fastdp, fastdp.comm, fastdp.balance, fastdp.distributed)


def _own_doc(obj):
    return obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)


def _members(cls):
    """(name, function) of the public methods and properties a class defines itself, and its constructor (unless a
    dataclass generated it from the fields its class docstring lists)."""
    for name, member in vars(cls).items():
        if name.startswith("_") and (name != "__init__" or dataclasses.is_dataclass(cls)):
            continue
        function = member.fget if isinstance(member, property) else getattr(member, "__func__", member)
        if inspect.isfunction(function):
            yield name, function


def _public():
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not callable(obj):
                continue
            yield f"{module.__name__}.{name}", obj
            if inspect.isclass(obj):
                for member, function in _members(obj):
                    yield f"{module.__name__}.{name}.{member}", function


def test_every_public_class_and_function_has_a_docstring_of_its_own():
    missing = sorted({name for name, obj in _public() if not _own_doc(obj)})
    assert not missing, f"public names whose help() shows no text of their own: {missing}"


def test_the_check_sees_methods_without_a_docstring():
    class Example:
        """Documented."""

        def method(self):
            pass

        @property
        def value(self):
            return 1

    assert [name for name, function in _members(Example) if not _own_doc(function)] == ["method", "value"]


def test_every_constructor_argument_of_DataParallel_is_in_its_docstring_with_its_default():
    doc = inspect.getdoc(fastdp.DataParallel)
    items = re.findall(r"^- ``(\w+)(?:=([^`]*))?``:", doc, re.MULTILINE)
    listed = {name: default for name, default in items}
    for name, parameter in inspect.signature(fastdp.DataParallel).parameters.items():
        assert name in listed, f"{name} is not described in fastdp.DataParallel's docstring"
        if parameter.default is not inspect.Parameter.empty:
            assert listed[name] == repr(parameter.default), (name, listed[name], parameter.default)
