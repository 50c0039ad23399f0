"""OpenAI's Responses API (/v1/responses): router, protocol, serving; its input turned into a chat, its
output into items and events."""
