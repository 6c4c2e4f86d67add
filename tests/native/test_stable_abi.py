"""``native/stable_abi``: the addresses of torch's stable C ABI functions (None where one named is
missing, 0 for a missing optional one), its codes (a dtype's as torch's tensors report it), and a
C function registered as an op's kernel (``native/dynquant``'s, tested there)."""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")

from backplane.native import stable_abi  # noqa: E402

pytestmark = pytest.mark.skipif(stable_abi.codes(["aoti_torch_dtype_float32"]) is None,
                                reason="this torch has no stable ABI")


def test_addresses_of_present_and_missing_functions():
    found = stable_abi.addresses(["aoti_torch_get_data_ptr", "aoti_torch_get_numel"],
                                 optional=["aoti_torch_not_a_function"])
    assert found is not None and len(found) == 3
    assert found[0] and found[1] and found[0] != found[1] and found[2] == 0
    assert stable_abi.addresses(["aoti_torch_get_numel", "aoti_torch_not_a_function"]) is None


def test_a_function_at_its_address_reads_a_tensor():
    """aoti_torch_get_numel through its address, on a handle torch made: the ABI as the C calls
    it (a handle is an owned at::Tensor; deleted after)."""
    (numel, new, delete), lib = stable_abi.addresses(
        ["aoti_torch_get_numel", "aoti_torch_empty_strided",
         "aoti_torch_delete_tensor_object"]), stable_abi.libtorch()
    float32, cpu = stable_abi.codes(["aoti_torch_dtype_float32", "aoti_torch_device_type_cpu"])
    handle, count = ctypes.c_void_p(), ctypes.c_int64()
    sizes, strides = (ctypes.c_int64 * 2)(3, 5), (ctypes.c_int64 * 2)(5, 1)
    make = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                            ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                            ctypes.POINTER(ctypes.c_void_p))(new)
    assert make(2, sizes, strides, float32, cpu, 0, ctypes.byref(handle)) == 0
    read = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64))(numel)
    assert read(handle, ctypes.byref(count)) == 0 and count.value == 15
    assert ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_void_p)(delete)(handle) == 0
    assert lib is not None


def test_codes_are_torchs():
    float32, int8 = stable_abi.codes(["aoti_torch_dtype_float32", "aoti_torch_dtype_int8"])
    assert float32 != int8
    assert stable_abi.codes(["aoti_torch_dtype_not_one"]) is None
