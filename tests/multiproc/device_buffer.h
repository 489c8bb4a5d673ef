// Device memory for the CUDA tests and their peer program, through eplbx's run-time loaded
// driver (no cudart): plain cuMemAlloc memory (legacy IPC) or cuMem* memory mapped from two
// exportable allocations (what PyTorch's expandable segments give).
#ifndef EPLBX_TESTS_MULTIPROC_DEVICE_BUFFER_H_
#define EPLBX_TESTS_MULTIPROC_DEVICE_BUFFER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "eplbx/status.h"
#include "transfer/cuda/cuda_driver.h"

namespace eplbx::testing {

class DeviceBuffer {
 public:
  // `vmm`: two cuMemCreate allocations (POSIX fd handles, unless !exportable) mapped back to
  // back.
  static Result<std::unique_ptr<DeviceBuffer>> Create(size_t bytes, bool vmm,
                                                      bool exportable = true) {
    Result<const internal::cuda::Driver*> dr = internal::cuda::LoadDriver();
    if (!dr.ok()) return dr.status();
    const internal::cuda::Driver& d = **dr;
    EPLBX_RETURN_IF_ERROR(internal::cuda::UseDevice(d, 0));
    std::unique_ptr<DeviceBuffer> b(new DeviceBuffer(d, bytes));
    if (!vmm) {
      if (CUresult r = d.cuMemAlloc(&b->ptr_, bytes); r != CUDA_SUCCESS) {
        return Status::Unavailable(d.Error("cuMemAlloc", r));
      }
      return b;
    }
    CUmemAllocationProp prop{};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = 0;
    prop.requestedHandleTypes =
        exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    size_t gran = 0;
    d.cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    const size_t half = (bytes / 2 + gran - 1) / gran * gran;
    b->vmm_bytes_ = 2 * half;
    if (CUresult r = d.cuMemAddressReserve(&b->ptr_, b->vmm_bytes_, 0, 0, 0); r != CUDA_SUCCESS) {
      b->ptr_ = 0;
      return Status::Unavailable(d.Error("cuMemAddressReserve", r));
    }
    for (int i = 0; i < 2; ++i) {
      CUmemGenericAllocationHandle h = 0;
      if (CUresult r = d.cuMemCreate(&h, half, &prop, 0); r != CUDA_SUCCESS) {
        return Status::Unavailable(d.Error("cuMemCreate", r));
      }
      CUresult r = d.cuMemMap(b->ptr_ + i * half, half, 0, h, 0);
      d.cuMemRelease(h);
      if (r != CUDA_SUCCESS) return Status::Unavailable(d.Error("cuMemMap", r));
      b->mapped_.push_back(i * half);
      b->half_ = half;
    }
    CUmemAccessDesc access{};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    if (CUresult r = d.cuMemSetAccess(b->ptr_, b->vmm_bytes_, &access, 1); r != CUDA_SUCCESS) {
      return Status::Unavailable(d.Error("cuMemSetAccess", r));
    }
    return b;
  }

  ~DeviceBuffer() {
    if (ptr_ == 0) return;
    if (vmm_bytes_ == 0) {
      d_.cuMemFree(ptr_);
      return;
    }
    for (uint64_t off : mapped_) d_.cuMemUnmap(ptr_ + off, half_);
    d_.cuMemAddressFree(ptr_, vmm_bytes_);
  }

  void* data() const { return reinterpret_cast<void*>(static_cast<uintptr_t>(ptr_)); }
  size_t size() const { return bytes_; }

  Status Upload(const void* src, size_t off, size_t n) const {
    if (CUresult r = d_.cuMemcpyHtoD(ptr_ + off, src, n); r != CUDA_SUCCESS) {
      return Status::Internal(d_.Error("cuMemcpyHtoD", r));
    }
    return Status::OK();
  }
  Result<std::vector<uint8_t>> Download(size_t off, size_t n) const {
    std::vector<uint8_t> out(n);
    if (CUresult r = d_.cuMemcpyDtoH(out.data(), ptr_ + off, n); r != CUDA_SUCCESS) {
      return Status::Internal(d_.Error("cuMemcpyDtoH", r));
    }
    return out;
  }

 private:
  DeviceBuffer(const internal::cuda::Driver& d, size_t bytes) : d_(d), bytes_(bytes) {}
  const internal::cuda::Driver& d_;
  size_t bytes_ = 0;
  CUdeviceptr ptr_ = 0;
  size_t vmm_bytes_ = 0;  // 0: cuMemAlloc
  size_t half_ = 0;
  std::vector<uint64_t> mapped_;
};

}  // namespace eplbx::testing

#endif  // EPLBX_TESTS_MULTIPROC_DEVICE_BUFFER_H_
