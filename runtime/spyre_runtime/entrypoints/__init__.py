"""The HTTP layer: the OpenAI-compatible FastAPI app (api_server), the shared server (server/), one folder
per API (completions/, responses/, pooling/, tokenization/, admin/), and the chat pieces (chat/)."""
