#!/usr/bin/env python3
"""Regenerates src/cli/megatron_arguments.json, the table of every flag Megatron-LM's
megatron/training/arguments.py defines (names and aliases, dest, action, type, nargs, choices,
default, group), from a Megatron-LM checkout, and the generated flag section of docs/flags.md.

  python3 tools/megatron_flags.py extract --megatron /path/to/Megatron-LM \
      [--commit HASH] [-o src/cli/megatron_arguments.json]

builds Megatron's own argparse parser (add_megatron_arguments) and reads its actions, so types
and defaults are exactly Megatron's. Megatron imports torch and triton at module level; they are
replaced by inert stand-ins (nothing runs, only the parser is built). Needs numpy, packaging,
typing_extensions, einops and pyyaml (pip install them into a venv).

The C++ build embeds the JSON file (CMake, no Python); `moecore train --flags-markdown` prints
the generated section of docs/flags.md, and tests check both are current.
"""
import argparse
import enum
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import types
import typing


class _Stub:
    """Stands in for any torch / triton object at import time."""

    def __init__(self, name="stub"):
        self._name = name

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _Stub(name)

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # used as a decorator
        return _Stub(self._name)

    def __mro_entries__(self, bases):
        return ()  # `class X(torch.nn.Module)` derives from the other bases only

    def __or__(self, other):
        return self

    def __ror__(self, other):
        return self

    def __getitem__(self, key):
        return self

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __repr__(self):
        return "torch." + self._name


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _Stub(name)
        setattr(self, name, value)
        return value


_STUB_ROOTS = {"torch": "2.8.0", "triton": "3.4.0"}


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in _STUB_ROOTS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        if module.__name__ in _STUB_ROOTS:
            module.__version__ = _STUB_ROOTS[module.__name__]


def _type_name(t):
    if t is None:
        return None
    if t in (int, float, str, bool):
        return t.__name__
    return "other:" + getattr(t, "__name__", repr(t))


def _json_value(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, enum.Enum):
        return v.name
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    return {"repr": repr(v)}


_ACTIONS = {
    argparse._StoreAction: "store",
    argparse._StoreTrueAction: "store_true",
    argparse._StoreFalseAction: "store_false",
    argparse._StoreConstAction: "store_const",
    argparse._AppendAction: "append",
    argparse._CountAction: "count",
}


def extract(megatron_dir, commit):
    sys.meta_path.insert(0, _StubFinder())
    sys.path.insert(0, megatron_dir)
    if not hasattr(typing, "override"):  # Python < 3.12
        import typing_extensions
        typing.override = typing_extensions.override
    from megatron.training import arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.add_megatron_arguments(parser)
    group_of = {}
    for g in parser._action_groups:
        for a in g._group_actions:
            group_of[id(a)] = g.title
    flags = []
    for a in parser._actions:
        if not a.option_strings or isinstance(a, argparse._HelpAction):
            continue
        kind = _ACTIONS.get(type(a))
        if kind is None:
            kind = "other:" + type(a).__name__
        choices = None
        if a.choices is not None:
            choices = [_json_value(c) for c in a.choices]
        flags.append({
            "names": list(a.option_strings),
            "dest": a.dest,
            "action": kind,
            "type": _type_name(a.type),
            "nargs": a.nargs,
            "choices": choices,
            "default": _json_value(a.default),
            "const": _json_value(a.const),
            "group": group_of.get(id(a)),
            "help": " ".join((a.help or "").split()),
        })
    return {
        "source": "NVIDIA/Megatron-LM megatron/training/arguments.py",
        "commit": commit,
        "parser": {"allow_abbrev": False},
        "flags": flags,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("extract", help="write the flag table from a Megatron-LM checkout")
    ex.add_argument("--megatron", required=True, help="Megatron-LM checkout (holds megatron/)")
    ex.add_argument("--commit", default=None, help="its commit (default: git rev-parse HEAD)")
    here = os.path.dirname(os.path.abspath(__file__))
    ex.add_argument("-o", "--output",
                    default=os.path.join(here, "..", "src", "train", "megatron_arguments.json"))
    args = ap.parse_args()
    if args.cmd == "extract":
        commit = args.commit or subprocess.check_output(
            ["git", "-C", args.megatron, "rev-parse", "HEAD"], text=True).strip()
        table = extract(os.path.abspath(args.megatron), commit)
        with open(args.output, "w") as out:
            json.dump(table, out, indent=1, sort_keys=False)
            out.write("\n")
        print(f"{len(table['flags'])} flags from Megatron-LM {commit} -> {args.output}")


if __name__ == "__main__":
    main()
