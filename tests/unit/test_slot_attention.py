"""The slots engine's decoding attention kernel (tuneloop/serving/slot_attention.py):
built with the system C compiler, equal to sdpa over each row's own range of its slot
(left padding, ragged lengths, grouped-query heads), callable inside torch.compile, and a
clean fall back to sdpa where no compiler exists."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from tuneloop.serving import slot_attention


@pytest.fixture(scope="module")
def kernel():
    if slot_attention.load_kernel() is None:
        pytest.fail("the slot attention kernel did not build: this machine has a C compiler (see the log)")
    return torch.ops.tuneloop.slot_decode_attention


def reference(q, k, v, lo, hi, scale):
    """sdpa, one row at a time, over positions lo..hi of the row's own slot."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = []
    for i in range(q.shape[0]):
        keys = k[i, :, lo[i] : hi[i] + 1].repeat_interleave(heads // kv_heads, dim=0)
        values = v[i, :, lo[i] : hi[i] + 1].repeat_interleave(heads // kv_heads, dim=0)
        out.append(F.scaled_dot_product_attention(q[i : i + 1], keys[None], values[None], scale=scale)[0])
    return torch.stack(out)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_equals_sdpa_over_each_rows_own_range(kernel, heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    slots, rows, max_len, dim = 7, 5, 96, 32
    q = torch.randn(rows, heads, 1, dim, generator=g)
    k = torch.randn(slots, kv_heads, max_len, dim, generator=g)
    v = torch.randn(slots, kv_heads, max_len, dim, generator=g)
    lo = torch.tensor([0, 3, 0, 17, 95])  # left padding before lo; a row of one position
    hi = torch.tensor([0, 40, 95, 60, 95])
    got = kernel(q, k[:rows], v[:rows], lo, hi, dim**-0.5)
    torch.testing.assert_close(got, reference(q, k, v, lo, hi, dim**-0.5), rtol=1e-5, atol=1e-5)
    # Slots beyond the rows and positions beyond hi are never read: poisoning them changes nothing.
    k2, v2 = k.clone(), v.clone()
    for i in range(rows):
        k2[i, :, hi[i] + 1 :] = float("nan")
        k2[i, :, : lo[i]] = float("nan")
        v2[i, :, hi[i] + 1 :] = float("nan")
    k2[rows:], v2[rows:] = float("nan"), float("nan")
    assert torch.equal(kernel(q, k2, v2, lo, hi, dim**-0.5), got)


def test_runs_inside_torch_compile_with_changing_row_counts(kernel):
    g = torch.Generator().manual_seed(1)
    k = torch.randn(8, 2, 64, 16, generator=g)
    v = torch.randn(8, 2, 64, 16, generator=g)

    @torch.compile(dynamic=True)
    def step(q, lo, hi):
        return kernel(q * 1.0, k[: q.shape[0]], v[: q.shape[0]], lo, hi, 0.25) + 0.0

    for n in (3, 5, 8):
        q = torch.randn(n, 2, 1, 16, generator=g)
        lo = torch.zeros(n, dtype=torch.long)
        hi = torch.arange(n, dtype=torch.long) * 7
        torch.testing.assert_close(step(q, lo, hi), reference(q, k, v, lo, hi, 0.25), rtol=1e-5, atol=1e-5)


def test_without_a_compiler_the_engine_decodes_with_sdpa(kernel, tmp_path, monkeypatch):
    """A host with no C compiler: no kernel, a warning, and the same tokens through sdpa."""
    from tests.support.serving import PROMPTS, collect
    from tests.support.serving import reference as generate_reference
    from tests.support.serving_tiny_model import build_tiny_model
    from tuneloop.serving.engine import GenerationStream, SamplingParams, load_model
    from tuneloop.serving.slots import SlotEngine

    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("TUNELOOP_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(slot_attention, "_kernel", None)  # forget the kernels built for this process
    monkeypatch.setattr(slot_attention, "_library", None)
    assert slot_attention.load_kernel() is None

    loaded = load_model(build_tiny_model(tmp_path / "tiny"), num_threads=1)
    ids = loaded.tokenizer(PROMPTS[0])["input_ids"]

    async def main():
        engine = SlotEngine(loaded, num_slots=2)
        engine.launch()
        try:
            await asyncio.to_thread(engine.ready.wait, 60)
            stream = GenerationStream("s", ids, SamplingParams(max_new_tokens=20, temperature=0.0))
            engine.submit(stream)
            return engine.kernel, await collect(stream)
        finally:
            engine.stop()

    used_kernel, (tokens, _) = asyncio.run(main())
    assert used_kernel is False
    assert tokens == generate_reference(loaded, ids, 20)
