# Sourced by the GPU scripts: unpack the carried site archive (../shared/device/make-site.sh makes
# it as .device/site.tar.xz), put it on PYTHONPATH, keep NVLink multicast off in every process,
# install the project, and say what the machine has. Sets `out` (the $OUT folder).
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ -f .device/site.tar.xz ] && [ ! -d /tmp/site ]; then
  tar -xJf .device/site.tar.xz -C /tmp
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install -q --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
