"""Every cross-process message (msgspec Structs) and typed ZeroMQ wrappers."""
