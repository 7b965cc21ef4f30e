"""The sampler's inputs reach the device without host waits (vserve.workers.device.upload, ids
of the previous step read on the device, logprobs resolved after the host copy), and what the
sampler sees is exactly what the former host-built path gave it. CPU tests; the CUDA check under
`torch.cuda.set_sync_debug_mode("error")` is in tests/e2e/test_gpu.py."""

import numpy as np
import pytest
import torch

from vserve.core.sched_output import NewRequestData
from vserve.sampling_params import SamplingParams
from vserve.workers import sampler
from vserve.workers.device import upload
from vserve.workers.feedback import FeedbackQueue
from vserve.workers.input_batch import InputBatch
from vserve.workers.sample_step import StepSampler
from vserve.workers.sampler import Sampler, SamplingMetadata

VOCAB = 512
CPU = torch.device("cpu")


def test_upload_equals_torch_tensor():
    for values, dtype in (
        ([3, 1, 4], None),
        ([0.5, 2.0], None),
        ([1, 2], torch.float32),
        ([0.25], torch.float64),
        ([], torch.long),
    ):
        want = torch.tensor(values, dtype=dtype)
        got = upload(values, CPU, dtype)
        assert got.dtype == want.dtype and torch.equal(got, want)
    packed = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert torch.equal(upload(packed, CPU), torch.from_numpy(packed))


def _meta(n, **fields):
    base = dict(
        temperature=[0.0] * n,
        top_k=[0] * n,
        top_p=[1.0] * n,
        min_p=[0.0] * n,
        seeds=list(range(n)),
        positions=[5] * n,
        num_logprobs=[None] * n,
        logit_bias=[None] * n,
        masked_ids=[None] * n,
        presence=[0.0] * n,
        frequency=[0.0] * n,
        repetition=[1.0] * n,
    )
    return SamplingMetadata(**{**base, **fields})


def _former_process(logits, meta):
    """The host-built processing this change replaced (per-row tensors, bincount), kept as
    the oracle: the staged path must give bit-identical logits."""
    for i, bias in enumerate(meta.logit_bias):
        if bias:
            logits[i, torch.tensor(list(bias))] += torch.tensor(list(bias.values()))
    for i, ids in enumerate(meta.masked_ids):
        if ids:
            logits[i, torch.tensor(ids)] = float("-inf")
    for i in range(logits.shape[0]):
        rep, pres, freq = meta.repetition[i], meta.presence[i], meta.frequency[i]
        if rep == 1.0 and pres == 0.0 and freq == 0.0:
            continue
        out_ids = torch.tensor(meta.output_ids[i], dtype=torch.long)
        if rep != 1.0:
            seen = torch.tensor(
                sorted(set(meta.prompt_ids[i]) | set(meta.output_ids[i])), dtype=torch.long
            )
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / rep, vals * rep)
        if pres != 0.0 or freq != 0.0:
            counts = torch.bincount(out_ids, minlength=VOCAB)[:VOCAB].to(logits.dtype)
            logits[i] -= freq * counts + pres * (counts > 0).to(logits.dtype)
    return logits


