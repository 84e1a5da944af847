"""Router settings and the command line: servers by role, link parameters, policy knobs, timeouts.

One declaration per setting: a field of :class:`RouterConfig` (or of :class:`LinkParams`) holds
the setting's default, and its metadata (:func:`setting`) the flag, help and range, from which
:func:`build_parser` builds the command line and ``__post_init__`` checks the range (a config
built in code is checked as one parsed from flags). The policy knobs the router exposes keep their
defaults and ranges in :class:`~pdd_sglang.policy.PolicyConfig` (the policy module, shared with
the relay and the simulator, knows no command line); their flags are declared on
``RouterConfig.policy`` (:data:`POLICY_FLAGS`). The router's parts take this config, never a default of their own
(``tests/router/test_config.py`` fails on one). Owner: this module; a config is frozen once built.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

from pdd_sglang.policy import PolicyConfig

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's default --disaggregation-bootstrap-port
PLACEMENTS = ("congestion-aware", "idle-line")
_FLAG = "pdd_flag"  # field metadata: the setting's Flag
_SUB_FLAGS = "pdd_sub_flags"  # metadata of a field holding another module's settings: name -> Flag


@dataclass(frozen=True)
class Unit:
    """A flag's unit where it differs from the setting's (milliseconds for seconds, ...)."""

    to_setting: Callable[[float], float]
    from_setting: Callable[[float], float]


MILLISECONDS = Unit(lambda ms: ms / 1e3, lambda s: s * 1e3)
GBIT_PER_S = Unit(lambda gbps: gbps * 1e9 / 8, lambda bytes_per_s: bytes_per_s * 8 / 1e9)


@dataclass(frozen=True)
class Flag:
    """How one setting is given on the command line; its default is the field's."""

    help: str
    name: Optional[str] = None  # default: the field's name, dashed
    unit: Optional[Unit] = None
    # The setting's range: refused below ``at_least``, at or below ``above`` (None, where a
    # setting allows it, always passes). Bounds are 0 or 1, the same in the flag's unit.
    at_least: Optional[float] = None
    above: Optional[float] = None
    choices: Optional[tuple] = None
    # A list of servers: argparse's "URL [PORT] ..." groups -> the setting's tuple.
    servers_from: Optional[Callable[[list], tuple]] = None
    metavar: Optional[str] = None


    def option(self, field_name: str) -> str:
        return self.name or "--" + field_name.replace("_", "-")


def setting(default: Any = dataclasses.MISSING, help: str = "", **flag: Any) -> Any:
    """A settings field: its default, and how the command line sets it (:class:`Flag`)."""
    return field(default=default, metadata={_FLAG: Flag(help, **flag)})


def _check_ranges(settings: Any) -> None:
    """ValueError, naming the flag, for a field of ``settings`` outside its declared range."""
    for f in dataclasses.fields(settings):
        flag, value = f.metadata.get(_FLAG), getattr(settings, f.name)
        if flag is None or value is None or isinstance(value, (bool, tuple)):
            continue
        if flag.choices is not None and value not in flag.choices:
            raise ValueError(f"{flag.option(f.name)} must be one of {', '.join(flag.choices)}, "
                             f"got {value!r}")
        if flag.above is not None and not value > flag.above:
            raise ValueError(f"{flag.option(f.name)} must be > {flag.above:g} ({f.name} "
                             f"{value!r})")
        if flag.at_least is not None and not value >= flag.at_least:
            raise ValueError(f"{flag.option(f.name)} must be >= {flag.at_least:g} ({f.name} "
                             f"{value!r})")


def _server_urls(values: list) -> tuple:
    """``--relay URL ... --relay URL``: every URL, without a trailing slash."""
    return tuple(v.rstrip("/") for group in values for v in group)


@dataclass(frozen=True)
class PrefillEndpoint:
    url: str
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT


