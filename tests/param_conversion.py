"""A conversion that replaces parameter objects, for the tests of the modules that cache them."""
import contextlib

import torch


@contextlib.contextmanager
def conversions_replace_parameters():
    """Inside, ``.to()`` / ``.double()`` put new Parameter objects in place (as
    ``torch.__future__.set_overwrite_module_params_on_conversion(True)`` makes them do) instead
    of changing ``.data``; the previous setting is restored on exit."""
    before = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(before)
