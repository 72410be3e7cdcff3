"""ServeOptions: the HTTP server's settings (`pagedserve serve`'s flags besides the engine's), documented once;
the flags are generated from these fields. No FastAPI here, so the command line builds without it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import ClassVar

from pagedserve.engine.arg_utils import FlagArgs, RequestLimits, setting
from pagedserve.entrypoints.openai.reasoning import PARSERS as REASONING_PARSERS
from pagedserve.entrypoints.openai.tool_calls import PARSERS


CONTENT_FORMATS = ("auto", "string", "openai")


@dataclass
class ServeOptions(FlagArgs):
    group_titles: ClassVar[dict[str, str]] = {"tools": "tool calling", "chat": "chat template",
                                              "http": "HTTP: TLS, CORS, headers"}

    host: str = setting("Address to bind (0.0.0.0 exposes the server).", default="127.0.0.1")
    port: int = setting("Port to listen on.", default=8000)
    uds: str | None = setting("Listen on this Unix domain socket instead of TCP; --host and --port are then "
                              "ignored (vLLM's --uds).")
    api_key: str | list[str] | None = setting("Require 'Authorization: Bearer KEY'; several keys: any of them "
                                              "(default: $PAGEDSERVE_API_KEY, else $VLLM_API_KEY).", nargs="+")
    max_request_body_bytes: int = setting("Larger request bodies get HTTP 413.", default=8 << 20)
    shutdown_grace_s: float = setting("On SIGTERM/SIGINT, seconds in-flight requests get to finish.", default=30.0)
    request_head_timeout_s: float = setting(
        "Seconds a connection has to send a request's line and headers, from its start or from its last response; "
        "then it is closed, as nginx's client_header_timeout does (a stalled or trickling client, e.g. a slowloris "
        "attack, held its connection for ever). 0: no limit.", default=60.0, group="http")
    request_body_timeout_s: float = setting(
        "Seconds a request's body may go without a byte arriving; a body still coming after that long must also "
        "have brought 500 bytes for each further second. Else the request gets a 408 and its connection is "
        "closed, as nginx's client_body_timeout does (a body stopped short of its length, or trickled, held its "
        "connection for ever). A request whose body is in, and its response, are not timed. 0: no limit.",
        default=60.0, group="http")
    uvicorn_log_level: str = setting("uvicorn's log level (default: warning; vLLM's is info); at info and below "
                                  "it also writes the access log, a line per request.", default="warning",
                                  choices=("critical", "error", "warning", "info", "debug", "trace"))
    disable_uvicorn_access_log: bool = setting("No access log, whatever --uvicorn-log-level.", default=False)
    disable_access_log_for_endpoints: str | None = setting("Paths the access log leaves out, comma-separated "
                                                        "(e.g. /health,/metrics).")
    root_path: str = setting("The path prefix a reverse proxy serves this server under (e.g. /llm); API and web "
                          "page then work at that prefix.", default="")
    disable_web_ui: bool = setting("Do not serve the chat and dashboard page at / (then / is a 404).", default=False)
    enable_auto_tool_choice: bool = setting('Let tool_choice "auto" (the default with tools) parse the calls the '
                                         "model writes; needs --tool-call-parser.", default=False, group="tools")
    tool_call_parser: str | None = setting("How the model writes tool calls: hermes (<tool_call>{json}</tool_call>: "
                                        "Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.x JSON calls), mistral "
                                        "([TOOL_CALLS]), granite (<|tool_call|>[...]: Granite 3.x), "
                                        "phi4_mini_json (functools[...]: Phi-4-mini) or pythonic ([f(x=1)]: "
                                        "Llama 3.2 pythonic, Llama 4).", group="tools")
    reasoning_parser: str | None = setting(
        "Read a thinking model's <think>...</think> block out of its replies into their `reasoning` field (and "
        "`reasoning_content`), leaving the rest as content: qwen3 (Qwen3, Qwen3.5, QwQ) or deepseek_r1 (DeepSeek-R1 "
        "and its distills).", choices=REASONING_PARSERS, group="chat")
    chat_template: str | None = setting("The chat template to use instead of the model's: a file's path, or the "
                                        "template itself (vLLM's rule: a value that holds '{' or a line break is a "
                                        "template).", group="chat")
    chat_template_content_format: str = setting(
        "How a message's content reaches the template: string (text parts joined), openai (a list of "
        "{type: text, text} parts, for templates that loop over parts), or auto (openai for a template that loops "
        "over a message's content, as vLLM detects it; else string).", default="auto", choices=CONTENT_FORMATS,
        group="chat")
    response_role: str = setting("The role of the replies /v1/chat/completions returns.", default="assistant",
                                 group="chat")
    default_chat_template_kwargs: str | None = setting(
        "chat_template_kwargs every chat request gets, a JSON object (e.g. '{\"enable_thinking\": false}' for "
        "Qwen3); a request's own chat_template_kwargs win.", group="chat")
    trust_request_chat_template: bool = setting("Render a request's own chat_template (vLLM's; off: such a request "
                                                "gets a 400, as a template is code the server runs).", default=False,
                                                group="chat")
    exclude_tools_when_tool_choice_none: bool = setting('With tool_choice "none", leave the tools out of the '
                                                        "prompt too (default: the template still shows them).",
                                                        default=False, group="tools")
    ssl_keyfile: str | None = setting("TLS: the private key file (with --ssl-certfile: serve https).", group="http")
    ssl_certfile: str | None = setting("TLS: the certificate file.", group="http")
    ssl_ca_certs: str | None = setting("TLS: CA certificates to verify clients with (and --ssl-cert-reqs 2).",
                                       group="http")
    ssl_ciphers: str | None = setting("TLS: the ciphers to allow, in OpenSSL's format (default: uvicorn's).",
                                      group="http")
    ssl_cert_reqs: int = setting("TLS: whether clients must show a certificate (Python's ssl.CERT_*: 0 none, "
                                 "1 optional, 2 required).", default=0, group="http")
    allowed_origins: str | None = setting(
        'CORS: the origins whose web pages may call this server, a JSON list (\'["https://app.example"]\' or '
        '\'["*"]\'). Default: none, so only pages this server serves can (vLLM allows every origin; a server on '
        "127.0.0.1 would then answer any web page the user opens).", group="http")
    allowed_hosts: str | None = setting(
        "Host header values a server on a loopback --host answers, a JSON list ('[\"api.example\"]', '[\"*\"]': "
        "any). Default: localhost, 127.0.0.1 and [::1], so a web page on another name that resolves to 127.0.0.1 "
        "(DNS rebinding) cannot read it; a reverse proxy on this host sends one of them (nginx: proxy_set_header "
        "Host localhost) or is named here.", group="http")
    allowed_methods: str = setting("CORS: allowed methods, a JSON list.", default='["*"]', group="http")
    allowed_headers: str = setting("CORS: allowed request headers, a JSON list.", default='["*"]', group="http")
    allow_credentials: bool = setting("CORS: allow credentials (cookies, Authorization).", default=False,
                                      group="http")
    enable_request_id_headers: bool = setting("Answer every request with an X-Request-Id header (the client's, "
                                              "or a new one).", default=False, group="http")
    disable_fastapi_docs: bool = setting("Do not serve the API's OpenAPI schema and docs pages (/openapi.json, "
                                         "/docs, /redoc).", default=False, group="http")
    return_tokens_as_token_ids: bool = setting("Logprobs give each token as \"token_id:N\" instead of its text "
                                               "(a request's return_tokens_as_token_ids overrides it).",
                                               default=False)
    enable_force_include_usage: bool = setting("End every streamed response with its usage, as "
                                               "stream_options.include_usage asks.", default=False)
    enable_prompt_tokens_details: bool = setting("Give usage.prompt_tokens_details.cached_tokens: the prompt tokens "
                                                 "the prefix cache served (where there were any).", default=False)
    enable_log_requests: bool = setting("Log each request as it arrives: its id, prompt, token ids and sampling "
                                        "parameters (vLLM's; off by default: prompts can be private).",
                                        default=False)
    enable_log_outputs: bool = setting("Log each completion's text and token count when it finishes (vLLM's; off "
                                       "by default: outputs can be private).", default=False)
    max_log_len: int | None = setting("With --enable-log-requests: at most this many prompt characters and token "
                                      "ids per line (default: all).")
    disable_log_stats: bool = setting("Do not log the stats line (throughput, running and waiting requests, KV "
                                      "cache use) every 10 s while there is work ($PAGEDSERVE_LOG_STATS_INTERVAL "
                                      "or vLLM's $VLLM_LOG_STATS_INTERVAL: another period).", default=False)
    startup_hold_file: str | None = setting("Testing only: start-up waits in phase starting while this file exists "
                                         "(the web page's start-up view).", hidden=True)
    limits: RequestLimits = setting("Per-request limits (their own flags).", default_factory=RequestLimits,
                                 flag=False)

    @property
    def enable_web_ui(self) -> bool:
        return not self.disable_web_ui

    @property
    def listen_address(self) -> str:
        """Where the server listens, for the log: unix:PATH or a URL."""
        if self.uds:
            return f"unix:{self.uds}"
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 address, as URLs write it
        return f"{'https' if self.ssl_keyfile else 'http'}://{host}:{self.port}{self.root_path}"

    @property
    def active_tool_call_parser(self) -> str | None:
        """The parser "auto" tool choice uses: --tool-call-parser where --enable-auto-tool-choice is given."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def check(self) -> None:
        """ValueError naming the flag for a value the server cannot use."""
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser} is not supported: {', '.join(PARSERS)} "
                             "(hermes: Qwen2.5, Qwen3, Hermes; llama3_json: Llama 3.x; mistral: Mistral; granite: "
                             "Granite 3.x; phi4_mini_json: Phi-4-mini; pythonic: Llama 3.2/4); without a parser, "
                             "tool_choice \"required\" or a named function still calls tools with any model (a "
                             "grammar writes the call)")
        if self.uds is not None:
            check_socket_path(self.uds)
        if self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"--root-path must start with '/', got {self.root_path!r}")
        if self.chat_template is not None:
            from pagedserve.chat_template import load_chat_template  # jinja2: not for every command's --help

            load_chat_template(self.chat_template)
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both to serve https")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-certfile", self.ssl_certfile),
                           ("--ssl-ca-certs", self.ssl_ca_certs)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag} {path!r}: " + ("a directory, not a file" if os.path.isdir(path) else
                                                         "no such file"))
        if self.ssl_certfile is not None:
            check_tls_files(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs)
        keys = [self.api_key] if isinstance(self.api_key, str) else self.api_key or []
        if any(not key for key in keys):
            raise ValueError("--api-key is empty (an unset variable, as in --api-key \"$KEY\"?): every request would "
                             "be refused; give the key, or leave the flag out to serve without one")
        if not 0 <= self.shutdown_grace_s < float("inf"):  # nan too
            raise ValueError(f"--shutdown-grace-s must be a number of seconds >= 0, got {self.shutdown_grace_s}")
        if not 0 <= self.request_head_timeout_s < float("inf"):
            raise ValueError("--request-head-timeout-s must be a number of seconds >= 0 (0: no limit), got "
                             f"{self.request_head_timeout_s}")
        if not 0 <= self.request_body_timeout_s < float("inf"):
            raise ValueError("--request-body-timeout-s must be a number of seconds >= 0 (0: no limit), got "
                             f"{self.request_body_timeout_s}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_log_len}")
        if self.ssl_cert_reqs not in (0, 1, 2):
            raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, got {self.ssl_cert_reqs}")
        self.cors()
        self.host_names()
        self.template_kwargs()
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser NAME ({', '.join(PARSERS)}): the "
                             "format in which this model writes its tool calls")
        self.limits.check()

    def template_kwargs(self) -> dict:
        """--default-chat-template-kwargs as a dict (ValueError naming the flag)."""
        if self.default_chat_template_kwargs is None:
            return {}
        from pagedserve.config import json_object

        from pagedserve.entrypoints.openai.chat_format import RESERVED_TEMPLATE_KWARGS

        kwargs = json_object(self.default_chat_template_kwargs, "--default-chat-template-kwargs",
                             "'{\"enable_thinking\": false}'")
        reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
        if reserved:
            raise ValueError(f"--default-chat-template-kwargs may not set {', '.join(reserved)} (the server sets "
                             "them per request)")
        return kwargs

    @property
    def on_loopback(self) -> bool:
        """Whether --host is a loopback address (only this machine reaches it; a Unix socket is not one)."""
        return not self.uds and (self.host in ("localhost", "::1") or self.host.startswith("127."))

    def host_names(self) -> frozenset[str] | None:
        """The Host names (without port) a server on a loopback --host answers; None: any (another --host, or
        --allowed-hosts '["*"]'); ValueError naming a bad flag."""
        names = {"localhost", "127.0.0.1", "::1"}
        if self.allowed_hosts is not None:
            try:
                value = json.loads(self.allowed_hosts)
            except ValueError:
                value = None
            if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
                raise ValueError(f"--allowed-hosts must be a JSON list of host names, e.g. '[\"api.example\"]', got "
                                 f"{self.allowed_hosts!r}")
            if "*" in value:
                return None
            names |= {item.strip("[]").lower() for item in value}
        if not self.on_loopback:
            return None  # reachable from elsewhere: the API key (or the network) is what guards it
        return frozenset(names | {self.host.lower()})  # the address it listens on (127.0.0.2) is its own name

    def cors(self) -> dict | None:
        """CORSMiddleware's settings from the --allowed-* flags (None: no CORS); ValueError naming a bad flag."""
        if self.allowed_origins is None:
            return None
        lists = {}
        for flag, text in (("allowed-origins", self.allowed_origins), ("allowed-methods", self.allowed_methods),
                           ("allowed-headers", self.allowed_headers)):
            try:
                value = json.loads(text)
            except ValueError:
                value = None
            if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
                raise ValueError(f"--{flag} must be a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
            lists[flag.replace("-", "_")] = value
        if self.allow_credentials and "*" in lists["allowed_origins"]:
            raise ValueError("--allow-credentials with --allowed-origins '[\"*\"]' would let every web page use a "
                             "signed-in user's credentials: name the origins")
        return {"allow_origins": lists["allowed_origins"], "allow_methods": lists["allowed_methods"],
                "allow_headers": lists["allowed_headers"], "allow_credentials": self.allow_credentials}

    def uvicorn_tls(self) -> dict:
        """uvicorn.Config's TLS settings (empty without --ssl-keyfile)."""
        if self.ssl_keyfile is None:
            return {}
        return {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile, "ssl_ca_certs": self.ssl_ca_certs,
                "ssl_cert_reqs": self.ssl_cert_reqs, **({"ssl_ciphers": self.ssl_ciphers} if self.ssl_ciphers else {})}


def check_socket_path(path: str) -> None:
    """ValueError naming --uds for a path the server cannot listen on. A socket another process answers on is
    refused: binding would silently take the path over (asyncio removes an existing socket file first)."""
    import socket
    import stat

    if len(os.fsencode(path)) > 107:
        raise ValueError(f"--uds path is {len(os.fsencode(path))} bytes long; a Unix socket path must be at most "
                         "107: use a shorter path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--uds {path!r}: folder {folder!r} does not exist")
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise ValueError(f"--uds {path!r} exists and is not a socket: choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return  # a stale socket file left by a server that stopped: listening replaces it
    finally:
        probe.close()
    raise ValueError(f"--uds {path!r}: another server is listening on this socket; stop it or choose another path")


def check_tls_files(certfile: str, keyfile: str, ca_certs: str | None) -> None:
    """ValueError naming the flags where the certificate and key do not load as the server will load them (uvicorn
    failed with an SSL traceback after the model had loaded)."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile)
    except (ssl.SSLError, OSError) as exc:
        raise ValueError(f"--ssl-certfile {certfile} with --ssl-keyfile {keyfile} do not load ({exc}): give a PEM "
                         "certificate and the PEM private key that belongs to it") from None
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"--ssl-ca-certs {ca_certs} does not load ({exc}): give PEM CA certificates") from None
