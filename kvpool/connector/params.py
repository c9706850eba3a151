"""What crosses from the scheduler to the worker (KVPoolMetadata), a request's own kvpool
parameters (kv_transfer_params), and the inputs a request's block chain is hashed from.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

from kvpool.connector import vllm_compat as compat
from kvpool.connector.adapter import UnreadableAdapter, adapter_identity
from kvpool.connector.copier import CopyRun
from kvpool.pool.keys import HASH_BYTES, ROOT_HASH, block_hashes


# -- metadata -------------------------------------------------------------------------------

BlockRun = CopyRun  # consecutive blocks of one request: engine block ids and their pool keys


@dataclasses.dataclass
class KVPoolMetadata(compat.KVConnectorMetadata):
    loads: list[BlockRun] = dataclasses.field(default_factory=list)
    # loads of requests vLLM holds (WAITING_FOR_REMOTE_KVS) until get_finished reports them:
    # no step reads these blocks before that
    async_loads: list[BlockRun] = dataclasses.field(default_factory=list)
    stores: list[BlockRun] = dataclasses.field(default_factory=list)
    # requests preempted since the last step: their blocks are free now, so their stores
    # must finish before the next forward may write into those blocks
    drain: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """A request's `kv_transfer_params["kvpool"]`, typed. Everything a request carries is
    checked here, before it can reach a scheduler hook: an exception there would end vLLM's
    engine core for every request. A malformed field is not an exception but `error`: the
    request is then served without the pool (nothing loaded, nothing published), and the
    history says why."""

    tag: str | None = None
    load: bool = True
    publish: bool = True
    publish_tokens: int | None = None
    error: str | None = None

    KNOWN = ("tag", "load", "publish", "publish_tokens")

    @classmethod
    def of(cls, request) -> RequestParams:  # noqa: ANN001
        return cls.parse(getattr(request, "kv_transfer_params", None))

    @classmethod
    def parse(cls, params: object) -> RequestParams:
        """The same check of a request's raw `kv_transfer_params` (kvpool.connector.http runs it on
        the HTTP body, before the request reaches the engine)."""
        if params is None:
            return cls()
        if not isinstance(params, dict):
            return cls(load=False, publish=False, error=f"kv_transfer_params must be an object, got {params!r}"[:200])
        ours = params.get("kvpool")
        if ours is None:
            return cls()
        if not isinstance(ours, dict):
            return cls(load=False, publish=False, error=f"kv_transfer_params.kvpool must be an object, got {ours!r}"[:200])
        problems = [f"unknown field {k!r}" for k in ours if k not in cls.KNOWN]
        tag = ours.get("tag")
        if tag is not None and not isinstance(tag, (str, int)):
            problems.append(f"tag must be a string, got {tag!r}")
        for flag in ("load", "publish"):
            if ours.get(flag) is not None and not isinstance(ours[flag], bool):
                problems.append(f"{flag} must be true or false, got {ours[flag]!r}")
        limit = ours.get("publish_tokens")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            problems.append(f"publish_tokens must be a non-negative integer, got {limit!r}")
        if problems:
            return cls(tag=str(tag)[:200] if isinstance(tag, (str, int)) else None, load=False, publish=False,
                       error=("kv_transfer_params.kvpool: " + "; ".join(problems))[:400])
        return cls(str(tag) if tag is not None else None, ours.get("load", True) is not False,
                   ours.get("publish", True) is not False, limit)


def request_tag(request) -> str:  # noqa: ANN001
    tag = RequestParams.of(request).tag
    return tag if tag else str(request.request_id)


def salt_root(request) -> bytes:  # noqa: ANN001
    """A request's cache_salt isolates its cache: it seeds the block chain."""
    salt = getattr(request, "cache_salt", None)
    if not salt:
        return ROOT_HASH
    return hashlib.blake2b(b"kvgate/cache-salt/" + str(salt).encode(), digest_size=HASH_BYTES).digest()


class UnsupportedInput(ValueError):
    """A request carries something that changes its KV and that the keys cannot represent:
    the request neither loads nor publishes (it is served, recorded as `unsupported`)."""


@dataclasses.dataclass(frozen=True)
class ChainInputs:
    """What besides its token ids changes a request's KV, as its block chain takes it: the
    LoRA adapter (its content's digest, mixed into the chain's root), multimodal items (each mixed into every
    complete block its placeholder overlaps, by the item's content hash)."""

    root: bytes = ROOT_HASH
    extras: tuple[bytes, ...] | None = None

    def hashes(self, tokens: Sequence[int], block_size: int, salt_root: bytes = ROOT_HASH) -> list[bytes]:
        root = self.root if salt_root == ROOT_HASH else (
            salt_root if self.root == ROOT_HASH else
            hashlib.blake2b(salt_root + self.root, digest_size=HASH_BYTES).digest())
        n = (len(tokens) // block_size) * block_size
        extras = None if self.extras is None else list(self.extras[: n // block_size])
        return block_hashes(tokens[:n], block_size, parent=root, extras=extras)


def chain_inputs(request, block_size: int) -> ChainInputs:  # noqa: ANN001
    """A request's ChainInputs; UnsupportedInput for what the keys cannot represent (prompt
    embeddings; multimodal items without a content hash or a placeholder position; a LoRA
    adapter whose content kvpool cannot read)."""
    if getattr(request, "prompt_embeds", None) is not None:
        raise UnsupportedInput("prompt embeddings: the KV depends on vectors the keys do not hash")
    root = ROOT_HASH
    lora = getattr(request, "lora_request", None)
    if lora is not None:  # by the adapter's content, never its name, id or path (kvpool.connector.adapter)
        try:
            content = adapter_identity(lora)
        except UnreadableAdapter as exc:
            raise UnsupportedInput(str(exc)) from exc
        root = hashlib.blake2b(b"kvgate/lora/" + content, digest_size=HASH_BYTES).digest()
    features = getattr(request, "mm_features", None) or []
    if not features:
        return ChainInputs(root)
    n_blocks = len(getattr(request, "prompt_token_ids", None) or []) // block_size
    extras = [b""] * n_blocks
    for f in features:
        ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
        pos = getattr(f, "mm_position", None)
        offset, length = getattr(pos, "offset", None), getattr(pos, "length", None)
        if not ident or not isinstance(offset, int) or not isinstance(length, int) or length <= 0 or offset < 0:
            raise UnsupportedInput(f"a multimodal item without a content hash or a position ({type(f).__name__})")
        for i in range(offset // block_size, min(n_blocks, -(-(offset + length) // block_size))):
            extras[i] += hashlib.blake2b(f"{ident}@{offset}".encode(), digest_size=HASH_BYTES).digest()
    return ChainInputs(root, tuple(extras))


def request_inputs(request, block_size: int) -> tuple[ChainInputs, str | None]:  # noqa: ANN001
    """(the request's ChainInputs, None), or (plain ChainInputs, why) when its keys cannot
    represent it: such a request is served without the pool, keyed by its tokens alone."""
    try:
        return chain_inputs(request, block_size), None
    except UnsupportedInput as exc:
        return ChainInputs(), str(exc)


def kv_groups_unsupported(kv_cache_config) -> str | None:  # noqa: ANN001
    """Why the connector cannot serve this engine's KV cache, if it cannot: it moves the
    blocks of one KV-cache group, so an engine with several (sliding-window and full
    attention layers, say) would share only part of each block's KV."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and len(groups) > 1:
        return f"{len(groups)} KV-cache groups: the connector moves one group's blocks"
    return None
