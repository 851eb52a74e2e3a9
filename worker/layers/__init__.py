"""The nn.Modules models are built from: attention, norms, rotary embedding, activations and the
tensor-parallel linear, embedding and expert layers (functions and kernels live in kernels/;
process groups and collectives in parallel/)."""
