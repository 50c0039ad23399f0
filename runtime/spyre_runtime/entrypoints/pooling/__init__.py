"""The routes of pooling models (/v1/embeddings, /score, /rerank): router, protocol, serving, and the pooling
server's state."""
