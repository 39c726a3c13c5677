"""The first buffer of a tensor a step updates in place: ``weights.owned_copy`` (driver/state.py)."""
import numpy as np

from onnx_autodiff.model.weights import owned_copy


def test_a_large_mapped_weight_is_copied_into_memory_of_its_own(tmp_path):
    path = tmp_path / "w.bin"
    want = np.arange(3 * 40_000, dtype=np.float32).reshape(3, 40_000)  # 480 KB: past the small-array cut
    path.write_bytes(b"x" + want.tobytes())  # an odd offset, as a weight inline in an .onnx file sits
    mapped = np.memmap(path, dtype=np.float32, mode="r", offset=1, shape=want.shape)
    got = owned_copy(mapped)
    assert not isinstance(got, np.memmap) and got.flags.writeable and got.flags.c_contiguous and got.flags.aligned
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    got[0, 0] = -1.0  # the step writes into it; the file and its map keep their bytes
    assert mapped[0, 0] == 0.0 and np.frombuffer(path.read_bytes()[1:5], np.float32)[0] == 0.0


def test_a_small_or_strided_array_is_copied_in_c_order():
    small = np.arange(6, dtype=np.float64).reshape(2, 3)
    assert np.array_equal(owned_copy(small), small) and not np.shares_memory(owned_copy(small), small)
    strided = np.arange(200_000, dtype=np.float32).reshape(400, 500).T  # large and not C-contiguous
    got = owned_copy(strided)
    assert got.flags.c_contiguous and np.array_equal(got, strided) and not np.shares_memory(got, strided)
    scalar = owned_copy(np.float32(2.5))
    assert scalar.shape == () and scalar == np.float32(2.5)
