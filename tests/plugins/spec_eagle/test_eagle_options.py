"""EAGLE's settings group "eagle": the options reach the factory as ctx.options from the CLI, from
Engine(plugin_options=...) and from the environment; the 0.1 speculative_* flags still work with a
DeprecationWarning naming the new flag, and two different values for one option are refused."""

from __future__ import annotations

import warnings

import pytest

from backplane import Engine, EngineArgs
from backplane.cli.main import parse_server_args
from backplane.plugin.manager import load_plugins
from backplane.plugin.runtime import PluginRuntimeError
from backplane.plugins.spec_eagle.options import EagleOptions, resolve_options

CPU = dict(device="cpu", dtype="float32", attention_backend="torch_native", max_total_tokens=1024)


def test_defaults_without_old_flags_warn_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        options, flags = resolve_options(EagleOptions(num_steps=2), EngineArgs())
    assert (options.num_steps, options.topk, options.draft_model) == (2, 1, None)
    assert flags["num_steps"] == "--eagle.num-steps" and flags["token_map"] == "--eagle.token-map"


def test_an_old_flag_is_used_with_a_warning_naming_the_new_one():
    args = EngineArgs(speculative_algorithm="eagle", speculative_num_steps=5, speculative_eagle_topk=2)
    with pytest.warns(DeprecationWarning) as caught:
        options, flags = resolve_options(EagleOptions(), args)
    assert (options.num_steps, options.topk) == (5, 2)
    assert flags["num_steps"] == "--speculative-num-steps"
    messages = sorted(str(w.message) for w in caught)
    assert messages == ["--speculative-eagle-topk is deprecated (until 0.3): use --eagle.topk",
                        "--speculative-num-steps is deprecated (until 0.3): use --eagle.num-steps"]


def test_old_and_new_flag_with_different_values_are_refused_in_one_line():
    args = EngineArgs(speculative_algorithm="eagle", speculative_num_steps=5)
    with pytest.raises(ValueError) as err:
        resolve_options(EagleOptions(num_steps=4), args)
    assert str(err.value) == ("--speculative-num-steps 5 and --eagle.num-steps 4: two values for one option; "
                              "pass only --eagle.num-steps (--speculative-num-steps is deprecated)")
    with pytest.warns(DeprecationWarning):  # the same value twice is one value
        assert resolve_options(EagleOptions(num_steps=5), args)[0].num_steps == 5


def test_the_cli_fills_the_group_and_its_help_lists_the_flags():
    plugin_set = load_plugins()
    args = parse_server_args(["--speculative-algorithm", "eagle", "--eagle.num-steps", "2", "--eagle.topk", "3",
                              "--eagle.draft-model", "head"], plugin_set)
    options = args.options_for("eagle")
    assert isinstance(options, EagleOptions) and (options.num_steps, options.topk, options.draft_model) == (2, 3, "head")
    from backplane.cli.main import build_parser

    help_text = build_parser(plugin_set).format_help() + _generate_help(plugin_set)
    for flag in ("--eagle.draft-model", "--eagle.num-steps", "--eagle.topk", "--eagle.token-map"):
        assert flag in help_text


def _generate_help(plugin_set) -> str:
    from backplane.cli.main import build_parser

    parser = build_parser(plugin_set)
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sub.choices["generate"].format_help()


def test_a_bad_group_value_is_a_one_line_error():
    from backplane.settings import SettingsError

    with pytest.raises(SettingsError, match=r"--eagle.topk \(env BACKPLANE_EAGLE__TOPK\): invalid value '0'"):
        parse_server_args(["--speculative-algorithm", "eagle", "--eagle.topk", "0"], load_plugins())


def _eagle(path, head, **kw):
    return Engine(str(path), speculative_algorithm="eagle", speculative_num_draft_tokens=5, **CPU, **kw)


def test_plugin_options_reach_the_factory(target, random_head):
    engine = _eagle(target[0], random_head, plugin_options={"eagle": {"draft_model": random_head, "num_steps": 2,
                                                                      "topk": 2}})
    worker = engine.spec_worker
    assert isinstance(worker.ctx.options, EagleOptions) and worker.ctx.options.num_steps == 2
    assert (worker.num_steps, worker.topk, worker.window) == (2, 2, 3)


def test_engine_args_built_in_python_get_the_group_from_env(target, random_head, monkeypatch):
    """EngineArgs(...) handed to Engine has no plugin_options: the group's defaults and env vars apply."""
    monkeypatch.setenv("BACKPLANE_EAGLE__DRAFT_MODEL", random_head)
    monkeypatch.setenv("BACKPLANE_EAGLE__TOPK", "2")
    args = EngineArgs(model=str(target[0]), speculative_algorithm="eagle", speculative_num_draft_tokens=5, **CPU)
    assert args.plugin_options == {}
    worker = Engine(server_args=args).spec_worker
    assert (worker.topk, worker.num_steps, worker.options.draft_model) == (2, 3, random_head)


def test_old_flags_still_build_eagle_with_a_deprecation_warning(target, random_head):
    with pytest.warns(DeprecationWarning, match="--speculative-draft-model is deprecated .*use --eagle.draft-model"):
        worker = _eagle(target[0], random_head, speculative_draft_model=random_head, speculative_num_steps=4).spec_worker
    assert worker.num_steps == 4 and worker.options.draft_model == random_head


def test_a_tree_too_small_names_the_flags_given(target, random_head):
    with pytest.raises(PluginRuntimeError, match=r"expected at most 3 \(.* for --eagle.topk 1, --eagle.num-steps 2\)"):
        _eagle(target[0], random_head, plugin_options={"eagle": {"draft_model": random_head, "num_steps": 2}})


def test_conflicting_old_and_new_flags_refuse_to_start(target, random_head):
    with pytest.raises(PluginRuntimeError, match="--speculative-num-steps 4 and --eagle.num-steps 2: two values"):
        _eagle(target[0], random_head, speculative_num_steps=4,
               plugin_options={"eagle": {"draft_model": random_head, "num_steps": 2}})


def test_an_algorithm_without_a_group_gets_no_options():
    engine = Engine("tiny-llama", speculative_algorithm="ngram", **CPU)
    assert engine.spec_worker.ctx.options is None
