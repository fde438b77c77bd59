"""Launch configurations of the MoE kernels: a table per GPU, a rule of thumb where it is silent.

A Config holds BLOCK_M (the layout's block height, shared by both GEMMs) and one gemm.Launch per
GEMM. The table is a JSON file per device, `configs/<torch.cuda.get_device_name(), spaces as
underscores>.json` beside this module, or the file given by `--triton-moe.configs`:

    {"device": "NVIDIA H200", "triton": "3.6.0", "tuned": true,
     "entries": [{"dtype": "bfloat16", "E": 128, "N": 768, "K": 2048, "tokens": 8, "block_m": 16,
                  "gate_up": {"block_n": 32, "block_k": 128, "group_m": 1, "num_warps": 4, "num_stages": 4},
                  "down": {"block_n": 64, "block_k": 128, "group_m": 1, "num_warps": 4, "num_stages": 4},
                  "us": 41.2}, ...]}

keyed by the layer's shape (dtype, E experts, N = this rank's intermediate size, K = hidden size)
and a token count: a forward of T tokens takes the entry measured nearest to T (on a log scale).
`tune.py` writes such files; `configs/README.md` says how the bundled ones came about.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from backplane.plugins.moe_triton.gemm import Launch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
BLOCK_MS = (16, 32, 64, 128)
_LAUNCH_FIELDS = ("block_n", "block_k", "group_m", "num_warps", "num_stages")
_ENTRY_FIELDS = ("dtype", "E", "N", "K", "tokens", "block_m", "gate_up", "down")


@dataclass(frozen=True)
class Config:
    block_m: int
    gate_up: Launch
    down: Launch


ShapeKey = tuple[str, int, int, int]  # (dtype name, E, N = intermediate per partition, K = hidden)


def shape_key(dtype: torch.dtype, num_experts: int, intermediate: int, hidden: int) -> ShapeKey:
    return (str(dtype).removeprefix("torch."), num_experts, intermediate, hidden)


def default_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> Config:
    """The rule of thumb (untuned): BLOCK_M near the pairs an expert gets on average, so each
    expert's weights are read about once; narrow tiles and deep K steps for decode sizes, where the
    GEMMs only stream weights and want many programs; wider tiles, L2 grouping of the blocks of one
    expert and more warps once blocks fill up."""
    per_expert = num_tokens * top_k / num_experts
    block_m = next((m for m, most in zip(BLOCK_MS, (8, 24, 256)) if per_expert <= most), BLOCK_MS[-1])
    small = block_m <= 32
    stages = 2 if dtype == torch.float32 else (4 if small else 3)  # NOTE: fp32 tiles are twice the shared memory
    group_m = 1 if block_m == 16 else 8
    gate_up = Launch(block_n=32 if block_m == 16 else 64, block_k=128 if small else 64, group_m=group_m,
                     num_warps=4 if small else 8, num_stages=stages)
    down = Launch(block_n=64 if small else 128, block_k=128 if small else 64, group_m=group_m,
                  num_warps=4 if small else 8, num_stages=stages)
    return Config(block_m, gate_up, down)


@dataclass
class ConfigTable:
    """ShapeKey -> {token count: Config}, from one JSON file (or empty: the rule of thumb decides)."""

    source: str = ""
    tuned: bool = False
    entries: dict[ShapeKey, dict[int, Config]] = field(default_factory=dict)

    def lookup(self, key: ShapeKey, num_tokens: int) -> Config | None:
        """The entry measured nearest to num_tokens (log scale; a tie goes to the larger count), or
        None when the shape has none."""
        by_tokens = self.entries.get(key)
        if not by_tokens:
            return None
        target = math.log2(max(num_tokens, 1))
        return by_tokens[min(by_tokens, key=lambda t: (abs(math.log2(t) - target), -t))]

    def __len__(self) -> int:
        return sum(len(v) for v in self.entries.values())

    @classmethod
    def from_json(cls, data: dict, source: str) -> ConfigTable:
        entries = data.get("entries") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise ValueError(f"{source}: expected a JSON object with a list \"entries\", got {type(data).__name__}")
        table = cls(source=source, tuned=bool(data.get("tuned", False)))
        for i, entry in enumerate(entries):
            missing = [name for name in _ENTRY_FIELDS if name not in entry]
            if missing:
                raise ValueError(f"{source}: entry {i} lacks {', '.join(missing)}; expected the fields {', '.join(_ENTRY_FIELDS)}")
            key = (str(entry["dtype"]), int(entry["E"]), int(entry["N"]), int(entry["K"]))
            config = Config(int(entry["block_m"]), _launch(entry["gate_up"], source, i), _launch(entry["down"], source, i))
            if config.block_m not in BLOCK_MS or int(entry["tokens"]) < 1:
                raise ValueError(f"{source}: entry {i}: expected block_m in {list(BLOCK_MS)} and tokens >= 1, "
                                 f"got block_m {config.block_m}, tokens {entry['tokens']}")
            table.entries.setdefault(key, {})[int(entry["tokens"])] = config
        return table


def _launch(fields: dict, source: str, i: int) -> Launch:
    missing = [name for name in _LAUNCH_FIELDS if name not in fields]
    if missing:
        raise ValueError(f"{source}: entry {i}: a launch lacks {', '.join(missing)}; expected {', '.join(_LAUNCH_FIELDS)}")
    launch = Launch(**{name: int(fields[name]) for name in _LAUNCH_FIELDS})
    pow2 = all(v > 0 and v & (v - 1) == 0 for v in (launch.block_n, launch.block_k, launch.num_warps))
    if not pow2 or launch.block_n < 16 or launch.block_k < 16 or launch.group_m < 1 or launch.num_stages < 1:
        raise ValueError(f"{source}: entry {i}: expected block_n and block_k powers of two >= 16, num_warps a power "
                         f"of two, group_m and num_stages >= 1, got {fields}")
    return launch


def entry(key: ShapeKey, num_tokens: int, config: Config, us: float | None = None) -> dict:
    """One JSON entry of the table (the inverse of from_json's parsing)."""
    dtype, num_experts, n, k = key
    return {"dtype": dtype, "E": num_experts, "N": n, "K": k, "tokens": num_tokens, "block_m": config.block_m,
            "gate_up": asdict(config.gate_up), "down": asdict(config.down), "us": us}


def device_file_name(device_name: str) -> str:
    """configs/ file name of a device, from torch.cuda.get_device_name()."""
    return device_name.strip().replace(" ", "_") + ".json"


def load_table(path: str | Path) -> ConfigTable:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"triton-moe.configs: {path} does not exist; expected a JSON file written by "
                         "python -m backplane.plugins.moe_triton.tune") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"triton-moe.configs: {path} is not JSON ({exc})") from None
    return ConfigTable.from_json(data, str(path))


def table_for(device: torch.device, configured: str | None) -> ConfigTable:
    """The configured file, else the bundled file of this GPU, else an empty table."""
    if configured:
        return load_table(configured)
    if device.type != "cuda":
        return ConfigTable()
    bundled = CONFIG_DIR / device_file_name(torch.cuda.get_device_name(device))
    return load_table(bundled) if bundled.exists() else ConfigTable()
