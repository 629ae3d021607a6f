"""What this machine has: the CUDA driver and NVML through ctypes (`cuda_driver`), the probes of
versions, devices, GPUs, peer links and the extension (`probes`), the records they fill
(`records`) and what code runs on which GPU and driver (`compat`); and the rules of a Buffer
configuration (`config`), which the Buffer and the report's `BufferSpec` both check.

Used by the backend gate (`jax_ep.backends.gate`), the NVSHMEM peer mapping and the environment
report; imports nothing else of jax_ep.
"""
