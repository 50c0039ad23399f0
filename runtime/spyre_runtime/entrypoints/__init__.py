"""The HTTP layer: one OpenAI-compatible FastAPI app, its routers, schemas and response formatting."""
