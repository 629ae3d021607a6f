"""What this machine has: the CUDA driver and NVML through ctypes (`cuda_driver`), the probes of
versions, devices, GPUs, peer links and the extension (`probes`), the records they fill
(`records`), what code runs on which GPU and driver (`compat`), the cross-host preflight
(`cluster`: NVSHMEM's plugins, RDMA devices, GPUDirect RDMA, IBGDA, the NIC of each GPU) and the
rules of a Buffer configuration (`config`), which the Buffer and the report's `BufferSpec` both
check.

Used by the backend gate (`jax_ep.backends.gate`), the NVSHMEM peer mapping and the environment
report; of the rest of jax_ep it imports only the leaves `jax_ep.settings` and `jax_ep.fp8`.
"""
