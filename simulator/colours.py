"""One colour per checkpoint strategy, the same in every figure the project draws."""

from __future__ import annotations

STRATEGY_COLOURS = {
    "none": "tab:gray",
    "moevement": "tab:blue",
    "gemini": "tab:orange",
    "checkfreq": "tab:green",
    "moc": "tab:red",
}


def colour(strategy: str) -> str:
    """The colour of `strategy` (a variant such as `moevement:global` takes its strategy's)."""
    return STRATEGY_COLOURS.get(strategy.split(":")[0], "tab:purple")
