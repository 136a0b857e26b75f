export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tests
R=$OUT; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch;print(torch.__version__, torch.cuda.nccl.version(), torch.cuda.device_count())"
