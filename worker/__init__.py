"""Worker processes: model runner, persistent batch, models, weight loading, sampler."""
