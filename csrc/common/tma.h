// Host-side TMA descriptor encoding. cuTensorMapEncodeTiled is a driver API function: fetched
// through the runtime's entry-point query so the extension needs no -lcuda at link time.
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <string>

namespace fp8l {

inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000,
                                         cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// 2-D row-major tensor [rows, cols] of `elem_bytes` elements, row stride `ld` elements, loaded
// in boxes of box_rows x box_cols. Out-of-bounds reads fill zeros; writes are clipped.
inline std::string make_tensor_map_2d(CUtensorMap* map, const void* base, CUtensorMapDataType dtype,
                                      int elem_bytes, uint64_t rows, uint64_t cols, uint64_t ld,
                                      uint32_t box_rows, uint32_t box_cols,
                                      CUtensorMapSwizzle swizzle) {
  auto encode = tensor_map_encoder();
  if (encode == nullptr) return "cuTensorMapEncodeTiled is not available from the CUDA driver";
  cuuint64_t dims[2] = {cols, rows};
  cuuint64_t strides[1] = {ld * elem_bytes};
  cuuint32_t box[2] = {box_cols, box_rows};
  cuuint32_t elem_strides[2] = {1, 1};
  CUresult r = encode(map, dtype, 2, const_cast<void*>(base), dims, strides, box, elem_strides,
                      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return "cuTensorMapEncodeTiled failed (" + std::to_string(int(r)) + ") for a " +
           std::to_string(rows) + "x" + std::to_string(cols) + " tensor";
  return "";
}

}  // namespace fp8l
