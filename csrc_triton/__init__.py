"""Triton kernels of vserve, each beside the plain-torch reference it is tested against.

- `paged_attention`: varlen paged attention over a mixed batch of prefill chunks and decode
  rows in one launch (GQA, causal, sliding window, logit softcap, online softmax in fp32).
- `kv_write`: scatter this step's keys/values into the paged KV cache at their slots.
- `prepare_inputs`: fused per-step input preparation for async scheduling (token ids with
  on-device feedback of the previous step's samples, positions, slot mapping).
- `fused_moe`: a mixture of experts' step as two grouped GEMMs over the (token, slot) pairs
  sorted by expert, each tile reading one expert's weights (the CUDA path of the experts).
- `sample`: sampling rows without top-k / top-p / min-p in one launch (the CUDA path of the
  sampler): argmax, or the (seed, position) inverse CDF of softmax(x / T).
- `sample_filtered`: rows with top-k / top-p / min-p, the same pick as the torch path's stable
  sort, found by searching the probabilities' values instead of sorting them.
- `variants`: counts the compiled variants a run of the kernels needs, by Triton's
  specialization rules (tests keep that count bounded).

Importing a submodule imports `triton`; nothing in `vserve` imports this package except the
Triton attention backend and, on CUDA, the experts of a mixture and the sampler, so vserve
still imports where triton is missing.
"""
