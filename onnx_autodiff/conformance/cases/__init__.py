"""Rule cases, one module per rule family; each module defines ``CASES`` (a list of RuleCase)
and may define ``NOT_CASED`` (op types whose rule is covered elsewhere, with the reason)."""
import importlib
import pkgutil


def _modules():
    for info in pkgutil.iter_modules(__path__):
        yield importlib.import_module(f"{__name__}.{info.name}")


def all_cases():
    return [c for m in _modules() for c in getattr(m, "CASES", [])]


def not_cased():
    out = {}
    for m in _modules():
        out.update(getattr(m, "NOT_CASED", {}))
    return out
