"""The routes every server has (/health, /metrics, /version, /v1/models): router and serving."""