def _mixed_meta(pending: bool):
    """Rows: plain, repetition, presence + frequency, all three with bias and masks, one with
    pending ids but no penalty. With `pending`, each row's last output id is not on the host
    but given as a device id (`pending_output`), as under async scheduling."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 12, 5, 9, 3)]
    outputs = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 6, 8, 5, 2)]
    outputs[2] += outputs[2][:3]  # repeated ids: frequency counts above one
    meta = _meta(
        5,
        repetition=[1.0, 1.3, 1.0, 0.8, 1.0],
        presence=[0.0, 0.0, 0.7, -0.4, 0.0],
        frequency=[0.0, 0.0, 0.3, 0.9, 0.0],
        logit_bias=[{3: 5.0}, None, None, {7: -2.5, 9: 1}, None],
        masked_ids=[None, [1], None, [1, 2], None],
    )
    meta.prompt_ids = prompts
    if not pending:
        meta.output_ids = outputs
        return meta
    meta.output_ids = [o[:-1] for o in outputs]
    meta.pending_output = (torch.arange(5), torch.tensor([o[-1] for o in outputs]))
    return meta


@pytest.mark.parametrize("pending", [False, True])
def test_staged_processing_equals_the_former_host_path(pending):
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1))
    want = _former_process(logits.clone(), _mixed_meta(pending=False))
    got = Sampler(use_kernel=False)._process(logits.clone(), _mixed_meta(pending))
    assert torch.equal(got, want)


def test_full_sort_where_host_reads_are_not_free(monkeypatch):
    """The CUDA branch of `_kept_tokens` (every row sorted, no host read of a device mask)
    picks the tokens the candidate path picks."""
    monkeypatch.setattr(sampler, "CANDIDATES", 64)
    params = [(1.0, 20, 0.9, 0.0), (0.7, 0, 0.95, 0.0), (2.0, 0, 0.999, 0.0), (1.0, 0, 1.0, 0.1)]
    meta = _meta(
        4,
        temperature=[p[0] for p in params],
        top_k=[p[1] for p in params],
        top_p=[p[2] for p in params],
        min_p=[p[3] for p in params],
    )
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    want = Sampler(use_kernel=False)(logits, meta).token_ids
    monkeypatch.setattr(sampler, "host_reads_are_free", lambda device: False)
    assert torch.equal(Sampler(use_kernel=False)(logits, meta).token_ids, want)


def test_pending_logprobs_resolve_from_a_host_copy_as_directly():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    out = Sampler(use_kernel=False)(logits, _meta(3, num_logprobs=[2, None, 0]))
    pending = out.pending_logprobs
    copied = [t.clone() for t in pending.tensors]
    assert pending.resolve(copied) == out.logprobs
    assert out.logprobs[1] is None and len(out.logprobs[0].token_ids[0]) == 3


class _NoWait:
    """A host copy that must not be waited for (the ids are still on their way)."""

    def wait(self):
        raise AssertionError("the sampler waited for the previous step's host copy")


def _batch_with_pending(params: SamplingParams):
    batch = InputBatch(4, 64, 8)
    prompt = [5, 6, 7, 8]
    batch.add(NewRequestData("r", 0, prompt + [9, 10], 4, params, 1, [1], ([0, 1],), 0))
    row = batch.row_of["r"]
    queue = FeedbackQueue(1)
    batch.append_placeholder(row)  # step k sampled an id the host does not have
    fb = queue.push(1, batch, [row], ["r"], torch.tensor([11]))
    fb.host = _NoWait()
    batch.append_placeholder(row)  # step k + 1 samples now
    return batch, queue, row


def test_penalties_read_the_previous_steps_id_on_the_device():
    """Regression: a penalised row used to flush the feedback queue, waiting for the previous
    step's ids on the host (a pipeline stall on CUDA); now they are gathered on the device."""
    params = SamplingParams(temperature=0, presence_penalty=0.5, repetition_penalty=1.2)
    batch, queue, row = _batch_with_pending(params)
    steps = StepSampler(batch, VOCAB)
    steps.feedback = queue
    meta = steps.metadata([row], CPU)
    assert meta.prompt_ids == [[5, 6, 7, 8]] and meta.output_ids == [[9, 10]]
    rows, ids = meta.pending_output
    assert rows.tolist() == [0] and ids.tolist() == [11]
    # what the sampler then computes equals the flushed (host-known) metadata
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    flushed = _meta(1, presence=[0.5], repetition=[1.2])
    flushed.prompt_ids, flushed.output_ids = [[5, 6, 7, 8]], [[9, 10, 11]]
    want = _former_process(logits.clone(), flushed)
    assert torch.equal(Sampler(use_kernel=False)._process(logits.clone(), meta), want)


def test_penalties_and_logprobs_equal_under_sync_and_async(tiny_model_dir, monkeypatch):
    """End to end, the previous step's ids read on the device and logprobs resolved after
    the host copy: async scheduling generates exactly what sync does."""
    from tests.support.engines import make_llm
    from tests.support.hf_reference import PROMPTS

    gathered = []
    original = FeedbackQueue.device_ids_at

    def counting(self, keys):
        found, ids = original(self, keys)
        gathered.append(len(found))
        return found, ids

    monkeypatch.setattr(FeedbackQueue, "device_ids_at", counting)
    params = [
        SamplingParams(
            temperature=0,
            max_tokens=16,
            ignore_eos=True,
            logprobs=2,
            repetition_penalty=1.5,
            presence_penalty=1.0,
            frequency_penalty=0.5,
        ),
        SamplingParams(
            temperature=0.8,
            seed=3,
            max_tokens=16,
            ignore_eos=True,
            frequency_penalty=1.0,
            logit_bias={5: 2.0},
            min_tokens=8,
        ),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0),
    ]
    outs = {}
    for async_on in (False, True):
        llm = make_llm(tiny_model_dir("llama"), async_scheduling=async_on, max_model_len=128)
        outs[async_on] = [
            (
                o.outputs[0].token_ids,
                [{t: lp.logprob for t, lp in e.items()} for e in (o.outputs[0].logprobs or [])],
            )
            for o in llm.generate(PROMPTS[:3], params, use_tqdm=False)
        ]
    assert sum(gathered) > 0  # the penalised rows read ids still on the device
    assert outs[True] == outs[False]
    assert len(outs[True][0][1]) == 16 and len(outs[True][2][1]) == 16
