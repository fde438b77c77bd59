"""Tensor parallelism on torch.distributed: rank 0 is the Engine's process and drives workers.

`--tp-size N` starts ranks 1..N-1 (launcher.py); every rank loads the plugins, builds its own
ModelRunner on its weight shard and KV pool (sized by its local KV heads), and joins two process
groups: the tensor group (NCCL on GPU, gloo on CPU) for the layers' collectives, and a gloo group
for host data. Each forward, rank 0 broadcasts the ForwardBatch's host data (batch_sync.py, with
the LoRA slot table from lora_sync.py), built without reading a device tensor; input ids still in
flight under overlap scheduling go as placeholders, and rank 0's resolved ids follow over the
tensor group on the device. Each worker rebuilds the batch against its own pools, mirrors rank 0's
req_to_token writes, and runs the same forward (worker.py). Only rank 0's logits are used and only
rank 0 samples. A worker that fails reports its exception; rank 0 raises WorkerFailedError naming
the rank and cause (driver.py) instead of hanging.
"""

from backplane.distributed.launcher import WorkerFailedError

__all__ = ["WorkerFailedError"]
