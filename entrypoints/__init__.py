"""Process entry points, above everything they start: the `pagedserve` CLI and its flags, the
launcher, and the mains of the EngineCore and API server processes (spawned as
`python -m pagedserve.entrypoints.<name>`). Nothing below imports this package."""
