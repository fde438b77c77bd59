"""bench/peer.py and bench/decode.py on CPU: the peer is one Llama whether it prefills or decodes,
and a decode run puts the engine beside the peer row by row in a result file named for its machine."""

from __future__ import annotations

import json
import math

import torch

from helpers_bench import CPU
from bench import decode, peer


def test_the_peer_decodes_the_token_its_longer_prefill_chooses():
    from backplane.models.presets import get_preset

    torch.manual_seed(0)
    model = peer.PeerLlama(get_preset("tiny-llama"), 2, 40, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 500, (2, 17))
    with torch.inference_mode():
        whole = model(ids, torch.tensor([0]))
        model(ids[:, :16], torch.tensor([0]))  # the cache holds positions 0..15
        stepped = model(ids[:, 16:], torch.tensor([16]))
    assert whole.shape == (2,) and torch.equal(whole, stepped)


def test_a_decode_run_sets_each_variant_beside_the_peer(tmp_path, capsys):
    rows = decode.main(["--models", "tiny-llama", "--backends", "torch_native", "--batch-sizes", "1", "2", "--steps", "3",
                        "--context", "8", "--no-compile", "--profile", "1", "--out", str(tmp_path), *CPU])
    assert [(r["variant"], r["batch_size"]) for r in rows] == [("overlap", 1), ("overlap", 2), ("no-overlap", 1),
                                                               ("no-overlap", 2)]
    for r in rows:  # NOTE: engine_ms is a difference of two timed runs: on a loaded CPU it may come out near 0
        assert math.isfinite(r["engine_ms"]) and r["peer_ms"] > 0 and r["ratio"] == r["engine_ms"] / r["peer_ms"]
        assert r["replay_ms"] is None and r["step_floor"] == r["engine_ms"] / r["floor_ms"]  # no graphs on CPU
    for profile in (rows[0]["profile"], rows[2]["profile"]):  # every variant's, at bs 1 only
        # on CPU no device kernel: the whole step is host time
        assert profile["kernel_ms"] == profile["launches"] == 0 and profile["host_or_gap_ms"] == profile["wall_ms"]
        assert math.isfinite(profile["wall_ms"])
    assert "profile" not in rows[1] and "profile" not in rows[3]
    (path,) = tmp_path.glob("decode-tiny-llama-cpu-*.json")
    doc = json.loads(path.read_text())
    assert doc["meta"]["card"] == "cpu" and len(doc["rows"]) == 4 and set(doc["captures"]["torch_native"]) == {"overlap", "no-overlap"}
    assert "engine/peer" in capsys.readouterr().out


def test_result_files_of_other_variants_carry_them_in_their_name():
    """bench.run's quant-decode runs the bench twice in one folder (FP8 weights, then FP8 KV): at
    cf1fa80 the second run's file replaced the first's."""
    default = decode.result_subject(decode.parse_args([]), "llama-3.1-8b")
    weights = decode.result_subject(decode.parse_args(["--variants", "overlap", "fp8", "fp8-block"]), "llama-3.1-8b")
    kv = decode.result_subject(decode.parse_args(["--variants", "overlap", "fp8-kv"]), "llama-3.1-8b")
    assert default == "llama-3.1-8b" and weights == "llama-3.1-8b-overlap-fp8-fp8-block" and kv == "llama-3.1-8b-overlap-fp8-kv"
