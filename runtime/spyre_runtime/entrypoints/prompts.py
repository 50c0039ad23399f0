"""Prompts as token ids: text through the tokenizer, chat messages through the chat template. Shared by
the completion routes and the tokenizer routes, so /tokenize counts exactly what a completion would run."""

from __future__ import annotations

from spyre_runtime.entrypoints.errors import bad_request
from spyre_runtime.entrypoints.protocol import ChatCompletionRequest, TokenizeRequest
from spyre_runtime.entrypoints.validator import Validator

RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "messages",
    "tokenize",
    "tools",
    "chat_template",
    "add_generation_prompt",
}


def tokenize(tokenizer, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
    try:
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    except Exception as e:  # e.g. lone surrogates, which JSON allows and UTF-8 does not
        raise bad_request(param, f"could not be tokenized: {e}") from None


def render_chat(tokenizer, v: Validator, body: ChatCompletionRequest | TokenizeRequest) -> str:
    """The chat template's text (vLLM's rule: the template adds the special tokens it wants)."""
    messages = v.messages(body)
    add_generation = body.add_generation_prompt is not False
    if body.continue_final_message:
        if body.add_generation_prompt:
            raise bad_request("continue_final_message", "cannot be combined with add_generation_prompt: true")
        add_generation = False
    kwargs = dict(body.chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if clash:
        raise bad_request("chat_template_kwargs", f"may not set {', '.join(clash)}")
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    if isinstance(body, ChatCompletionRequest):
        if body.tool_choice == "none":
            tools = None
        if body.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", body.reasoning_effort)  # as vLLM passes it
    if body.chat_template is None and tokenizer.chat_template is None:
        raise bad_request("messages", "the model has no chat template; pass chat_template")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=body.chat_template,
            add_generation_prompt=add_generation,
            continue_final_message=bool(body.continue_final_message),
            tokenize=False,
            **kwargs,
        )
    except Exception as e:
        raise bad_request("messages", f"could not be rendered with the chat template: {e}") from None
    if not isinstance(text, str):
        raise bad_request("chat_template", "the template did not render to text")
    return text
