// NVSHMEM as the allocator and peer map of the communication memory: the workspaces
// live on NVSHMEM's symmetric heap and a peer's workspace is `nvshmem_ptr(workspace, pe)`, so
// the kernels keep their plain loads and stores. One PE per process, one GPU per PE.
//
// The host library is loaded at run time (dlopen of the path Python passes, normally the
// nvidia-nvshmem wheel's libnvshmem_host.so.3): jax_ep builds and runs without NVSHMEM, and
// only a Buffer that asks for the NVSHMEM transport needs it. The header types come from the
// wheel at build time (JAX_EP_HAVE_NVSHMEM); a build without them reports so at run time.
//
// Peers that nvshmem_ptr cannot map (reachable only over the network: other hosts) would need
// device-initiated puts with signals in the kernels; they are refused with a clear message.
#pragma once

#include <cstddef>
#include <string>

namespace jax_ep {

// Whether this build has the NVSHMEM types (the wheel's headers were found at build time).
bool nvshmem_built();

// Loads the host library (once; later calls with the same path are no-ops). "" or an error.
std::string nvshmem_load(const std::string& library_path);

// A new unique id (bytes of nvshmemx_uniqueid_t) for nvshmem_initialize, made by one process
// and sent to the others. Needs nvshmem_load. "" or an error.
std::string nvshmem_unique_id(std::string* unique_id);

// Joins the NVSHMEM job as PE `pe` of `num_pes` on CUDA device `device` (collective over the
// PEs; once per process). "" or an error.
std::string nvshmem_initialize(const std::string& unique_id, int pe, int num_pes, int device);

// Whether nvshmem_initialize succeeded in this process.
bool nvshmem_initialized();

// Collective over every PE (same sizes, same order): `bytes` of symmetric device memory.
std::string nvshmem_allocate(size_t bytes, void** ptr);

// The address of `pe`'s copy of the symmetric object `ptr`, usable by this GPU's loads and
// stores; nullptr when `pe` is not reachable that way.
void* nvshmem_peer_address(void* ptr, int pe);

// Collective counterpart of nvshmem_allocate (every PE frees the same object; a barrier).
void nvshmem_release(void* ptr);

// Fills the NVSHMEM device state of the kernels in `library` (a CUlibrary: the NVSHMEM device
// transport's, csrc/plugins/nvshmem_transport_kernels.cu), once per library, after
// nvshmem_initialize. "" or an error.
std::string nvshmem_init_device_library(void* library);

}  // namespace jax_ep
