"""What reading and writing a chat takes, for every API that chats (chat completions, responses, tokenize):
messages and tools (protocol), prompts through the chat template, images, tool plans and grammars, the
chat output parser, tool-call parsers and reasoning parsers."""
