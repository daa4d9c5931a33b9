"""The registry of strategies: every strategy pipesim knows, by name.

It holds no strategy itself. The package (:mod:`pipesim.sim.strategies`)
registers each strategy module's ``STRATEGY`` once, in the order listings
and comparisons use, after importing them; the shared machinery in
:mod:`pipesim.sim.strategies._common` looks strategies up here. So the
registry imports none of the modules that consult it, and no import circle
runs through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipesim.sim.errors import InputError

if TYPE_CHECKING:
    from pipesim.sim.strategies._common import Strategy


class StrategyError(InputError):
    """A schedule spec that no strategy can build (one-line message)."""


_REGISTRY: dict[str, Strategy] = {}


def register(*found: Strategy) -> None:
    """Add strategies, in order; registering the same one again changes nothing
    (a reloaded package), another strategy under a taken name is a bug, not input."""
    for strategy in found:
        known = _REGISTRY.get(strategy.name)
        if known is not None and known != strategy:
            raise RuntimeError(f"two strategies named {strategy.name!r}")
        _REGISTRY.setdefault(strategy.name, strategy)


def strategies() -> tuple[Strategy, ...]:
    """Every registered strategy, in a stable order."""
    return tuple(_REGISTRY.values())


def strategy_names() -> list[str]:
    """The strategy names ``build_schedule`` accepts, in a stable order."""
    return list(_REGISTRY)


def find_strategy(name: str) -> Strategy | None:
    """The strategy called ``name``, or None (an imported schedule has none)."""
    return _REGISTRY.get(name) if isinstance(name, str) else None


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; a one-line StrategyError naming the choices if there is none."""
    found = find_strategy(name)
    if found is None:
        raise StrategyError(f"unknown strategy {name!r}; choose one of {', '.join(_REGISTRY)}")
    return found
