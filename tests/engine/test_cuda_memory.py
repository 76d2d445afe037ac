"""KV cache sizing on CUDA counts only memory the engine allocated itself (snapshots in GiB
for readability; the function takes bytes)."""
import pytest

from engine.cuda_memory import CudaMemory, kv_cache_bytes

GIB = 2**30
TOTAL = 140 * GIB


def snapshot(free, allocated, reserved):
    return CudaMemory(int(free * GIB), TOTAL, int(allocated * GIB), int(reserved * GIB))


def profile(utilization, held_before_gib, weights=15, activations=3, outside_growth=0.5):
    """One engine's start-up when ``held_before_gib`` GiB of torch memory were already
    allocated in this process (another engine) and the CUDA context took 0.5 GiB."""
    held = held_before_gib
    start = snapshot(140 - 0.5 - held, held, held)
    after_weights = snapshot(140 - 0.5 - held - weights, held + weights, held + weights)
    peak = int((held + weights + activations) * GIB)
    after = snapshot(140 - 0.5 - outside_growth - held - weights, held + weights, held + weights)
    return kv_cache_bytes(utilization, start, after_weights, peak, after)


def test_one_engine():
    assert profile(0.9, 0) == int(0.9 * TOTAL - 15 * GIB - 3 * GIB - 0.5 * GIB)


def test_a_second_engine_in_the_process_is_not_charged_for_the_first():
    """Before, the process-wide peak charged engine 2 with engine 1's weights and KV cache."""
    first = profile(0.3, 0)
    second = profile(0.3, held_before_gib=0.3 * 140)
    assert second == first == int(0.3 * TOTAL - 18.5 * GIB)


def test_memory_held_before_start_must_leave_room():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9 asks for 126.00 GiB .* "
                                         r"only 13.50 GiB are free .*set num_gpu_blocks"):
        profile(0.9, held_before_gib=126)


def test_weights_and_activations_beyond_the_share():
    with pytest.raises(ValueError, match=r"no memory left for the KV cache: "
                                         r"gpu_memory_utilization=0.1 gives 14.00 GiB.*15.00 GiB of weights"):
        profile(0.1, 0)


def test_outside_torch_counts_only_growth():
    base = profile(0.9, 0, outside_growth=0)
    assert profile(0.9, 0, outside_growth=2) == base - 2 * GIB
    assert CudaMemory(10, 100, 50, 60).outside_torch == 30
