"""Built-in rlhf-lightning plugins (installed as ``rlhf_lightning_plugins``), one module per kind.

Importing this package imports every module and subpackage in this folder whose name does not start
with ``_``: the built-in KL estimators, beta controllers, reward backends (the ``rewards``
subpackage), advantage estimators, policy losses, loss aggregations, reference updates and rollout
engines register themselves; each module holds small classes with one idea each. A module of your
own saved in this folder (``my_kl.py``) is imported the same way, so the names it registers work at
once, with nothing else to edit.
"""

import importlib
import pkgutil


def _import_every_module() -> None:
    for found in sorted(pkgutil.iter_modules(__path__), key=lambda module: module.name):
        if not found.name.startswith("_"):
            importlib.import_module(f"{__name__}.{found.name}")


_import_every_module()
