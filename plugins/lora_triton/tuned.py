"""Measured launch settings of the fused decode kernel, per device (like vLLM's fused-MoE configs).

`choose_split` in fused.py is a model of one launch's reads; it cannot see launch latency, L2 hits or
the serial steps inside a program, which is what decides a decode-sized LoRA kernel. So a device can
carry a table measured on it: `python -m bench.lora_kernels --tune` times every (span, split_k, num_warps)
the kernel's buffers allow, per projection group shape, rank and token bucket, checks each result
against torch_native, and writes the fastest as JSON. The backend looks the launch up there first
and falls back to the model for a shape the table lacks.

The file: `configs/<device name, spaces as underscores>.json` beside this module (the one for the
GPU it runs on), or the path given by `--triton-lora.configs` (BACKPLANE_TRITON_LORA__CONFIGS):

    {"device": "NVIDIA H200", "triton": "3.6.0", "dtype": "bfloat16",
     "entries": [{"k": 2048, "widths": [2048, 512, 512], "block_r": 16, "block_t": 16,
                  "span": 128, "split_k": 8, "num_warps": 4, "us": 4.1}, ...]}

block_r and block_t are the kernel's padded rank and token tile (powers of two, 16 to 128 and 16 to
64): one entry serves every rank and token count that pads to them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_FIELDS = ("k", "widths", "block_r", "block_t", "span", "split_k", "num_warps")


def device_file_name(device_name: str) -> str:
    """configs/ file name of a device, from torch.cuda.get_device_name()."""
    return device_name.strip().replace(" ", "_") + ".json"


@dataclass(frozen=True)
class Launch:
    span: int
    split_k: int
    num_warps: int


@dataclass
class TunedTable:
    """(k, widths, block_r) -> {block_t: Launch}, from one JSON file."""

    source: str = ""
    entries: dict[tuple[int, tuple[int, ...], int], dict[int, Launch]] = field(default_factory=dict)

    def lookup(self, k: int, widths: tuple[int, ...], block_r: int, block_t: int) -> Launch | None:
        """The entry for this shape at block_t, else at the nearest block_t measured; None if the
        shape was never measured."""
        by_tokens = self.entries.get((k, tuple(widths), block_r))
        if not by_tokens:
            return None
        nearest = min(by_tokens, key=lambda t: (abs(t - block_t), t))
        return by_tokens[nearest]

    def __len__(self) -> int:
        return sum(len(v) for v in self.entries.values())

    @classmethod
    def from_json(cls, data: dict, source: str, max_groups: int) -> TunedTable:
        table = cls(source=source)
        entries = data.get("entries") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ValueError(f"{source}: expected a JSON object with a list \"entries\", got {type(data).__name__}")
        for i, entry in enumerate(entries):
            missing = [name for name in _FIELDS if name not in entry]
            if missing:
                raise ValueError(f"{source}: entry {i} lacks {', '.join(missing)}; expected the fields {', '.join(_FIELDS)}")
            k, widths = int(entry["k"]), tuple(int(w) for w in entry["widths"])
            launch = Launch(int(entry["span"]), int(entry["split_k"]), int(entry["num_warps"]))
            groups = sum(-(-w // launch.span) for w in widths) * launch.split_k
            if launch.span < 16 or launch.split_k < 1 or launch.num_warps not in (1, 2, 4, 8, 16):
                raise ValueError(f"{source}: entry {i}: expected span >= 16, split_k >= 1 and num_warps a power of "
                                 f"two up to 16, got span {launch.span}, split_k {launch.split_k}, num_warps {launch.num_warps}")
            if launch.split_k > 1 and groups > max_groups:
                raise ValueError(f"{source}: entry {i}: span {launch.span} x split_k {launch.split_k} over widths "
                                 f"{list(widths)} needs {groups} programs per slot; the kernel holds {max_groups}")
            key = (k, widths, int(entry["block_r"]))
            table.entries.setdefault(key, {})[int(entry["block_t"])] = launch
        return table


def load_table(path: str | Path, max_groups: int) -> TunedTable:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"triton-lora.configs: {path} does not exist; expected a JSON file written by "
                         "python -m bench.lora_kernels --tune") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"triton-lora.configs: {path} is not JSON ({exc})") from None
    return TunedTable.from_json(data, str(path), max_groups)


def table_for(device, configured: str | None, max_groups: int) -> TunedTable:
    """The table a backend on `device` uses: the configured file, else the bundled file of this GPU,
    else an empty table (the model decides every launch)."""
    if configured:
        return load_table(configured, max_groups)
    if getattr(device, "type", str(device)) != "cuda":
        return TunedTable()
    import torch

    bundled = CONFIG_DIR / device_file_name(torch.cuda.get_device_name(device))
    return load_table(bundled, max_groups) if bundled.exists() else TunedTable()
