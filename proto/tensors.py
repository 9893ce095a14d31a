"""numpy arrays as pydantic fields: dtype and rank are validated; JSON carries them as base64 objects.

`Int32Array1D` and friends are `Annotated[np.ndarray, NdArray(...)]`. In Python a field holds a plain
`np.ndarray` of exactly the declared dtype (an array that already has it is kept as is, never copied, so
a decoder's zero-copy views stay views). In JSON it is `{"dtype": "int32", "shape": [T], "data": "<base64>"}`
where `data` is the raw little-endian bytes in C order; the JSON Schema says the same.
"""

import base64
import binascii
from typing import Annotated, Any

import numpy as np
from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

_JSON_KEYS = frozenset({"dtype", "shape", "data"})


class NdArray:
    """Pydantic marker for a numpy field of one dtype (`int32` or `float32`) and one rank."""

    dtype: np.dtype
    wire_dtype: np.dtype  # the same, little-endian: what the JSON form's bytes are
    ndim: int

    def __init__(self, dtype: str, ndim: int) -> None:
        self.dtype = np.dtype(dtype)
        self.wire_dtype = self.dtype.newbyteorder("<")
        self.ndim = ndim

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            self.validate,
            serialization=core_schema.plain_serializer_function_ser_schema(self.to_json, when_used="json"),
        )

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {
            "type": "object",
            "properties": {
                "dtype": {"const": self.dtype.name, "type": "string", "description": "Element type."},
                "shape": {
                    "description": f"The {self.ndim} dimensions, outermost first.",
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0},
                    "minItems": self.ndim,
                    "maxItems": self.ndim,
                },
                "data": {
                    "type": "string",
                    "contentEncoding": "base64",
                    "description": "The elements' raw little-endian bytes in C (row-major) order.",
                },
            },
            "required": ["data", "dtype", "shape"],
            "additionalProperties": False,
        }

    def validate(self, value: Any) -> np.ndarray:
        """Accepts an ndarray, a (nested) list, or the JSON object form; returns an ndarray of `dtype`."""
        if isinstance(value, dict):
            return self._from_json(value)
        if isinstance(value, list | tuple):
            value = self._from_list(value)
        if not isinstance(value, np.ndarray):
            raise ValueError(f"expected a {self.ndim}-D {self.dtype.name} array, got {type(value).__name__}")
        if value.ndim != self.ndim:
            raise ValueError(f"expected a {self.ndim}-D array, got shape {list(value.shape)}")
        return self._cast(value)

    def to_json(self, value: np.ndarray) -> dict[str, Any]:
        raw = np.ascontiguousarray(value, dtype=self.wire_dtype).tobytes()
        return {
            "dtype": self.dtype.name,
            "shape": list(value.shape),
            "data": base64.b64encode(raw).decode("ascii"),
        }

    def _from_list(self, value: list | tuple) -> np.ndarray:
        try:
            array = np.asarray(value)
        except ValueError as exc:  # ragged nesting
            raise ValueError(f"not a rectangular {self.ndim}-D array: {exc}") from None
        # `np.asarray([])` is float64; an empty list is a valid empty array of any dtype.
        return array.astype(self.dtype) if array.size == 0 else array

    def _cast(self, value: np.ndarray) -> np.ndarray:
        if value.dtype == self.dtype:
            return value
        kind = self.dtype.kind
        if kind == "i" and value.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if value.size and (value.min() < info.min or value.max() > info.max):
                raise ValueError(f"values outside the {self.dtype.name} range")
            return value.astype(self.dtype)
        if kind == "f" and value.dtype.kind == "f":
            # Narrowing float64 → float32 only loses precision; an overflow becomes ±inf, which the
            # finiteness checks of the message then reject with the field's name.
            with np.errstate(over="ignore"):
                return value.astype(self.dtype)
        raise ValueError(f"expected dtype {self.dtype.name}, got {value.dtype.name}")

    def _from_json(self, value: dict[str, Any]) -> np.ndarray:
        if set(value) != _JSON_KEYS:
            raise ValueError(
                f"array object must have exactly the keys {sorted(_JSON_KEYS)}, got {sorted(value)}"
            )
        if value["dtype"] != self.dtype.name:
            raise ValueError(f"expected dtype {self.dtype.name}, got {value['dtype']!r}")
        shape = value["shape"]
        if (
            not isinstance(shape, list)
            or len(shape) != self.ndim
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        ):
            raise ValueError(f"shape must be a list of {self.ndim} non-negative integers, got {shape!r}")
        if not isinstance(value["data"], str):
            raise ValueError("data must be a base64 string")
        try:
            raw = base64.b64decode(value["data"], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"data is not valid base64: {exc}") from None
        expected = int(np.prod(shape, dtype=np.int64)) * self.dtype.itemsize
        if len(raw) != expected:
            raise ValueError(f"data has {len(raw)} bytes, shape {shape} needs {expected}")
        return np.frombuffer(raw, dtype=self.wire_dtype).astype(self.dtype, copy=False).reshape(shape)


Int32Array1D = Annotated[np.ndarray, NdArray("int32", 1)]
Int32Array2D = Annotated[np.ndarray, NdArray("int32", 2)]
Float32Array1D = Annotated[np.ndarray, NdArray("float32", 1)]
Float32Array2D = Annotated[np.ndarray, NdArray("float32", 2)]


def values_equal(a: Any, b: Any) -> bool:
    """Equality that understands ndarrays (same dtype, shape and elements) inside lists, dicts and models."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and np.array_equal(a, b)
        )
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(values_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[key], b[key]) for key in a)
    return bool(a == b)
