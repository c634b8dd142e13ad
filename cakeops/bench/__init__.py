"""`python -m cakeops bench`: time every registered op against its peers, or check it on CPU.

Layout: ``core`` (the Case record, the registry, timing), ``report`` (tables, markdown, json),
``plot`` (the PNG), ``cli`` (the command). Each op family registers its cases in a module named
``<family>_cases.py`` in this package; the command discovers those modules by name.
"""
from .core import Case, cases, families, register

__all__ = ["Case", "cases", "families", "register"]
