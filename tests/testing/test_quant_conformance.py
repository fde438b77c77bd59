"""quant_fp8 passes backplane.testing's quantization conformance suite on CPU (fp32 and bf16: the
standard FP8 formats on every layer shape, two tensor-parallel ranks without torch.distributed,
online quantization, selection), and deliberately broken methods fail it with one clear line."""

from __future__ import annotations

import pytest
import torch

from backplane import QuantMethodSpec
from backplane.contracts import ShardLayout, new_parameter
from backplane.plugins.quant_fp8.config import Fp8Config, make_config
from backplane.plugins.quant_fp8.method import Fp8LinearMethod
from backplane.plugins.quant_fp8.reference import dequantized_input
from backplane.testing import quant_conformance as qc

test_quant_fp8 = qc.make_suite("fp8", formats=qc.FP8_FORMATS)

CHANNEL = qc.FP8_FORMATS[0]
FAMILIES = {f.name: f for f in qc.families((1, 1))}


class IgnoresChannelScale(Fp8LinearMethod):
    """Multiplies by the largest per-channel scale instead of each row's own."""

    def apply(self, layer, x, bias):
        x2 = x.reshape(-1, x.shape[-1])
        w = layer.weight.float() * layer.weight_scale.float().max()
        y = dequantized_input(self.scheme, x2, None) @ w.t()
        return (y if bias is None else y + bias.float()).to(x.dtype)


class UnshardedChannelScale(Fp8LinearMethod):
    """Keeps the full per-channel scale on every rank (a layout without output_dim) and reads its
    first rows: right on one rank, wrong on every rank but the first."""

    def create_weights(self, layer, partition):
        super().create_weights(layer, partition)
        layer.weight_scale = new_parameter(torch.ones(partition.output_size, 1), ShardLayout(output_dim=None))

    def apply(self, layer, x, bias):
        n = layer.weight.shape[0]
        x2 = x.reshape(-1, x.shape[-1])
        w = layer.weight.float() * layer.weight_scale.float()[:n]
        y = dequantized_input(self.scheme, x2, None) @ w.t()
        return (y if bias is None else y + bias.float()).to(x.dtype)


class ExtraParameter(Fp8LinearMethod):
    def create_weights(self, layer, partition):
        super().create_weights(layer, partition)
        layer.register_parameter("weight_zero_point", new_parameter(torch.zeros(1), ShardLayout(output_dim=None)))


def broken_spec(method_class, **kw) -> QuantMethodSpec:
    class Config(Fp8Config):
        def method_for(self, layer, prefix):
            return method_class(self.scheme, prefix)

    def factory(ctx):
        return Config(make_config(ctx).scheme)

    defaults = dict(checkpoint_formats=("compressed-tensors",), supports_tp=True)
    return QuantMethodSpec(name=f"broken_{method_class.__name__.lower()}", factory=factory, description="broken",
                           **{**defaults, **kw})


def test_a_method_ignoring_the_per_channel_scale_fails_with_where_and_how_much():
    spec = broken_spec(IgnoresChannelScale)
    with pytest.raises(AssertionError, match=r"^broken_ignoreschannelscale fp8-channel gate-up float32 tokens=1: max "
                                             r"\|error\| \S+ at token 0, column \d+ \(reference \S+, got \S+\) exceeds "
                                             r"\S+ = 0.001 x max \|reference\| \S+$") as err:
        qc.check_load(spec, CHANNEL, FAMILIES["gate-up"], torch.float32)
    assert "\n" not in str(err.value)


def test_a_method_sharding_its_scale_wrongly_fails_on_the_second_rank_only():
    spec = broken_spec(UnshardedChannelScale)
    family = FAMILIES["odd-column-tp"]
    qc.check_load(spec, CHANNEL, family, torch.float32)  # one rank: right
    with pytest.raises(AssertionError, match=r"^broken_unshardedchannelscale fp8-channel odd-column-tp float32 tp=2 "
                                             r"tokens=1 rank 1 part 0 against the one-rank layer's columns 19:38: "
                                             r"max \|error\|") as err:
        qc.check_tp(spec, CHANNEL, family, torch.float32)
    assert "\n" not in str(err.value)


def test_a_parameter_the_checkpoint_lacks_is_named():
    with pytest.raises(AssertionError, match=r"^broken_extraparameter fp8-channel down float32: create_weights "
                                             r"registered weight_zero_point, which the checkpoint does not have"):
        qc.check_load(broken_spec(ExtraParameter), CHANNEL, FAMILIES["down"], torch.float32)


def test_selection_checks_declared_formats_and_online():
    good = broken_spec(Fp8LinearMethod, supports_online=True)  # quant_fp8's own method under another name
    qc.check_selection(good)
    lying = broken_spec(Fp8LinearMethod, supports_online=False, checkpoint_formats=())
    with pytest.raises(AssertionError, match=r"declares no checkpoint_formats and not supports_online"):
        qc.check_selection(lying)
    # not declaring a format: the suite skips that format's cases with the reason
    reason = qc.applicable(good, qc.Case("load", qc.FP8_FORMATS[2], FAMILIES["down"]), "cpu", torch.float32)
    assert reason == "format fp8-block-16x16: quant_method 'fp8' not declared"
