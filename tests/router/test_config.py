"""One declaration per router setting (router/config.py): the command line, the config built in
code and the router's parts agree on every default because only the config declares one."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest

import pdd_sglang.router
from pdd_sglang.policy import PolicyConfig
from pdd_sglang.router.config import (LinkParams, PrefillEndpoint, RouterConfig, build_parser,
                                      declared_settings, parse_args)

SERVERS = ["--prefill", "http://p", "--main", "http://m"]
SETTINGS = list(declared_settings())
# A setting's field name, and the flag's where its unit differs (wan_gbps, ttft_slo_ms, ...).
SETTING_NAMES = {s.path[-1] for s in SETTINGS} | {
    s.option.lstrip("-").replace("-", "_") for s in SETTINGS}
# Parameters named like a setting that are something else, and why.
NOT_THE_SETTING = {
    "placement.Placer.place(ttft_slo_s)": "a request's own budget; None: the config's",
    "request_parsing.GenerateJob.__init__(ttft_slo_s)": "a request's own budget, from its body",
    "pumps.Pumps.decoder(placement)": "a request's Placement, not the placement model",
    "servers.Upstream.__init__(incremental_streaming_output)": "the server's own SGLang flag, "
                                                                "read from its /server_info",
}


def test_a_bare_command_line_is_the_config_s_own_defaults():
    assert parse_args(SERVERS) == RouterConfig(prefills=(PrefillEndpoint("http://p"),),
                                               mains=("http://m",))


def test_every_setting_of_the_router_has_one_flag_with_help():
    options = [s.option for s in SETTINGS]
    assert len(options) == len(set(options))
    assert all(s.flag.help for s in SETTINGS)
    declared = {s.path for s in SETTINGS}
    for cls, path in ((RouterConfig, ()), (LinkParams, ("link",))):
        for f in dataclasses.fields(cls):
            assert (*path, f.name) in declared or f.name in ("link", "policy"), f.name
    shown = " ".join(build_parser().format_help().split())
    assert "round-trip time, ms (default: 20.0)" in shown and "times; 0: never (default: 1)" in shown


def test_flags_in_their_own_units_set_the_config_in_its_own():
    config = parse_args([*SERVERS, "--wan-gbps", "8", "--wan-rtt-ms", "35",
                         "--ttft-slo-ms", "1200"])
    assert config.link == LinkParams(1e9, 0.035)
    assert config.policy == PolicyConfig(ttft_slo_s=1.2)  # every other knob PolicyConfig's
    defaults = {a.option_strings[0]: a.default for a in build_parser()._actions}
    assert defaults["--wan-gbps"] == 10.0 and defaults["--wan-rtt-ms"] == 20.0


@pytest.mark.parametrize("build, flag", [
    (lambda: RouterConfig(prefills=(), mains=(), retry_max_retries=-1), "--retry-max-retries"),
    (lambda: RouterConfig(prefills=(), mains=(), placement="fastest"), "--placement"),
    (lambda: LinkParams(0.0, 0.02), "--wan-gbps"),
], ids=["retries", "placement", "link"])
def test_a_config_built_in_code_is_held_to_the_flags_ranges(build, flag):
    with pytest.raises(ValueError, match=flag):
        build()


def test_a_policy_knob_out_of_range_is_refused_naming_its_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args([*SERVERS, "--ttft-slo-ms", "0"])
    assert "--ttft-slo-ms: ttft_slo_s must be > 0" in capsys.readouterr().err


def _router_functions():
    """Every function and method defined in pdd_sglang.router, but the settings' own classes."""
    for info in pkgutil.iter_modules(pdd_sglang.router.__path__):
        module = importlib.import_module(f"pdd_sglang.router.{info.name}")
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__ or obj in (RouterConfig,
                                                                               LinkParams):
                continue
            if inspect.isclass(obj):
                yield from ((f"{module.__name__}.{name}.{attr}", member)
                            for attr, member in vars(obj).items() if inspect.isfunction(member))
            elif inspect.isfunction(obj):
                yield f"{module.__name__}.{name}", obj


def test_no_part_of_the_router_keeps_a_default_of_its_own_for_a_setting():
    """A part takes the config (or the value the service reads from it): a default of its own
    is a second declaration, and drifts (Dispatcher's retry_max_retries was 0, the config's 1)."""
    functions = dict(_router_functions())
    assert "pdd_sglang.router.dispatch.Dispatcher.__init__" in functions
    shadows = {f"{where}({p.name})": p.default
               for where, function in functions.items()
               for p in inspect.signature(function).parameters.values()
               if p.name in SETTING_NAMES and p.default is not inspect.Parameter.empty}
    assert {k.removeprefix("pdd_sglang.router."): v for k, v in shadows.items()
            if k.removeprefix("pdd_sglang.router.") not in NOT_THE_SETTING} == {}
