"""The engine clients (`LLM`, `AsyncEngine`, the ipc client they share), output processing,
tokenizing and detokenizing, engine arguments; openai/ is the HTTP layer over `AsyncEngine`.
The processes that run them start in entrypoints/."""
