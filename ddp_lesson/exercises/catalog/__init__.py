"""Every checkable exercise of notebooks 00-09, one module each, named by id and topic
(``ex_NN_K_<topic>.py``); importing this package imports them all, and each registers itself
in :data:`ddp_lesson.exercises.registry.REGISTRY`.

Each module holds its inputs, how a rank runs the candidate (``_rank``) or a local one is
called (``_run``), the judge (comparing with the package, computed here) and its ``register``
call. Inputs are functions of the rank and of fixed seeds, so a verdict is the same anywhere.
"""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if _module.name.startswith("ex_"):
        importlib.import_module(f"{__name__}.{_module.name}")
