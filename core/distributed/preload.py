"""Imported once by the forkserver that tensor-parallel workers fork from (see launcher.py).

The heavy imports every worker needs (torch, transformers' configs, the model runner) happen here
once per program instead of once per worker. Nothing here may touch CUDA or import Triton (a
worker's device and Triton mode are decided after it starts).
"""

import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import AutoConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config  # noqa: F401

import backplane.distributed.worker  # noqa: F401
import backplane.executor.model_runner  # noqa: F401
