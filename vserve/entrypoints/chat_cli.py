"""`vserve chat`: a conversation in the terminal with a model run in this process (the
embedded one by default), as `llama-cli` or `ollama run` give one.

Each line typed is a user message; the reply streams as it is generated and joins the
history, which the chat template renders whole for the next turn (the prefix cache keeps the
history's KV blocks, so a turn prefills only what is new). `/clear` forgets the history
(the system prompt stays), `/exit` or end of input leaves; Ctrl-C stops a reply midway and
keeps what was said. With stdin not a terminal (a pipe) there is no prompt marker: each line
in, one reply out, so scripts can drive it.
"""

from __future__ import annotations

import itertools
import sys
from typing import TextIO

from vserve.outputs import OutputKind
from vserve.sampling_params import SamplingParams

HELP = "/clear: forget the conversation, /exit: leave (or Ctrl-D); Ctrl-C stops a reply"


def add_chat_parser(sub, add_engine_args) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal")
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--max-tokens", type=int, default=512, help="per reply")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    add_engine_args(p)
    p.set_defaults(func=_run)


def _run(args) -> int:
    from vserve import LLM
    from vserve.entrypoints.cli_args import engine_args_from

    engine_args = vars(engine_args_from(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p
    )
    with LLM(**engine_args) as llm:
        Chat(llm, params, args.system).loop(sys.stdin, sys.stdout)
    return 0


class Chat:
    """A conversation with `llm`: its history, and one reply per user message."""

    def __init__(self, llm, params: SamplingParams, system: str | None = None) -> None:
        self.llm, self.params = llm, params
        self.start = [{"role": "system", "content": system}] if system else []
        self.history = list(self.start)
        self._ids = itertools.count()

    def loop(self, stdin: TextIO, stdout: TextIO) -> None:
        interactive = stdin.isatty()
        if interactive:
            stdout.write(f"vserve chat: {HELP}\n")
        while True:
            if interactive:
                stdout.write("> ")
                stdout.flush()
            try:
                line = stdin.readline()
            except KeyboardInterrupt:  # Ctrl-C at the prompt: leave
                return
            if not line or line.strip() == "/exit":
                return
            text = line.strip()
            if text == "/clear":
                self.history = list(self.start)
                if interactive:
                    stdout.write("(conversation cleared)\n")
                continue
            if text:
                try:
                    self.say(text, stdout)
                except ValueError as e:  # too long for the context, say: the turn is dropped
                    self.history.pop()
                    stdout.write(f"(not sent: {e}; /clear starts afresh)\n")

    def say(self, text: str, stdout: TextIO) -> str:
        """Send one user message; the reply is written as it streams and returned."""
        self.history.append({"role": "user", "content": text})
        prompt = self.llm.apply_chat_template(self.history)
        request_id = f"chat-{next(self._ids)}"
        engine = self.llm.engine
        ids = prompt["prompt_token_ids"]
        engine.processor.check_params(self.params, len(ids))  # ValueError: the turn is dropped
        engine.add_request(request_id, prompt, self.params, kind=OutputKind.DELTA)
        reply = ""
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    delta = out.outputs[0].text
                    reply += delta
                    stdout.write(delta)
                    stdout.flush()
        except KeyboardInterrupt:  # the reply so far stays in the history
            engine.abort_request([request_id])
            while engine.has_unfinished_requests():
                engine.step()
        stdout.write("\n")
        stdout.flush()
        self.history.append({"role": "assistant", "content": reply})
        return reply
