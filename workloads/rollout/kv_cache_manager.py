"""The KV-cache manager: one pool of fixed-size blocks holding every row's keys, values and routed expert ids, the
rows' block tables, reference-counted blocks for a group's shared prompt, and how many blocks a GPU can hold."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_rl_eks.core.run import ModelConfig


def routing_dtype(config: ModelConfig) -> torch.dtype:
    """The narrowest integer type that holds an expert id."""
    return torch.uint8 if config.num_experts <= 256 else torch.int16


@dataclass
class PagedCache:
    """Keys/values [L, blocks + 1, block_size, H_kv, D] and the routed expert ids [blocks + 1, block_size, L, k] of
    every fed position, in one pool of fixed-size blocks shared by all rows. Row slot s finds its position p at
    block tables[s, p // block_size], offset p % block_size; `tables` [slots + 1, max_blocks] lives on the device
    (a static tensor: CUDA graphs replay against it) with its host copy in `owned`. The extra last block is
    scratch: padding tokens of a forward write there, and every table entry not granted to a row points at it
    (the extra last slot, the padding rows', is all scratch). Blocks carry reference counts: a group's rows share
    their prompt's full blocks."""

    keys: torch.Tensor
    values: torch.Tensor
    routing: torch.Tensor
    tables: torch.Tensor
    owned: list[list[int]]  # per slot, the blocks granted to it (host copy of the live part of its table row)
    refs: list[int]  # per block, how many slots hold it
    free: list[int]  # blocks no slot holds
    max_len: int  # positions a row may hold
    pending: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, index, block) not yet on the device

    @classmethod
    def allocate(cls, config, slots: int, max_len: int, blocks: int, block_size: int, device, dtype
                 ) -> "PagedCache":
        if block_size < 1 or blocks < 1:
            raise ValueError(f"kv cache: block_size {block_size} and blocks {blocks} must be >= 1")
        shape = (config.num_hidden_layers, blocks + 1, block_size, config.num_key_value_heads, config.head_dim)
        ids = routing_dtype(config)
        max_blocks = -(-max_len // block_size)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(blocks + 1, block_size, config.num_hidden_layers, config.num_experts_per_tok,
                               dtype=ids, device=device),
                   torch.full((slots + 1, max_blocks), blocks, dtype=torch.int32, device=device),
                   [[] for _ in range(slots + 1)], [0] * blocks, list(range(blocks - 1, -1, -1)), max_len)

    @property
    def block_size(self) -> int:
        return self.keys.shape[2]

    @property
    def blocks(self) -> int:
        return self.keys.shape[1] - 1

    @property
    def scratch(self) -> int:
        """The scratch slot (padding rows)."""
        return self.tables.shape[0] - 1

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def grow(self, slot: int, positions: int) -> bool:
        """Grant `slot` fresh blocks until it holds `positions` positions; False (nothing granted) if too few are
        free."""
        need = self.blocks_for(positions) - len(self.owned[slot])
        if need > len(self.free):
            return False
        for _ in range(need):
            self._grant(slot, self.free.pop())
        return True

    def share(self, source: int, target: int, count: int) -> None:
        """`target` (holding no blocks) starts with `source`'s first `count` blocks, shared."""
        for block in self.owned[source][:count]:
            self._grant(target, block)

    def copy_block(self, source: int, target: int, index: int) -> None:
        """Block `index` of slot `target` becomes a copy of the same block of `source` (a shared prompt's partial
        last block: each row then writes its own continuation there)."""
        src, dst = self.owned[source][index], self.owned[target][index]
        self.keys[:, dst] = self.keys[:, src]
        self.values[:, dst] = self.values[:, src]
        self.routing[dst] = self.routing[src]

    def release(self, slot: int) -> None:
        """Drop `slot`'s blocks (freed when no other slot holds them); its table row points at scratch again."""
        for index, block in enumerate(self.owned[slot]):
            self.refs[block] -= 1
            if not self.refs[block]:
                self.free.append(block)
            self.pending.append((slot, index, self.blocks))
        self.owned[slot] = []

    def _grant(self, slot: int, block: int) -> None:
        self.refs[block] += 1
        self.pending.append((slot, len(self.owned[slot]), block))
        self.owned[slot].append(block)

    def sync_tables(self) -> None:
        """Write the table entries changed since the last call to the device (one copy; before any forward)."""
        if self.pending:
            latest = {(slot, index): block for slot, index, block in self.pending}  # a freed entry granted again
            update = torch.tensor([(*k, v) for k, v in latest.items()], dtype=torch.int32).t()
            if self.tables.is_cuda:
                update = update.pin_memory().to(self.tables.device, non_blocking=True)
            self.tables[update[0].long(), update[1].long()] = update[2]
            self.pending = []

    def locate(self, slot: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each (slot, position), on the device."""
        page = self.block_size
        return self.tables[slot, positions // page].long(), positions % page

    def routing_of(self, slot: int, length: int) -> torch.Tensor:
        """The expert ids of `slot`'s first `length` positions [length, L, k] (a copy)."""
        blocks = torch.tensor(self.owned[slot][:self.blocks_for(length)], device=self.routing.device)
        return self.routing[blocks].flatten(0, 1)[:length].clone()

    def stats(self) -> dict[str, int]:
        return {"blocks_total": self.blocks, "blocks_free": len(self.free),
                "blocks_used": self.blocks - len(self.free), "block_size": self.block_size}


BLOCK_SIZE = 16  # positions per KV-cache block


# The share of a GPU's free memory (after the weights) the KV cache takes; the rest is for activations and CUDA
# graphs.
KV_CACHE_MEMORY_FRACTION = 0.8


def fitting_blocks(config: ModelConfig, dtype: torch.dtype, device: torch.device, wanted: int,
                   block_size: int = BLOCK_SIZE) -> int:
    """How many KV-cache blocks of `block_size` positions (keys, values, routing) to allocate: `wanted`, or on a
    GPU as many as fit in KV_CACHE_MEMORY_FRACTION of the memory this process may still take: the GPU's free
    memory, and no more than its memory share leaves (`local_gpus` caps the allocator, so a cache sized from the
    device's free memory alone would not fit). The one place the cache is sized."""
    if device.type != "cuda":
        return wanted
    c = config
    per_block = block_size * c.num_hidden_layers * (
        2 * c.num_key_value_heads * c.head_dim * dtype.itemsize + c.num_experts_per_tok * routing_dtype(c).itemsize)
    free, total = torch.cuda.mem_get_info(device)
    share_left = torch.cuda.get_per_process_memory_fraction(device) * total - torch.cuda.memory_reserved(device)
    return max(1, min(wanted, int(min(free, share_left) * KV_CACHE_MEMORY_FRACTION) // per_block - 1))
