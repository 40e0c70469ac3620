"""NativeInternodeBackend is composed of one class per part of a call, one module each (docs/design.md, decision 18):
the composition must not depend on the order of its bases."""
import collections
import importlib
import pkgutil

import uccl_ep_train.internode as package
from uccl_ep_train.internode import NativeInternodeBackend


def _parts():
    return NativeInternodeBackend.__mro__[1:-1]  # (the backend itself and object left out)


def test_no_two_parts_of_the_backend_define_the_same_name():
    defined = collections.Counter(name for part in _parts() for name in vars(part)
                                  if not (name.startswith("__") and name.endswith("__")))
    assert defined and not [name for name, n in defined.items() if n > 1]
    # ... nor does the backend itself redefine a part's method
    own = {n for n in vars(NativeInternodeBackend) if not (n.startswith("__") and n.endswith("__"))}
    assert not own & set(defined), own & set(defined)


def test_every_part_module_of_the_package_is_a_base_of_the_backend():
    parts = set(_parts())
    found = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == module.__name__ and \
                    "A part of NativeInternodeBackend" in " ".join((value.__doc__ or "").split()):
                found.add(value)
    assert len(found) == 10 and found == parts, (found ^ parts)


def test_the_backends_calls_come_from_their_parts():
    # the entry points a Backend needs (uccl_ep_train.backends) resolve to the modules named after them
    assert NativeInternodeBackend.dispatch.__module__ == "uccl_ep_train.internode.dispatch"
    assert NativeInternodeBackend.combine.__module__ == "uccl_ep_train.internode.combine"
    assert NativeInternodeBackend._notify.__module__ == "uccl_ep_train.internode.notify"
    assert NativeInternodeBackend.get_dispatch_layout.__module__ == "uccl_ep_train.internode.dispatch"
