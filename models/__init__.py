"""Per-architecture aligned pairs (one folder per model: config, train, serve).

A model is listed only once its trainer/server pair keeps the contract; the
registry below is filled as models land.
"""
_REGISTRY: dict[str, object] = {}


def available_models() -> list[str]:
    return sorted(_REGISTRY)
