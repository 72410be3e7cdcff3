"""ServeOptions: the HTTP server's settings (`pagedserve serve`'s flags besides the engine's), documented once;
the flags are generated from these fields. No FastAPI here, so the command line builds without it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pagedserve.engine.arg_utils import FlagArgs, RequestLimits, setting
from pagedserve.entrypoints.openai.tool_calls import PARSERS


@dataclass
class ServeOptions(FlagArgs):
    group_titles: ClassVar[dict[str, str]] = {"tools": "tool calling"}

    host: str = setting("Address to bind (0.0.0.0 exposes the server).", default="127.0.0.1")
    port: int = setting("Port to listen on.", default=8000)
    api_key: str | None = setting("Require 'Authorization: Bearer KEY' (default: $PAGEDSERVE_API_KEY).")
    max_request_body_bytes: int = setting("Larger request bodies get HTTP 413.", default=8 << 20)
    shutdown_grace_s: float = setting("On SIGTERM/SIGINT, seconds in-flight requests get to finish.", default=30.0)
    uvicorn_log_level: str = setting("uvicorn's log level.", default="warning",
                                  choices=("critical", "error", "warning", "info", "debug", "trace"))
    root_path: str = setting("The path prefix a reverse proxy serves this server under (e.g. /llm); API and web "
                          "page then work at that prefix.", default="")
    disable_web_ui: bool = setting("Do not serve the chat and dashboard page at / (then / is a 404).", default=False)
    enable_auto_tool_choice: bool = setting('Let tool_choice "auto" (the default with tools) parse the calls the '
                                         "model writes; needs --tool-call-parser.", default=False, group="tools")
    tool_call_parser: str | None = setting("How the model writes tool calls: hermes (<tool_call>{json}</tool_call>: "
                                        "Qwen2.5, Qwen3, Hermes) or llama3_json (Llama 3.x JSON calls).",
                                        choices=PARSERS, group="tools")
    startup_hold_file: str | None = setting("Testing only: start-up waits in phase starting while this file exists "
                                         "(the web page's start-up view).", hidden=True)
    limits: RequestLimits = setting("Per-request limits (their own flags).", default_factory=RequestLimits,
                                 flag=False)

    @property
    def enable_web_ui(self) -> bool:
        return not self.disable_web_ui

    @property
    def active_tool_call_parser(self) -> str | None:
        """The parser "auto" tool choice uses: --tool-call-parser where --enable-auto-tool-choice is given."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def check(self) -> None:
        """ValueError naming the flag for a value the server cannot use."""
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"--root-path must start with '/', got {self.root_path!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser NAME ({', '.join(PARSERS)}): the "
                             "format in which this model writes its tool calls")
        self.limits.check()
