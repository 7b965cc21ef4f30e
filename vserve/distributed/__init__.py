"""The TP x PP grid of worker ranks and the tensor-parallel collectives (shared-memory
all-reduce between the ranks of one host, torch.distributed otherwise)."""
