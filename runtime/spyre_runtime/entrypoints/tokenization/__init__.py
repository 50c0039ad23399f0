"""vLLM's /tokenize and /detokenize: router, protocol, serving."""
