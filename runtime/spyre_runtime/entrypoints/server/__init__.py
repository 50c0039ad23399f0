"""The shared server: the app's life under uvicorn (launcher), the API-key guard, the error bodies, the
metrics, the state every task's server shares, and the base of every request schema."""
