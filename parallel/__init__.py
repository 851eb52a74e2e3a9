"""Process groups, tensor-parallel state and collectives, pipeline-parallel communication (the
parallel layers are worker/layers/)."""
