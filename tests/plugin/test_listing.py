"""`backplane plugins [--json]`: every backend with its plugin, usability and declared capabilities."""

from __future__ import annotations

import json

from backplane.cli import main


def _backends(capsys, kind="attention_backends"):
    assert main(["plugins", "--json"]) == 0
    return {(b["name"], b["plugin"]): b for b in json.loads(capsys.readouterr().out)[kind]}


def test_json_lists_declared_capabilities(no_bad_plugins, capsys):
    backends = _backends(capsys)
    flashinfer = backends[("flashinfer", "attention_flashinfer")]
    assert flashinfer["dtypes"] == ["float16", "bfloat16"]
    assert flashinfer["head_dims"] == [64, 128, 256]
    assert flashinfer["custom_mask"] is flashinfer["sliding_window"] is flashinfer["logit_softcap"] is True
    from backplane.plugins.attention_flashinfer import INSTALL_HINT

    assert flashinfer["install"] == INSTALL_HINT and INSTALL_HINT
    native = backends[("torch_native", "attention.builtin")]
    assert native["dtypes"] == ["float32", "float16", "bfloat16"] and native["head_dims"] == "any"
    assert native["install"] is None and native["graph_modes"] == []
    assert native["modes"] == ["extend", "decode", "target_verify", "draft_extend"]
    lora = _backends(capsys, "lora_backends")[("triton", "lora_triton")]
    assert {"dtypes", "max_rank", "supports_graph", "graph_modes", "install"} <= set(lora)


def test_text_listing_shows_capabilities_and_install_hint(no_bad_plugins, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    row = next(i for i, line in enumerate(lines) if line.strip().startswith("flashinfer "))
    assert "unusable" in lines[row]
    assert lines[row + 1].split() == ["dtypes", "float16,bfloat16;", "modes", "extend,decode,target_verify,draft_extend;",
                                      "graphs", "extend,decode,target_verify,draft_extend;", "head", "dims", "64,128,256;",
                                      "custom", "mask", "yes;", "sliding", "window", "yes;", "soft-cap", "yes"]
    native = next(i for i, line in enumerate(lines) if line.strip().startswith("torch_native "))
    assert "custom mask yes" in lines[native + 1]
    assert "graphs - (piecewise extend)" in lines[native + 1]


def test_shared_name_is_listed_once_per_plugin_with_its_pin(monkeypatch, capsys):
    import types

    from backplane import AttentionBackendSpec, hookimpl
    from backplane.plugin.listing import describe_plugins, format_plugins
    from backplane.plugin.manager import load_plugins

    monkeypatch.setenv("BACKPLANE_PLUGINS", "")
    twin = types.SimpleNamespace(__name__="shadow")
    twin.backplane_register_attention_backends = hookimpl(lambda register: register(
        AttentionBackendSpec(name="torch_native", factory=object, description="a second torch_native")))
    report = describe_plugins(load_plugins(extra=[twin]))
    rows = [b for b in report["attention_backends"] if b["name"] == "torch_native"]
    assert [(b["plugin"], b["select_as"], b["shared_with"]) for b in rows] == [
        ("attention.builtin", "torch_native@attention.builtin", ["shadow"]),
        ("shadow", "torch_native@shadow", ["attention.builtin"])]
    assert "select it as torch_native@shadow" in format_plugins(report)


def test_moe_backends_are_listed_with_their_limits(capsys, monkeypatch):
    import torch

    monkeypatch.setenv("BACKPLANE_PLUGINS", "moe_triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    backends = _backends(capsys, "moe_backends")
    native = backends[("torch_native", "moe.builtin")]
    assert native["usable"] and native["supports_graph"] is False and native["quant_methods"] == ["fp8"]
    assert native["max_top_k"] == native["max_experts"] == "any"
    assert backends[("triton", "moe_triton")]["supports_graph"] is True
    assert main(["plugins"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith("MoE backends:")) + 1
    assert lines[row].split()[:2] == ["torch_native", "prio"] and "plugin moe.builtin" in lines[row]
    assert lines[row + 1].split() == ["dtypes", "float32,float16,bfloat16;", "max", "top-k", "any;", "max", "experts",
                                      "any;", "graphs", "no;", "compile", "yes;", "quantized", "fp8"]
