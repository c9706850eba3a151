"""Which top-level packages a module needs at import time that this Python lacks, all in one run.

    python3 scripts/gpu/import_probe.py OUT.json MODULE [MODULE ...]

Used on the GPU host, where nothing can be fetched, to learn what wheels a peer connector (LMCache,
say) needs carried before it can run there: each MODULE is imported with a finder placed last
on sys.meta_path that, for a top-level package nothing else finds, records its name and hands
out a stand-in module (every attribute a further stand-in), so the import goes on to the next
missing package instead of stopping at the first. The stand-ins make no verdict about the
module working: a probe's result is the list of names to carry, and each MODULE's outcome
(imported with stand-ins, or the exception that still stopped it). OUT.json:
{"python", "modules": {MODULE: "ok" | "ExcType: message"}, "missing": [names, in first-seen order]}.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
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


class MissingFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self.missing: list[str] = []

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201
        top = fullname.partition(".")[0]
        if top not in self.missing:
            if fullname != top:  # a submodule of a present package that does not exist: a real error
                return None
            self.missing.append(top)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):  # noqa: ANN001, ANN201
        return _Stand(spec.name)

    def exec_module(self, module) -> None:  # noqa: ANN001
        return None


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, modules = Path(argv[0]), argv[1:]
    finder = MissingFinder()
    sys.meta_path.append(finder)
    result: dict = {"python": sys.version, "modules": {}, "missing": finder.missing}
    for name in modules:
        try:
            importlib.import_module(name)
            result["modules"][name] = "ok"
        except Exception as exc:  # noqa: BLE001 - the probe's finding, written out: nothing is hidden
            result["modules"][name] = f"{type(exc).__name__}: {exc}"
            result.setdefault("tracebacks", {})[name] = traceback.format_exc()[-4000:]
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "tracebacks"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
