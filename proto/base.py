"""The pydantic base every sparkrl message (but the reward service's) shares: strict keys, finite floats."""

from typing import Any

from pydantic import BaseModel, ConfigDict

from sparkrl.proto.tensors import values_equal


class WireModel(BaseModel):
    """Base of the wire messages.

    - `extra="forbid"`: a misspelled key is an error, not silently dropped data.
    - `allow_inf_nan=False`: JSON has no NaN/inf, so a non-finite float would not survive a round trip.
    - `validate_assignment=True`: setting a field re-runs the checks (in-place edits of arrays and lists
      do not, which is why the codec validates again before it writes).
    - `__eq__` compares ndarray fields by value; pydantic's default raises on arrays of more than one item.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)

    def __eq__(self, other: Any) -> bool:
        if type(self) is not type(other):
            return NotImplemented
        return all(
            values_equal(getattr(self, name), getattr(other, name)) for name in type(self).model_fields
        )

    # Messages are mutable, so they must not be hashable (defining __eq__ already drops __hash__;
    # saying so keeps linters and readers from wondering).
    __hash__ = None  # type: ignore[assignment]
