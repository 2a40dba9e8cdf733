"""Argument rules every op family's rules use (kernels/rules/<family>.py), and the index-check switch.

Bindings describe arrays as (shape, dtype name) with numpy-style dtype names ("bfloat16", "float8_e4m3fn",
"bool", "int32", ...) and call the family rules before launching. Every error names the argument and what
was expected. Rules on index values (expert ids, row maps, split sizes) take the values' extremes or
lists; the bindings decide when to read them: where reading is free (CPU arrays outside tracing), or on
every call when CHECK_VALUES is on. Elsewhere the kernels apply the index rule of docs/design.md ("Index
data is never trusted"): a bad index is ignored, never followed out of a buffer.
"""

from __future__ import annotations

import os

#: The debug switch MOETRITON_CHECK=1 (read at import): every call reads the index data it is given (expert
#: ids, row maps, split sizes and orders) and raises ValueError for values the rules below refuse, on the
#: GPU too, at the price of a device-to-host copy and a sync per call. Off by default: the hot path reads
#: no device value.
CHECK_VALUES = os.environ.get("MOETRITON_CHECK", "0") not in ("", "0")

FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8")
MASK_DTYPES = ("bool", *INT_DTYPES)
INDEX_DTYPES = ("int32", "int64")
#: Layouts of a routing map: "bytemap" bool [T, E]; "bitmap" uint8 [T, ceil(E / 8)], bit e % 8 of byte
#: e // 8 set when the token routes to expert e (LSB first, unused high bits 0; TE's BITMAP_U8).
ROUTING_MAP_FORMATS = ("bytemap", "bitmap")
#: Other spellings a routing-map format is accepted in: TE's names (strings, or an enum member's name).
_FORMAT_ALIASES = {"bitmap_u8": "bitmap"}


def fail(name: str, message: str) -> None:
    """Raise the ValueError of argument `name`: "<name>: <message>"."""
    raise ValueError(f"{name}: {message}")


def not_an_array(value, expected: str) -> tuple[None, str]:
    """How a binding describes an argument that is not one of its arrays (a list, a numpy array given to
    PyTorch): the rules raise TypeError for it, naming the argument and `expected` (e.g. "a torch.Tensor")."""
    return None, f"expected {expected}, got {type(value).__module__}.{type(value).__qualname__}"


def require_array(name: str, description: tuple | None) -> None:
    """TypeError when `description` is `not_an_array`'s."""
    if description is not None and description[0] is None:
        raise TypeError(f"{name}: {description[1]}")


def check_array(name: str, shape: tuple[int, ...], dtype: str, *, ndim: int, dtypes: tuple[str, ...]) -> None:
    require_array(name, (shape, dtype))
    if len(shape) != ndim:
        fail(name, f"expected a {ndim}-D array, got shape {tuple(shape)}")
    if dtype not in dtypes:
        fail(name, f"expected dtype in {dtypes}, got {dtype}")


def check_dim(name: str, got: int, expected: int, what: str) -> None:
    if got != expected:
        fail(name, f"expected {what} = {expected}, got {got}")


def check_positive(name: str, value: int | None, *, allow_zero: bool = False) -> None:
    if value is None:
        fail(name, "required (a Python int)")
    if not isinstance(value, int) or isinstance(value, bool):
        fail(name, f"expected a Python int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        fail(name, f"expected {'>= 0' if allow_zero else '> 0'}, got {value}")


def check_routing_map_format(routing_map_format) -> str:
    """The neutral name ("bytemap" or "bitmap") of a routing-map format given as one of those strings, TE's
    "bitmap_u8", or an enum member named BYTEMAP or BITMAP_U8 (TE's RoutingMapFormat), in any case."""
    name = (
        routing_map_format
        if isinstance(routing_map_format, str)
        else getattr(routing_map_format, "name", None)
    )
    normalised = name.lower() if isinstance(name, str) else None
    normalised = _FORMAT_ALIASES.get(normalised, normalised)
    if normalised not in ROUTING_MAP_FORMATS:
        fail(
            "routing_map_format",
            f"expected one of {ROUTING_MAP_FORMATS} (or TE's 'bitmap_u8' / RoutingMapFormat), "
            f"got {routing_map_format!r}",
        )
    return normalised
