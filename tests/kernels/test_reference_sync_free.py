"""The torch reference never reads device memory on the host when the engine gives it host
copies of ``query_start_loc``, ``seq_lens`` and ``slot_mapping``, so on a GPU it queues a
layer's work without waiting for it (before: ``.tolist()`` and ``nonzero`` in every layer).

"Device" tensors here live on the ``meta`` device, which has no data: any host read of them
(``.tolist()``, ``.item()``, ``nonzero``, a boolean mask) raises, just where CUDA would sync.
"""
import pytest
import torch

from kernels import reference
from tests.kernels.paged_cases import DECODE, MIXED, make_batch


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return t.to("meta")


@pytest.mark.parametrize("seqs", [MIXED, DECODE], ids=["mixed", "decode"])
def test_reads_only_host_metadata(seqs):
    batch = make_batch(seqs, 6, 2, 64, 16, torch.float32)
    key = _on_meta(batch.query[:, :2])
    slots = torch.arange(batch.query.shape[0])  # host
    reference.store_kv(key, key, _on_meta(batch.k_cache), _on_meta(batch.v_cache), slots)
    out = reference.paged_attention(_on_meta(batch.query), _on_meta(batch.k_cache),
                                    _on_meta(batch.v_cache), _on_meta(batch.block_tables),
                                    batch.query_start_loc, batch.seq_lens, batch.scale)
    assert out.device.type == "meta" and out.shape == batch.query.shape


def test_the_check_catches_device_reads():
    """Control: the same calls with device-side metadata read device memory."""
    batch = make_batch(MIXED, 6, 2, 64, 16, torch.float32)
    with pytest.raises((NotImplementedError, RuntimeError)):
        reference.paged_attention(*map(_on_meta, batch.args()[:-1]), batch.scale)
    key = _on_meta(batch.query[:, :2])
    with pytest.raises((NotImplementedError, RuntimeError)):
        reference.store_kv(key, key, _on_meta(batch.k_cache), _on_meta(batch.v_cache),
                           _on_meta(torch.arange(batch.query.shape[0])))


def test_host_slots_with_skipped_tokens_match_device_slots():
    """Host-side slot_mapping with -1 entries stores exactly what device-side slots store."""
    batch = make_batch([(40, 10)], 4, 2, 64, 16, torch.float32)
    key = torch.randn(10, 2, 64)
    slots = torch.tensor([5, -1, 7, 8, -1, 30, 31, 32, -1, 0])
    expected_k, expected_v = batch.k_cache.clone(), batch.v_cache.clone()
    reference.store_kv(key, -key, expected_k, expected_v, slots.to(batch.k_cache.device))
    reference.store_kv(key, -key, batch.k_cache, batch.v_cache, slots)
    torch.testing.assert_close(batch.k_cache, expected_k, equal_nan=True)
    torch.testing.assert_close(batch.v_cache, expected_v, equal_nan=True)
    flat = batch.k_cache.view(-1, 2, 64)
    assert torch.equal(flat[31], key[6]) and torch.equal(flat[0], key[9])
