"""Warnings given once per process, per key.

Python's default warning filter shows a message once per place it names, but that record is
dropped whenever any code changes the filters (torch 2.6's Dynamo does while it traces), so a
warning given while a graph is traced came back with every trace. One set of keys here instead.
"""
from __future__ import annotations

import warnings
from typing import Hashable, Set

given: Set[Hashable] = set()


def warn_once(key: Hashable, message: str) -> None:
    if key not in given:
        given.add(key)
        warnings.warn(message, stacklevel=3)
