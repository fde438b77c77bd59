# Sourced by the GPU scripts: unpack the carried site archive (../shared/device/make-site.sh makes
# it as .device/site.tar.xz), put it on PYTHONPATH, keep NVLink multicast off in every process,
# install the project, and say what the machine has. Sets `out` (the $OUT folder).
out=${OUT:-/tmp/out}
mkdir -p "$out"
if [ -f .device/site.tar.xz ] && [ ! -d /tmp/site ]; then
  tar -xJf .device/site.tar.xz -C /tmp
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# FlashInfer modules JIT-built on an earlier machine (bench/gpu_batch.sh with SAVE_FLASHINFER_AOT=1
# brings them back as .device/flashinfer-aot.tar.xz.part-*): installed as AOT modules, which
# FlashInfer loads without building. A module missing there is JIT-built as before.
aot=/tmp/site/flashinfer/data/aot
if compgen -G ".device/flashinfer-aot.tar.xz.part-*" > /dev/null && [ -d /tmp/site/flashinfer ] && [ ! -d "$aot" ]; then
  mkdir -p "$aot" && cat .device/flashinfer-aot.tar.xz.part-* | tar -xJ -C "$aot" \
    && echo "flashinfer: $(ls "$aot" | wc -l) prebuilt modules from .device" || echo "flashinfer: prebuilt modules did not unpack"
fi
export PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install -q --no-deps --no-build-isolation -e .
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
