"""Reasoning models' thinking, split from the answer: the text between ``<think>`` and ``</think>``
at the start of a reply (or after a generation prompt that opened it, as Qwen3's and
DeepSeek-R1's templates can) goes out as ``reasoning_content``, the rest as ``content``, streamed
or whole. A tag split across deltas is held back until it is whole."""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


class ReasoningSplitter:
    def __init__(self, opened: bool = False):
        self.state = "inside" if opened else "start"  # start -> inside -> answer, or start -> answer
        self.buf = ""
        self.lead = False  # after </think>: the answer's leading newlines are dropped

    def feed(self, text: str, last: bool = False) -> tuple[str, str]:
        """(reasoning, content) to emit for the new text"""
        self.buf += text
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(OPEN):
                self.state, self.buf = "inside", head[len(OPEN):]
            elif OPEN.startswith(head) and not last:
                return "", ""  # could still become <think>
            else:
                self.state = "answer"
        if self.state == "inside":
            i = self.buf.find(CLOSE)
            if i < 0:
                keep = 0 if last else next((k for k in range(min(len(CLOSE) - 1, len(self.buf)), 0, -1)
                                            if self.buf.endswith(CLOSE[:k])), 0)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning, self.buf, self.state, self.lead = self.buf[:i], self.buf[i + len(CLOSE):], "answer", True
        if self.state == "answer":
            content, self.buf = (self.buf.lstrip("\n") if self.lead else self.buf), ""
            self.lead = self.lead and not content
        return reasoning, content


def opened_in_prompt(prompt_tail: str) -> bool:
    """Whether the rendered generation prompt ends inside an opened <think> block."""
    t = prompt_tail.rstrip()
    return t.endswith(OPEN)