def _prefills(values: list) -> tuple[PrefillEndpoint, ...]:
    """``--prefill URL [PORT] URL [PORT] ...`` as SGLang's router takes it."""
    values = [v for group in values for v in group]
    endpoints, index = [], 0
    while index < len(values):
        url = values[index]
        if not url.startswith(("http://", "https://")):
            raise argparse.ArgumentTypeError(f"--prefill expects a URL first, got {url!r}")
        port = DEFAULT_BOOTSTRAP_PORT
        if index + 1 < len(values) and values[index + 1].isdigit():
            port = int(values[index + 1])
            index += 1
        endpoints.append(PrefillEndpoint(url.rstrip("/"), port))
        index += 1
    return tuple(endpoints)


@dataclass(frozen=True)
class LinkParams:
    """What the placement predicts WAN time from (policy.predict_wan_seconds). The defaults: a
    leased 10 Gbit/s inter-datacenter line with 20 ms RTT (the brief's range is 10-100 Gbit/s and
    milliseconds to tens of milliseconds; the conservative end)."""

    wan_bytes_per_s: float = setting(
        10e9 / 8, "WAN bandwidth available to one request's KV copy, Gbit/s", name="--wan-gbps",
        unit=GBIT_PER_S, above=0)
    rtt_s: float = setting(0.020, "WAN round-trip time, ms", name="--wan-rtt-ms",
                           unit=MILLISECONDS, at_least=0)
    # None: computed from the model's config once it is known (ModelInfo.kv_bytes_per_token).
    kv_bytes_per_token: Optional[float] = setting(
        None, "KV bytes one token costs on the wire (default: 2 x layers x KV heads x head dim x "
        "dtype size, from the model's config; set it for MLA or compressed KV)", above=0)

    def __post_init__(self) -> None:
        _check_ranges(self)


# The PolicyConfig knobs the router's command line sets; their defaults and ranges are
# PolicyConfig's.
POLICY_FLAGS = {
    "hide_wan_below_s": Flag(
        "without a TTFT budget (--ttft-slo-ms): P->MD when main's predicted WAN time is under "
        "this, else P->RLD->MD"),
    "ttft_slo_s": Flag(
        "TTFT budget: P->MD only when the TTFT predicted through main (prefill queue, prefill, "
        "WAN copy) fits it, else P->RLD->MD while a relay has headroom, else P->MD counted over "
        "budget (pdd_router_ttft_budget); a request's own \"ttft_slo_ms\" wins. Unset: "
        "--hide-wan-below-s decides", name="--ttft-slo-ms", unit=MILLISECONDS),
    "prefill_tokens_per_s": Flag(
        "prefill throughput, for the queue and prefill parts of that prediction (unset: only the "
        "WAN copy is predicted)"),
    "relay_full_utilisation": Flag(
        "a relay with this share of its request slots taken by the router has no headroom for "
        "the TTFT budget"),
    "main_load_penalty_tokens": Flag("a fully loaded main is worth this many cached tokens less"),
    "singular_predictive": Flag("send long-uncached, short-output requests to the relay alone"),
    "singular_min_uncached_tokens": Flag(
        "singular traffic: at least this many uncached prompt tokens ..."),
    "singular_max_new_tokens": Flag(
        "... and at most this many output tokens; when the relay answers such a request alone, "
        "main's WAN copy is cancelled too"),
}


