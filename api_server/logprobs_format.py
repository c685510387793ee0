"""OpenAI's two shapes of log probabilities: the legacy completions one and the chat one."""

from __future__ import annotations

from pipelines.response import LogProbabilities


class TokenText:
    """Token ids to the strings OpenAI shows for them (one token decoded alone)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self.cache[token_id] = text
        return text


def token_id_text(token_id: int) -> str:
    """A token as vLLM's `return_tokens_as_token_ids` names it."""
    return f"token_id:{token_id}"


def _top(lp: LogProbabilities, n: int) -> list[tuple[int, float]]:
    items = sorted(lp.top_log_probabilities[0].items(), key=lambda kv: -kv[1])
    return items[:n]


class CompletionLogprobs:
    """Accumulates {"tokens", "token_logprobs", "top_logprobs", "text_offset"} for a choice."""

    def __init__(self, token_text: TokenText, top_n: int, text_offset: int = 0) -> None:
        self.token_text = token_text
        self.top_n = top_n
        self.offset = text_offset
        self.body = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def add_first_prompt_token(self, token_id: int) -> None:
        self._append(token_id, None, None)

    def add(self, token_id: int, lp: LogProbabilities) -> None:
        top = {self.token_text(t): v for t, v in _top(lp, self.top_n)}
        self._append(token_id, lp.token_log_probabilities[0], top)

    def _append(self, token_id: int, logprob: float | None, top: dict | None) -> None:
        text = self.token_text(token_id)
        self.body["tokens"].append(text)
        self.body["token_logprobs"].append(logprob)
        self.body["top_logprobs"].append(top)
        self.body["text_offset"].append(self.offset)
        self.offset += len(text)

    def take(self) -> dict:
        """What accumulated since the last call (for a stream chunk)."""
        body = self.body
        self.body = {k: [] for k in body}
        return body


def chat_logprob_entries(token_text: TokenText, pairs: list[tuple[int, LogProbabilities]],
                         top_n: int) -> list[dict]:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    out = []
    for token_id, lp in pairs:
        item = entry(token_id, lp.token_log_probabilities[0])
        item["top_logprobs"] = [entry(t, v) for t, v in _top(lp, top_n)]
        out.append(item)
    return out
