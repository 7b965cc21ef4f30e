"""Incremental detokenization and stop strings (front end only; the engine knows token ids).

Text grows by decoding a small window of ids and taking only what the newest id added; a
window that ends in an incomplete UTF-8 character (U+FFFD) waits for the next id. Stop strings
are searched in the new text plus `len(stop) - 1` characters before it, so one that spans two
steps is found once; streamed deltas hold back that many characters so a partial stop string
is never sent.
"""

from __future__ import annotations

from vserve.sampling_params import SamplingParams

_PROMPT_WINDOW = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stop = params.stop_strings
        self.include_stop = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        if self.include_stop:
            self.hold = 0
        tail = list(prompt_ids[-_PROMPT_WINDOW:])
        self.ids = tail
        self.prefix_offset = 0
        self.read_offset = len(tail)
        # fast tokenizers stream in Rust: one call per token instead of two window decodes
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=tail, skip_special_tokens=self.skip_special)
        self.num_output_tokens = 0
        self.output_text = ""
        self.sent = 0

    def update(self, new_ids: list[int], stop_terminated: bool) -> str | None:
        """Add confirmed ids; returns the stop string that ended the text, if any. When the
        engine stopped on a stop token or EOS (`stop_terminated`), that last token is not
        rendered unless `include_stop_str_in_output`."""
        render = new_ids
        if stop_terminated and not self.include_stop and new_ids:
            render = new_ids[:-1]
        start = len(self.output_text)
        for token_id in render:
            self.num_output_tokens += 1
            self.ids.append(token_id)
            self._decode_next()
            if self.num_output_tokens <= self.min_tokens:
                start = len(self.output_text)
        if stop_terminated and len(render) < len(new_ids):
            self.num_output_tokens += 1
        return self._find_stop(start)

    def _decode_next(self) -> None:
        if self._stream is not None and self._backend is not None:  # a stream has a backend
            try:
                text = self._stream.step(self._backend, self.ids[-1])
            except Exception:  # the Rust stream refuses some byte-fallback sequences
                self._leave_stream()
            else:
                if text:
                    self.output_text += text
                return
        decode = self.tokenizer.decode
        prefix = decode(
            self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special
        )
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.output_text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def _leave_stream(self) -> None:
        """Go on with window decodes from the newest id: the ids before it are rendered."""
        self._stream = None
        self.read_offset = len(self.ids) - 1
        self.prefix_offset = max(0, self.read_offset - _PROMPT_WINDOW)

    def _find_stop(self, new_start: int) -> str | None:
        if not self.stop:
            return None
        text = self.output_text
        found = None
        for stop in self.stop:
            idx = text.find(stop, max(0, new_start - len(stop) + 1))
            if idx != -1 and (found is None or idx < found[0]):
                found = (idx, stop)
        if found is None:
            return None
        idx, stop = found
        self.output_text = text[: idx + len(stop) if self.include_stop else idx]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not sent yet, holding back a possible stop-string prefix unless finished."""
        end = (
            len(self.output_text) if finished else max(self.sent, len(self.output_text) - self.hold)
        )
        delta = self.output_text[self.sent : end]
        self.sent = end
        return delta