@dataclass(frozen=True)
class RouterConfig:
    prefills: tuple[PrefillEndpoint, ...] = setting(
        help=f"prefill server URL, optionally followed by its bootstrap port (default "
        f"{DEFAULT_BOOTSTRAP_PORT}); repeatable", name="--prefill", servers_from=_prefills,
        metavar="URL [PORT]")
    mains: tuple[str, ...] = setting(help="main decode server URL(s); repeatable", name="--main",
                                     servers_from=_server_urls, metavar="URL")
    relays: tuple[str, ...] = setting(
        (), "relay decode server URL(s); repeatable; none: every request is P->MD",
        name="--relay", servers_from=_server_urls, metavar="URL")
    host: str = setting("127.0.0.1", "address the router listens on")
    port: int = setting(30000, "port the router listens on")
    link: LinkParams = field(default_factory=LinkParams)
    policy: PolicyConfig = field(default_factory=PolicyConfig, metadata={_SUB_FLAGS: POLICY_FLAGS})
    # The line's state: router/line_state.py.
    placement: str = setting(
        "congestion-aware", "predict main's WAN time behind the copies already on the line to it, "
        "at the rate measured over recent copies (congestion-aware), or as if the line were idle "
        "(idle-line)", choices=PLACEMENTS)
    tokenizer_path: Optional[str] = setting(None, "tokenizer (default: the servers' own, from "
                                                  "main's /model_info)")
    mirror_max_tokens: Optional[int] = setting(
        None, "tokens per main's prefix mirror (default: main's KV pool size)", above=0)
    health_interval_s: float = setting(5.0, "seconds between health polls of each server",
                                       above=0)
    health_failures_to_remove: int = setting(
        2, "failed polls in a row that take a server out of rotation", at_least=1)
    connect_timeout_s: float = setting(10.0, "seconds to connect to a server", above=0)
    # router/upstream.py: under the servers' own keep-alive by more than an RTT.
    upstream_keepalive_s: float = setting(
        4.0, "seconds an idle connection to a server is kept for the next request (keep it "
        "under the servers' keep-alive, SGLang's SGLANG_TIMEOUT_KEEP_ALIVE: 5 s)", above=0)
    # A silence: a decode step, or the WAN copy before main's first token. The request is then
    # aborted everywhere.
    read_timeout_s: float = setting(
        600.0, "seconds an upstream stream may stay silent before its request fails", above=0)
    startup_timeout_s: float = setting(
        600.0, "seconds to wait at start for the servers to answer", above=0)
    # router/landing.py.
    main_wait_for_landing_s: float = setting(
        20.0, "on P->RLD->MD, send a turn to main only once the WAN copy of the turn it extends "
        "has landed there, waiting at most this long (keep it under the prefill's "
        "--pdd-main-bootstrap-timeout); 0: never wait", at_least=0)
    # 1, as the flag was introduced (3137ccc), the README and docs/design.md have it: a server's
    # death costs a client one longer wait, not an error.
    retry_max_retries: int = setting(
        1, "re-send a request that failed before the client got any token (a server died, a KV "
        "transfer failed), placed afresh, at most this many times; 0: never", at_least=0)
    retry_after_first_token: bool = setting(
        False, "also retry a request that failed after the client got part of its answer, as a "
        "continuation from the last token it got (greedy: the same answer; sampled: a valid "
        "continuation, not the same draw)")
    # router/relay_loss.py. Main that saw the relay go answers within a decode step.
    relay_loss_main_grace_s: float = setting(
        1.0, "after a relay died mid-answer and main's copy of the prompt has landed, how long "
        "main may stay silent before the router aborts its copy and continues the request from "
        "the client's last token on a fresh placement (main that never connected to the relay "
        "would wait for its --pdd-handoff-timeout)", at_least=0)
    incremental_streaming_output: bool = setting(
        False, "stream only new text and ids per /generate chunk (as SGLang's flag)")
    # router/chat_answer.py: SGLang's parsers over the spliced chat answer.
    tool_call_parser: Optional[str] = setting(
        None, "parse chat answers' tool calls into tool_calls, as SGLang's flag (give the "
        "servers' value)")
    reasoning_parser: Optional[str] = setting(
        None, "split chat answers' reasoning into reasoning_content, as SGLang's flag (give the "
        "servers' value)")
    # router/workers.py.
    workers: int = setting(
        1, "router processes serving one port (SO_REUSEPORT); each conversation keeps its main "
        "whichever takes its next turn, the line's bytes are shared", at_least=1)
    log_prefill_stats: bool = setting(
        False, "log each request's prefill time stats (a pdd-prefill-stats JSON line, read by "
        "the demo's stage split)")

    def __post_init__(self) -> None:
        _check_ranges(self)


