# Sourced by the GPU scripts from the repository root: hsdp's sources on the path (SRC,
# default src), NVLink multicast off in NCCL, torch's symmetric memory and NVSHMEM (shared
# machines: docs/guide/multi_node.md), Python's output unbuffered (logs read while running).
export PYTHONPATH=${SRC:-src} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
    NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
