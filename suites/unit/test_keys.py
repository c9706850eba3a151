"""Keys: chained block hashes and the namespace."""


import numpy as np
import pytest

from kvpool.pool.keys import Namespace, block_hashes, dtype_bytes, useful_tokens

NS = Namespace("m", "r1", "tok", "bfloat16", "cpu", 16, 2, 2, 64)


def test_only_complete_blocks_are_keys():
    assert len(block_hashes(range(47), 16)) == 2
    assert len(block_hashes(range(48), 16)) == 3
    assert block_hashes(range(15), 16) == []


def test_chain_is_deterministic_and_prefix_stable():
    a = block_hashes(list(range(100, 164)), 16)
    b = block_hashes(np.arange(100, 200), 16)
    assert a == b[:4]
    assert len(set(b)) == len(b)
    assert all(len(h) == 16 for h in b)


def test_a_changed_token_changes_its_block_and_every_later_one():
    tokens = list(range(64))
    changed = tokens.copy()
    changed[20] = 9999
    a, b = block_hashes(tokens, 16), block_hashes(changed, 16)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:]))


def test_same_block_at_another_position_has_another_hash():
    block = list(range(16))
    h = block_hashes(block * 2, 16)
    assert h[0] != h[1]


def test_extras_and_parent_enter_the_chain():
    tokens = list(range(32))
    plain = block_hashes(tokens, 16)
    salted = block_hashes(tokens, 16, extras=[b"a", b"b"])
    assert plain[0] != salted[0]
    cont = block_hashes(tokens[16:], 16, parent=plain[0])
    assert cont == plain[1:]
    with pytest.raises(ValueError):
        block_hashes(tokens, 16, extras=[b"a"])


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16])
def test_token_ids_out_of_range_are_rejected(bad):
    with pytest.raises(ValueError):
        block_hashes(bad, 16)


def test_useful_tokens():
    assert useful_tokens(47, 16) == 32
    assert useful_tokens(48, 16) == 48
    assert useful_tokens(15, 16) == 0


def test_differing_fields_names_each_field_and_ignores_tenant():
    other = NS.replace(model_revision="r2", kv_dtype="float16", tenant="t2")
    assert NS.differing_fields(other) == ("model_revision", "kv_dtype")
    assert NS.differing_fields(NS) == ()


def test_namespace_validates_types():
    with pytest.raises(TypeError):
        NS.replace(block_size="16")
    with pytest.raises(ValueError):
        NS.replace(block_size=0)
    with pytest.raises(ValueError):
        NS.replace(tp_rank=1, tp_world_size=1)
    with pytest.raises(ValueError):
        Namespace.from_dict({**NS.as_dict(), "colour": "red"})


def test_bytes_per_token_uses_kv_heads():
    # The tiny model: 2 x 2 layers x 2 KV heads x 64 x 2 bytes = 1 KiB per token.
    assert NS.bytes_per_token == 1024
    big = NS.replace(num_layers=64, num_kv_heads=8, head_size=128)
    assert big.bytes_per_token == 2 * 64 * 8 * 128 * 2


def test_an_unknown_namespace_field_is_named_in_the_error():
    with pytest.raises(ValueError, match=r"unknown Namespace fields: \['colour', 'shape'\]"):
        Namespace.from_dict({**NS.as_dict(), "shape": 1, "colour": "red"})


@pytest.mark.parametrize("name, size", [("torch.bfloat16", 2), ("torch.float32", 4), ("torch.fp8_e4m3", 1),
                                        ("float16", 2)])
def test_a_kv_dtype_is_sized_with_or_without_the_torch_prefix(name, size):
    """vLLM names its cache dtype as torch prints it ("torch.bfloat16"): the prefix, and only
    a leading one, is dropped before the name is looked up."""
    assert dtype_bytes(name) == size
    assert NS.replace(kv_dtype=name).bytes_per_token == 2 * 2 * 2 * 64 * size


@pytest.mark.parametrize("name", ["bfloat16.torch.", "TORCH.bfloat16", "torch.int4", ""])
def test_an_unknown_kv_dtype_is_refused_by_name(name):
    with pytest.raises(ValueError, match=f"unknown KV dtype {name!r}"):
        dtype_bytes(name)


@pytest.mark.parametrize("block_size", [0, -16])
def test_a_block_size_that_is_not_positive_is_refused(block_size):
    with pytest.raises(ValueError, match="block_size must be positive"):
        block_hashes(range(32), block_size)


def test_a_block_of_one_token_is_a_block():
    assert len(block_hashes(range(5), 1)) == 5
    assert block_hashes(range(5), 1)[:2] == block_hashes(range(2), 1)


def test_the_chain_is_pinned_to_its_seed_and_encoding():
    """Keyed BLAKE2b-128 under CHAIN_SEED over little-endian uint32 tokens: the same bytes in
    every process and release (a change is a new protocol version and empties every pool)."""
    import hashlib

    from kvpool.pool.keys import CHAIN_SEED, ROOT_HASH

    assert block_hashes(range(16), 16)[0].hex() == "94321cc9c7d2d91afb14275a9d3208ea"
    assert block_hashes(range(32), 16, extras=[b"x", b"y"])[1].hex() == "b54d5bc7064cdf7489bff2359a5c5f0f"
    first = hashlib.blake2b(ROOT_HASH + np.arange(16, dtype="<u4").tobytes(), digest_size=16, key=CHAIN_SEED)
    assert block_hashes(range(16), 16)[0] == first.digest()


def test_the_largest_32_bit_token_id_is_a_token():
    top = [0xFFFF_FFFF] * 16
    assert len(block_hashes(top, 16)) == 1 and block_hashes(top, 16) != block_hashes([0xFFFF_FFFE] * 16, 16)
    with pytest.raises(ValueError, match="^token ids must fit in 32 unsigned bits$"):
        block_hashes([0x1_0000_0000] * 16, 16)


def test_each_refusal_says_what_it_refused():
    with pytest.raises(ValueError, match=r"tokens must be one-dimensional, got shape \(2, 16\)"):
        block_hashes(np.zeros((2, 16), dtype=np.int64), 16)
    with pytest.raises(ValueError, match="1 extras for 2 complete blocks"):
        block_hashes(range(32), 16, extras=[b"a"])
    with pytest.raises(TypeError, match="Namespace.block_size must be an int, got '16'"):
        NS.replace(block_size="16")
    with pytest.raises(TypeError, match="Namespace.model_id must be a str, got 7"):
        NS.replace(model_id=7)
    with pytest.raises(ValueError, match="Namespace.head_size must be positive, got 0"):
        NS.replace(head_size=0)
    with pytest.raises(ValueError, match="Namespace.tp_rank 2 outside world size 2"):
        NS.replace(tp_rank=2, tp_world_size=2)