@dataclass(frozen=True)
class Declared:
    """One setting as the command line sees it: where it lives in the config, its flag."""

    path: tuple[str, ...]  # ("health_interval_s",) or ("link", "rtt_s")
    flag: Flag
    default: Any  # the setting's, in the setting's unit; MISSING: the flag is required
    type: Any

    @property
    def option(self) -> str:
        return self.flag.option(self.path[-1])

    @property
    def dest(self) -> str:
        return ".".join(self.path)

    @property
    def metavar(self) -> Optional[str]:
        if self.flag.metavar is not None or self.flag.choices is not None:
            return self.flag.metavar
        return self.option.lstrip("-").upper().replace("-", "_")


def declared_settings(cls: type = RouterConfig, path: tuple = (),
                      flags: Optional[dict] = None) -> Iterator[Declared]:
    """Every setting the command line sets, in declaration order, with its default and type."""
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    if flags is not None:  # another module's settings: the flags given, in their order
        for name, flag in flags.items():
            yield Declared((*path, name), flag, by_name[name].default, hints[name])
        return
    for f in by_name.values():
        if _FLAG in f.metadata:
            yield Declared((*path, f.name), f.metadata[_FLAG], f.default, hints[f.name])
        elif dataclasses.is_dataclass(hints[f.name]):
            yield from declared_settings(hints[f.name], (*path, f.name), f.metadata.get(_SUB_FLAGS))


def _scalar(hint: Any) -> Any:
    """``Optional[int]`` -> int."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return args[0] if union and len(args) == 1 else hint


def _add_flag(parser: argparse.ArgumentParser, declared: Declared) -> None:
    flag, default = declared.flag, declared.default
    help_text = flag.help.replace("%", "%%")
    if flag.servers_from is not None:
        parser.add_argument(declared.option, dest=declared.dest, nargs="+", action="append",
                            required=default is dataclasses.MISSING, metavar=declared.metavar,
                            default=[], help=help_text)
    elif _scalar(declared.type) is bool:
        assert default is False, f"{declared.option}: a switch is off unless given"
        parser.add_argument(declared.option, dest=declared.dest, action="store_true",
                            default=default, help=help_text)
    else:
        shown = default if default is None or flag.unit is None else flag.unit.from_setting(default)
        if shown is not None:
            help_text += " (default: %(default)s)"
        parser.add_argument(declared.option, dest=declared.dest, type=_scalar(declared.type),
                            default=shown, choices=flag.choices, metavar=declared.metavar,
                            help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pdd_sglang.router",
        description="PDD router: places each request on P->MD or P->RLD->MD and splices streams.")
    for declared in declared_settings():
        _add_flag(parser, declared)
    return parser


def _declaredvalue(declared: Declared, raw: Any) -> Any:
    """The command line's value in the setting's unit (its range is the config's to check)."""
    flag = declared.flag
    if flag.servers_from is not None:
        return flag.servers_from(raw)
    if flag.unit is None or raw is None:
        return raw
    return flag.unit.to_setting(raw)


def _naming_the_flag(err: ValueError) -> ValueError:
    """PolicyConfig names its field in a refusal; the operator gave a flag."""
    for declared in declared_settings():
        if str(err).startswith(declared.path[-1] + " "):
            return ValueError(f"{declared.option}: {err}")
    return err


def config_from(raw: dict) -> RouterConfig:
    """The config from argparse's values (``dest`` -> value), nested settings built whole; a
    setting out of its range raises ValueError naming its flag."""
    values: dict = {}
    for declared in declared_settings():
        *outer, name = declared.path
        values.setdefault(tuple(outer), {})[name] = _declaredvalue(declared, raw[declared.dest])
    top = values.pop((), {})
    hints = typing.get_type_hints(RouterConfig)
    for (name,), nested in values.items():  # LinkParams, PolicyConfig: the rest keep defaults
        try:
            top[name] = hints[name](**nested)
        except ValueError as err:
            raise _naming_the_flag(err) from None
    return RouterConfig(**top)


def parse_args(argv: Optional[Sequence[str]] = None) -> RouterConfig:
    parser = build_parser()
    try:
        return config_from(vars(parser.parse_args(argv)))
    except (ValueError, argparse.ArgumentTypeError) as err:
        parser.error(str(err))
