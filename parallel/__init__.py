"""Process groups, tensor-parallel layers, pipeline-parallel communication."""
