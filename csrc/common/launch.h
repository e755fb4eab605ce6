// Host-side launch helpers shared by the sm90 kernels.
#pragma once
#include <cuda_runtime.h>

namespace fp8l {

// Raise a kernel's dynamic shared-memory limit once per device rather than before every
// launch: the driver call costs host time on every decode step, and eager models feel it.
template <auto Kernel>
inline cudaError_t ensure_smem_limit(int bytes) {
  static int granted[64] = {};  // per kernel instantiation, per device
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev < 64 && granted[dev] >= bytes) return cudaSuccess;
  e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess && dev < 64) granted[dev] = bytes;
  return e;
}

// The attribute that launches a kernel under programmatic dependent launch: it may start once
// the previous kernel triggers (griddepcontrol.launch_dependents) and waits for it in-kernel.
inline cudaLaunchAttribute pdl_attribute() {
  cudaLaunchAttribute a;
  a.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  a.val.programmaticStreamSerializationAllowed = 1;
  return a;
}

}  // namespace fp8l
