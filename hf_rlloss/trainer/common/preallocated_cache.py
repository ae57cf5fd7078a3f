"""A `DynamicCache` layer that decodes into buffers allocated once, for shared-prompt generation.

transformers' `DynamicLayer.update` concatenates each step's key and value onto the whole cache (`torch.cat`), so a
decoding step reads and writes the entire cache once more: O(cache) memory traffic per token, which with long prompts
is a large share of a CPU decoding step. `PreallocatedLayer` keeps `DynamicLayer`'s behaviour (its `keys`/`values`
hold exactly the filled positions, `get_seq_length` and `get_mask_sizes` are `DynamicLayer`'s, so `generate`, the
masks and every model see the same cache) but writes each step into a buffer sized for the whole call and returns a
view of its filled prefix: one small copy per step, and attention over the filled positions only.

Why not transformers' `StaticCache` (filled after the shared prefill): it attends over all `max_cache_len` positions
at every step, the unfilled ones masked, under a 4D mask built per step; with 128-token prompts and 768-token
completions (SmolLM2-135M's layer shape, 2 layers, 16 rows, float32, one CPU thread) a `generate` call took more
CPU time than with this layer, and about the same with 1,024-token prompts and 256-token completions, where the
unfilled part is small (one run each, not kept as a results file). A `StaticCache` also makes `generate` compile
the decoding forward on GPUs (`torch.compile`, one graph per cache length, so per generation batch). Where the
completions stop early (end of sequence), the buffers' untouched pages are not resident on CPU (`torch.empty`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["PreallocatedLayer", "preallocate_cache"]


class PreallocatedLayer(DynamicLayer):
    """A full-attention `DynamicLayer` whose keys and values are views of the prefix of buffers of `capacity`
    positions.

    `keys`/`values` `(B, H, n, D)` are always the first `n` filled positions of the buffers `(B, H, capacity, D)`.
    `update` writes the new positions after them and returns the longer view. Anything that replaces `keys`/`values`
    with other tensors (`DynamicLayer.reorder_cache`, `batch_select_indices`, `reset`) is honoured: the next `update`
    copies them into a fresh buffer. Past `capacity` the buffers grow (doubling), so no call fails for lack of room.

    Args:
        capacity (`int`): positions to allocate (the prompt plus the tokens to generate).
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor, capacity: int) -> PreallocatedLayer:
        """A layer holding rows `rows` `(B,)` of `keys`/`values` `(U, H, n, D)` in buffers of `max(capacity, n)`
        positions: row `b` a copy of row `rows[b]`, written straight into the buffers (no `(B, H, n, D)` temporary)."""
        layer = cls(capacity)
        layer.lazy_initialization(keys, values)
        n, room = keys.shape[-2], max(capacity, keys.shape[-2])
        layer.capacity = room
        layer._key_buffer = keys.new_empty(rows.numel(), keys.shape[1], room, keys.shape[3])
        layer._value_buffer = values.new_empty(rows.numel(), values.shape[1], room, values.shape[3])
        for b, u in enumerate(rows.tolist()):
            layer._key_buffer[b, :, :n].copy_(keys[u])
            layer._value_buffer[b, :, :n].copy_(values[u])
        layer.keys = layer._key_buffer[:, :, :n]
        layer.values = layer._value_buffer[:, :, :n]
        return layer

    def _is_prefix_view(self) -> bool:
        """Whether `keys`/`values` are still the filled prefix of this layer's buffers."""

        def prefix(view: torch.Tensor, buffer: torch.Tensor | None) -> bool:
            return (
                buffer is not None
                and view.dim() == 4
                and view.data_ptr() == buffer.data_ptr()
                and view.stride() == buffer.stride()
                and view.shape[:2] == buffer.shape[:2]
                and view.shape[3] == buffer.shape[3]
            )

        return prefix(self.keys, self._key_buffer) and prefix(self.values, self._value_buffer)

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, extra: int) -> None:
        """Copy `keys`/`values` `(B, H, n, D)` into new buffers of room for at least `n + extra` positions."""
        n = keys.shape[-2]
        room = max(self.capacity, n + extra)
        if room > self.capacity and self._key_buffer is not None:  # outgrown: double, as a list would
            room = max(room, 2 * self.capacity)
        self.capacity = room
        self._key_buffer = keys.new_empty(*keys.shape[:2], room, keys.shape[3])
        self._value_buffer = values.new_empty(*values.shape[:2], room, values.shape[3])
        self._key_buffer[:, :, :n].copy_(keys)
        self._value_buffer[:, :, :n].copy_(values)
        self.keys = self._key_buffer[:, :, :n]
        self.values = self._value_buffer[:, :, :n]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write `key_states`/`value_states` `(B, H, m, D)` after the `n` filled positions and return the filled keys
        and values `(B, H, n + m, D)`, views of the buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        m = key_states.shape[-2]
        if self.keys.numel() == 0 and self.keys.dim() != 4:  # freshly initialized: an empty 1-D tensor
            self.keys = key_states.new_empty(*key_states.shape[:2], 0, key_states.shape[3])
            self.values = value_states.new_empty(*value_states.shape[:2], 0, value_states.shape[3])
        n = self.keys.shape[-2]
        if not self._is_prefix_view() or n + m > self._key_buffer.shape[-2]:
            self._adopt(self.keys, self.values, m)
        self._key_buffer[:, :, n : n + m].copy_(key_states)
        self._value_buffer[:, :, n : n + m].copy_(value_states)
        self.keys = self._key_buffer[:, :, : n + m]
        self.values = self._value_buffer[:, :, : n + m]
        return self.keys, self.values


def preallocate_cache(cache: DynamicCache, rows: torch.Tensor, capacity: int) -> DynamicCache:
    """Copy the rows of a filled cache to a batch's rows, the full-attention layers into `PreallocatedLayer`s.

    Layers that are exactly `DynamicLayer` (full attention) become `PreallocatedLayer`s of `capacity` positions;
    sliding-window, linear-attention and other layers keep their own class and are reordered
    (`CacheLayerMixin.reorder_cache`, the row selection beam search uses). One layer at a time, in place.

    Args:
        cache (`DynamicCache`): a filled cache of `U` rows (its layers `(U, H, n, D)`).
        rows (`torch.Tensor` of shape `(B,)`): for each row of the batch, the cache row it copies.
        capacity (`int`): positions per full-attention layer: the cached ones plus those the call will add.

    Returns:
        `cache`, now of `B` rows.
    """
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.dim() == 4:
            cache.layers[i] = PreallocatedLayer.holding(layer.keys, layer.values, rows, capacity)
            layer.keys = layer.values = None  # free the U-row copy before the next layer's
        else:
            layer.reorder_cache(rows)
    return cache
