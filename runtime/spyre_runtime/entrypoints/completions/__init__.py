"""OpenAI's /v1/completions and /v1/chat/completions: router, protocol, serving (and beam search), with what
every decoder route shares: the decoder server's state, a request's submission, the validator and the
response formatting."""
