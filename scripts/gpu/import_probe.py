"""Which top-level packages a module needs at import time that this Python lacks, in one call.

    python3 scripts/gpu/import_probe.py OUT.json MODULE [MODULE ...]

Used on the GPU host, where nothing can be fetched, to learn what wheels a peer connector (LMCache,
say) needs carried before it can run there. Each MODULE is imported in a fresh interpreter; where
the import stops at a ModuleNotFoundError for a package that is not there, that package's name
is recorded and the import is tried again in a new interpreter in which it (and every one
recorded before) is a stand-in module (every attribute a further stand-in), until it imports or
stops for another reason. Only the packages an import could not go on without are stood in for:
an optional import the module guards itself (`try: import dill`) stays missing, as it is in
use. The stand-ins make no verdict about the module working: a probe's result is the list of
names to carry, and each MODULE's outcome (imported with those stand-ins, or the exception that
still stopped it). OUT.json: {"python", "modules": {MODULE: {"outcome": "ok" | "ExcType: message",
"needs": [names]}}, "missing": [every name, first seen first]}.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import traceback
import types
from pathlib import Path


class _Stand(types.ModuleType):
    """A stand-in: any attribute is another stand-in (a class, a function, a submodule alike)."""

    __path__: list[str] = []

    def __getattr__(self, name: str):  # noqa: ANN204
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        child = _Stand(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        return _Stand(f"{self.__name__}()")

    def __mro_entries__(self, bases):  # noqa: ANN001, ANN204 - subclassing a stand-in gives a plain base
        return (object,)


class StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: the named top-level packages (and anything under them) are stand-ins."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201
        if fullname.partition(".")[0] not in self.names:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):  # noqa: ANN001, ANN201
        return _Stand(spec.name)

    def exec_module(self, module) -> None:  # noqa: ANN001
        return None


def child(module: str, stand_ins: list[str]) -> int:
    """One import in this interpreter; prints one JSON line: ok, a missing top-level package, or
    the exception that stopped it."""
    sys.meta_path.append(StandInFinder(set(stand_ins)))
    try:
        importlib.import_module(module)
        answer = {"outcome": "ok"}
    except ModuleNotFoundError as exc:
        top = (exc.name or "").partition(".")[0]
        answer = {"outcome": f"ModuleNotFoundError: {exc}", "missing": top if exc.name == top else None,
                  "traceback": traceback.format_exc()[-3000:]}
    except Exception as exc:  # noqa: BLE001 - the probe's finding, printed for the parent: nothing is hidden
        answer = {"outcome": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    print("PROBE " + json.dumps(answer), flush=True)
    os._exit(0)  # no interpreter teardown: stand-ins and native libraries can fault there


def probe(module: str, limit: int = 60, timeout_s: float = 300.0) -> dict:
    """One module's probe from no stand-ins (another module's would make a guarded optional
    import of this one look present)."""
    needs: list[str] = []
    for _ in range(limit):
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", module, *needs],
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"outcome": f"the import did not end within {timeout_s:.0f} s", "needs": needs}
        line = next((x for x in proc.stdout.splitlines() if x.startswith("PROBE ")), None)
        if line is None:
            return {"outcome": f"the child exited {proc.returncode} without an answer", "needs": needs,
                    "stderr": proc.stderr[-3000:]}
        answer = json.loads(line[len("PROBE "):])
        name = answer.get("missing")
        if not name or name in needs:
            return {**answer, "needs": needs}
        needs.append(name)
    return {"outcome": f"still missing packages after {limit} rounds", "needs": needs}


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[2:])
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, modules = Path(argv[0]), argv[1:]
    result: dict = {"python": sys.version, "modules": {}, "missing": []}
    for name in dict.fromkeys(modules):
        got = probe(name)
        result["modules"][name] = got
        result["missing"] += [n for n in got["needs"] if n not in result["missing"]]
        print(f"import_probe: {name}: {got['outcome']} (stood in for: {got['needs']})", flush=True)
        out.write_text(json.dumps(result, indent=1))  # as each module ends: a later one may hang the call
    print(json.dumps({"missing": result["missing"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
