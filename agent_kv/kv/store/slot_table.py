"""Tensors that share a slot dimension, stacked over layers and rows: one segment of the KV store.

Every field of a table has the shape `[L, B, *lead, S, *tail]`: `L` layers, `B` rows, then the
field's own leading dimensions (e.g. KV heads), the slot dimension of size `S` (the table's
capacity), and trailing ones (e.g. the head dimension). A row of a layer holds its live tokens in
its first `lengths[l][b]` slots; slots past that are spare capacity, never read unmasked.

Capacity changes only by `resize`, which reallocates every field once and carries the live
prefix over; compaction (`gather`) moves kept slots to the front in place, so a table's tensors
keep their shapes (and their storage) between resizes: what static-shape decoding and graph
capture need.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FieldSpec:
    """One field of a `SlotTable`.

    Attributes:
        lead: sizes of the dimensions between `[L, B]` and the slot dimension.
        tail: sizes of the dimensions after the slot dimension.
        dtype: element type.
    """

    lead: tuple[int, ...]
    tail: tuple[int, ...]
    dtype: torch.dtype

    @property
    def slot_dim(self) -> int:
        """Index of the slot dimension in the field's shape."""
        return 2 + len(self.lead)


def bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` viewed as `uint8` when its dtype is a float8 one (CPU gathers and scatters do
    not take float8), else itself."""
    return tensor.view(torch.uint8) if tensor.dtype in _FLOAT8 else tensor


_FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}


class SlotTable:
    """Fields `[L, B, *lead, capacity, *tail]` with per-layer, per-row lengths.

    Args:
        specs: the fields by name.
        layers, batch: `L` and `B`.
        device: where the tensors live.

    Attributes:
        fields: the tensors by name.
        lengths: host lengths `[L][B]` (live slots of each row of each layer).
        capacity: slots allocated per row and layer.
    """

    def __init__(self, specs: dict[str, FieldSpec], layers: int, batch: int, device: torch.device):
        self.specs = dict(specs)
        self.layers = layers
        self.batch = batch
        self.device = device
        self.capacity = 0
        self.lengths = [[0] * batch for _ in range(layers)]
        self.fields = {name: self._empty(spec, 0) for name, spec in self.specs.items()}
        self._views: dict[tuple, list[torch.Tensor]] = {}

    def _empty(self, spec: FieldSpec, capacity: int) -> torch.Tensor:
        shape = (self.layers, self.batch, *spec.lead, capacity, *spec.tail)
        return torch.zeros(shape, dtype=spec.dtype, device=self.device)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.fields[name]

    def most(self) -> int:
        """The longest row of any layer (live slots)."""
        return max(max(row) for row in self.lengths)

    def resize(self, capacity: int) -> None:
        """Reallocate every field to `capacity` slots, carrying the live slots over.

        Raises:
            ValueError: `capacity` is below the longest row.
        """
        if capacity < self.most():
            raise ValueError(f"capacity {capacity} cannot hold {self.most()} live slots")
        if capacity == self.capacity:
            return
        keep = self.most()
        for name, spec in self.specs.items():  # one field at a time: old and new held briefly
            old = self.fields[name]
            new = self._empty(spec, capacity)
            new.narrow(spec.slot_dim, 0, keep).copy_(old.narrow(spec.slot_dim, 0, keep))
            self.fields[name] = new
        self.capacity = capacity
        self._views.clear()

    def add_field(self, name: str, spec: FieldSpec) -> None:
        """Add field `name`, zeros at the table's capacity (a column a policy's statistic
        keeps, added when a call's plan first names it).

        Raises:
            ValueError: the table has a field of that name already.
        """
        if name in self.specs:
            raise ValueError(f"the table has a field {name!r} already")
        self.specs[name] = spec
        self.fields[name] = self._empty(spec, self.capacity)
        self._views.clear()

    def retype(self, name: str, dtype: torch.dtype) -> None:
        """Give field `name` another element type (only while no row holds a slot)."""
        spec = self.specs[name]
        self.specs[name] = FieldSpec(spec.lead, spec.tail, dtype)
        self.fields[name] = self.fields[name].to(dtype)
        self._views.clear()

    def layer_views(self, name: str, rows: slice, width: int | None) -> list[torch.Tensor]:
        """Per layer, field `name` of `rows` up to slot `width` (None: every slot past the
        rows): views made once and kept until the field is reallocated, so a decode step
        spends no operation slicing the buffers."""
        key = (name, rows.start, rows.stop, width)
        views = self._views.get(key)
        if views is None:
            field = self.fields[name][:, rows]
            if width is not None:
                field = field.narrow(self.specs[name].slot_dim, 0, width)
            views = self._views[key] = list(field.unbind(0))
        return views

    def nbytes(self, names: tuple[str, ...]) -> int:
        """Bytes allocated for the fields `names`."""
        return sum(self.fields[name].nbytes for name in names)

    def valid(self, layers: slice, rows: slice, width: int | None = None) -> torch.Tensor:
        """`[L', R, width]` bool: which of the first `width` (default: capacity) slots of
        `layers` x `rows` are live."""
        width = self.capacity if width is None else width
        lengths = self.length_tensor(layers, rows)
        return torch.arange(width, device=self.device) < lengths[..., None]

    def length_tensor(self, layers: slice, rows: slice) -> torch.Tensor:
        """`[L', R]` int64 host lengths of `layers` x `rows`, on the table's device."""
        return torch.tensor([row[rows] for row in self.lengths[layers]], device=self.device)

    def gather(self, order: torch.Tensor, layers: slice, rows: slice) -> None:
        """Move slots within each row of `layers`: afterwards slot `i` of layer `l`, row `b`
        holds what slot `order[l, b, i]` held (for `i < W`, `order` being `[L', R, W]` with
        `W <= capacity`); slots from `W` on keep what they held. Lengths are the caller's."""
        width = order.shape[2]
        for name, spec in self.specs.items():
            moved = self.take(name, order, layers, rows)
            self.fields[name][layers, rows].narrow(spec.slot_dim, 0, width).copy_(moved)

    def take(self, name: str, order: torch.Tensor, layers: slice, rows: slice) -> torch.Tensor:
        """Field `name` at the slots `order` `[L', R, W]` of `layers` x `rows`:
        `[L', R, *lead, W, *tail]`, a copy."""
        spec = self.specs[name]
        index = order.view(*order.shape[:2], *(1,) * len(spec.lead), order.shape[2])
        index = index.view(*index.shape, *(1,) * len(spec.tail))
        field = bytes_view(self.fields[name][layers, rows])
        taken = torch.take_along_dim(field, index, dim=spec.slot_dim)
        return taken.view(spec.dtype)
