"""Every engine client implements EngineClient, and the server tells an engine from a loader by it."""

from __future__ import annotations

import inspect

import pytest

from lmserve.engine.async_engine import AsyncEngine
from lmserve.engine.core_client import EngineCoreClient
from lmserve.engine.pd_client import DisaggregatedClient
from lmserve.engine.protocol import EngineClient

METHODS = [n for n, v in vars(EngineClient).items() if callable(v) and not n.startswith("_")]


@pytest.mark.parametrize("cls", [AsyncEngine, EngineCoreClient, DisaggregatedClient])
def test_each_client_has_every_method_with_a_compatible_signature(cls: type) -> None:
    for name in METHODS:
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        want = inspect.signature(getattr(EngineClient, name)).parameters
        got = inspect.signature(getattr(cls, name)).parameters
        assert set(want) <= set(got), f"{cls.__name__}.{name} lacks {sorted(set(want) - set(got))}"
        extra = [n for n in got if n not in want and got[n].default is inspect.Parameter.empty]
        assert not extra, f"{cls.__name__}.{name} requires {extra}, which EngineClient callers do not pass"
    for name in ("dead_error", "is_running"):
        assert isinstance(inspect.getattr_static(cls, name), property), f"{cls.__name__}.{name} is not a property"


def test_a_loader_is_not_an_engine_client() -> None:
    assert not isinstance(lambda: None, EngineClient)
