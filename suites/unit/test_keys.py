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
