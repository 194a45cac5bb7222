"""A seeded generator of random JSON schemas whose valid instances are short (structured-output tests).

Nested objects, arrays, enums, integers and numbers with bounds, booleans, short strings, required and
optional fields, ``additionalProperties: false``; every string and array is bounded so a constrained
completion fits a small ``max_tokens``.
"""

from __future__ import annotations

import random
from typing import Any

NAMES = ("id", "name", "kind", "size", "tags", "ok", "score", "meta", "items", "color", "level", "note")


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A schema of an object with 1..3 properties (nesting at most two levels)."""
    names = rng.sample(NAMES, rng.randint(1, 3))
    props = {name: _value(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["integer", "number", "boolean", "string", "enum", "int_enum"]
    if depth < 2:
        kinds += ["object", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        low = rng.randint(-5, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 900)}
    if kind == "number":  # a bounded precision: an unbounded fraction can take any number of tokens
        step = rng.choice([0.5, 0.25])
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100]), "multipleOf": step}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 8)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "x"], rng.randint(1, 4))}
    if kind == "int_enum":
        return {"type": "integer", "enum": rng.sample(range(10), rng.randint(1, 3))}
    if kind == "object":
        return random_schema(rng, depth)
    item = _value(rng, depth + 1) if depth < 1 else {"type": "integer", "minimum": 0, "maximum": 9}
    return {"type": "array", "items": item, "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}


def schemas(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]
