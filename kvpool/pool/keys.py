"""Keys of the pool: a Namespace and a chain of block hashes.

  Namespace        every field that changes the bytes of a KV block (model, revision,
                   tokenizer, dtype, layout, block size, geometry, TP, adapter) plus the
                   tenant. Two namespaces that differ in any field never share a block;
                   `differing_fields` names the fields, so a miss can say why.
  block_hashes     h_i = BLAKE2b(key=SEED, h_{i-1} || tokens_i || extra_i) over complete
                   blocks only; the tail inside an incomplete block is never a key.
  useful_tokens    floor(T_match / B) * B.

The chain depends on tokens only (not on the namespace), so the catalog can tell
"same tokens, other namespace" (incompatible) from "never published". The namespace
is checked against the entry's own namespace on every lookup.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np

# Fixed key of the chained hash: the same tokens give the same chain in every process
# and every run. Changing it invalidates every pool; it is part of the protocol version.
CHAIN_SEED = b"kvgate/block-chain/v1"
HASH_BYTES = 16
ROOT_HASH = bytes(HASH_BYTES)
# The one key of an Evict that resets its namespace (kvpool.pool.catalog.Catalog.reset_namespace:
# everything published under it leaves the pool at once). No block's chained hash is it: it
# is not keyed with CHAIN_SEED, and a BLAKE2b chain hits a given 128-bit value with
# probability 2**-128 per block.
NAMESPACE_RESET = hashlib.blake2b(b"kvgate/namespace-reset/v1", digest_size=HASH_BYTES).digest()

BlockHash = bytes


class Namespace(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything that changes KV bytes, plus the tenant that owns them.

    A frozen msgspec Struct: hashable, and a namespace arriving over the wire with a
    field this build does not know is rejected rather than silently dropped (an unknown
    field may change KV bytes)."""

    model_id: str
    model_revision: str
    tokenizer_hash: str
    kv_dtype: str
    kv_layout: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_rank: int = 0
    tp_world_size: int = 1
    adapter_id: str = ""
    adapter_version: str = ""
    tenant: str = "default"

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if type(value) is not int:
                raise TypeError(f"Namespace.{name} must be an int, got {value!r}")
        for name in _STR_FIELDS:
            value = getattr(self, name)
            if type(value) is not str:
                raise TypeError(f"Namespace.{name} must be a str, got {value!r}")
        for name in _POSITIVE_FIELDS:
            if getattr(self, name) <= 0:
                raise ValueError(f"Namespace.{name} must be positive, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_world_size:
            raise ValueError(
                f"Namespace.tp_rank {self.tp_rank} outside world size {self.tp_world_size}"
            )

    def as_dict(self) -> dict[str, str | int]:
        return msgspec.structs.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Namespace:
        unknown = set(data) - set(cls.__struct_fields__)
        if unknown:
            raise ValueError(f"unknown Namespace fields: {sorted(unknown)}")
        return cls(**data)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> Namespace:
        return msgspec.structs.replace(self, **changes)

    def differing_fields(self, other: Namespace) -> tuple[str, ...]:
        """The fields (tenant excluded) in which two namespaces differ."""
        return tuple(
            name
            for name in self.__struct_fields__
            if name != "tenant" and getattr(self, name) != getattr(other, name)
        )

    @property
    def bytes_per_token(self) -> int:
        """2 x L x Hkv x D x q for a dense attention cache (the seed's formula)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * dtype_bytes(self.kv_dtype)


_INT_FIELDS = tuple(f.name for f in msgspec.structs.fields(Namespace) if f.type is int)
_STR_FIELDS = tuple(f.name for f in msgspec.structs.fields(Namespace) if f.type is str)
_POSITIVE_FIELDS = ("block_size", "num_layers", "num_kv_heads", "head_size", "tp_world_size")

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
                "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


def dtype_bytes(kv_dtype: str) -> int:
    name = kv_dtype.removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}")
    return _DTYPE_BYTES[name]


def block_hashes(
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    extras: Sequence[bytes] | None = None,
    parent: BlockHash = ROOT_HASH,
) -> list[BlockHash]:
    """Chained hashes of the complete blocks of `tokens` (the tail is not hashed).

    `extras[i]`, when given, is mixed into block i (multimodal hashes, cache salts).
    `parent` continues a chain (the hash of the block before `tokens[0]`).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in 32 unsigned bits")
    n_blocks = arr.size // block_size
    if extras is not None and len(extras) < n_blocks:
        raise ValueError(f"{len(extras)} extras for {n_blocks} complete blocks")
    raw = memoryview(arr[: n_blocks * block_size].astype("<u4").tobytes())
    step = block_size * 4
    keyed = hashlib.blake2b(digest_size=HASH_BYTES, key=CHAIN_SEED)  # copied per block: keyed once
    out: list[BlockHash] = []
    h = parent
    for i in range(n_blocks):
        m = keyed.copy()
        m.update(h)
        m.update(raw[i * step : (i + 1) * step])
        if extras is not None:
            m.update(extras[i])
        h = m.digest()
        out.append(h)
    return out


def useful_tokens(matched_tokens: int, block_size: int) -> int:
    """Tokens a remote hit can serve: only complete blocks, T_useful = floor(T/B)*B."""
    return (matched_tokens // block_size) * block_size
