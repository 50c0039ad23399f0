"""Prompts as token ids: text through the tokenizer, chat messages through the chat template. Shared by
the completion routes and the tokenizer routes, so /tokenize counts exactly what a completion would run."""

from __future__ import annotations

import asyncio

from spyre_runtime.entrypoints.chat.images import MAX_IMAGES_VAR, ImagePrompter, decode_image
from spyre_runtime.entrypoints.chat.protocol import ChatBody
from spyre_runtime.entrypoints.chat.tools import template_tool_calls
from spyre_runtime.entrypoints.server.errors import APIError, bad_request
from spyre_runtime.request import ImageInput

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


def template_messages(body: ChatBody, images: bool = False) -> list[dict]:
    """Messages as plain dicts for the chat template; text content parts, and with `images` (an
    image-text model) image_url parts, which leave the message's parts a list with {"type": "image"}
    where each image goes (as HF processors' templates read them); an assistant's tool calls with their
    arguments as objects; a tool result names the call it answers."""
    out = []
    for i, m in enumerate(body.messages or ()):
        msg = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                is_image = images and part.type == "image_url"
                if is_image and (part.image_url is None or part.image_url.url is None):
                    raise bad_request(
                        f"messages.{i}.content.{j}.image_url", "needs a url: data:image/png;base64,..."
                    )
                if not is_image and (part.type != "text" or part.text is None):
                    kinds = "text and image_url" if images else "text: images need an image-text model"
                    raise bad_request(
                        f"messages.{i}.content.{j}",
                        f"content parts of type {part.type!r} are not supported (only {kinds})",
                    )
            if any(part.type == "image_url" for part in m.content):
                msg["content"] = [
                    {"type": "image"} if p.type == "image_url" else {"type": "text", "text": p.text}
                    for p in m.content
                ]
            else:
                msg["content"] = "".join(part.text for part in m.content)
        elif m.content is None:
            msg["content"] = ""
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"messages.{i}.tool_calls", "only assistant messages carry tool calls")
            msg["tool_calls"] = template_tool_calls(m.tool_calls, f"messages.{i}.tool_calls")
        if m.role == "tool" and not m.tool_call_id:
            raise bad_request(f"messages.{i}.tool_call_id", "a tool message names the call it answers")
        out.append(msg)
    return out


def render_chat(tokenizer, body: ChatBody, images: bool = False) -> str:
    """The chat template's text (vLLM's rule: the template adds the special tokens it wants). `images`:
    image_url parts are allowed (an image-text model) and rendered as the template places images."""
    messages = template_messages(body, images)
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
    if getattr(body, "tool_choice", None) == "none":  # a chat completions request's (not /tokenize's)
        tools = None
    reasoning_effort = getattr(body, "reasoning_effort", None)
    if reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", reasoning_effort)  # as vLLM passes it
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


async def chat_prompt(
    tokenizer, body: ChatBody, prompter: ImagePrompter | None
) -> tuple[list[int], ImageInput | None]:
    """A chat's token ids and, when its messages hold image_url parts, its images: decoded and checked,
    then through the model's processor, which expands each image token as the model expects (off the event
    loop). A text-only model (`prompter` None) refuses image parts."""
    text = render_chat(tokenizer, body, images=prompter is not None)
    add_special = bool(body.add_special_tokens)
    urls = [
        (f"messages.{i}.content.{j}.image_url", part.image_url.url)
        for i, m in enumerate(body.messages)
        if isinstance(m.content, list)
        for j, part in enumerate(m.content)
        if part.type == "image_url" and part.image_url is not None
    ]
    if not urls:
        return tokenize(tokenizer, text, add_special, "messages"), None
    limit = prompter.limits.max_images
    if len(urls) > limit:
        raise bad_request(urls[limit][0], f"at most {limit} images per request ({MAX_IMAGES_VAR})")

    def process():
        images = [decode_image(url, param, prompter.limits) for param, url in urls]
        try:
            ids, image_input = prompter.process(text, images, add_special)
        except Exception as e:
            raise bad_request("messages", f"the images could not be processed: {e}") from None
        try:
            prompter.encode(image_input)
        except Exception as e:
            raise APIError(500, f"the vision tower failed on the images: {e}", code="vision_failed") from None
        return ids, image_input

    return await asyncio.to_thread(process)
