"""API servers, OpenAI protocol, tokenizing and detokenizing, engine clients, the CLI."""
