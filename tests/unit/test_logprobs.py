"""chatrl.logprobs.token_logprobs: the chunked log-probs with a closed-form backward.

Parity with autograd through the plain formula (the whole tensor up-cast, divided by the temperature,
gather minus logsumexp, one row at a time: what chatrl computed before), to the bit on CPU in bf16 and
fp32, forward and gradient; the gradient against finite differences in float64; hand-derived values.
"""

import math

import pytest
import torch

from chatrl import logprobs as lp
from chatrl.logprobs import logprobs_and_entropy, logprobs_from_logits, token_logprobs


def plain_logp(logits, labels, temperature=1.0):
    """Autograd through the plain formula."""
    z = logits.to(lp.float_dtype(logits))
    z = z / temperature if temperature != 1.0 else z
    return torch.stack([row.gather(-1, y.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(row, -1)
                        for row, y in zip(z, labels, strict=True)])


def plain_entropy(logits, temperature=1.0):
    """The entropy as the experience pass computed it, one row at a time, sharing logsumexp."""
    z = logits.to(lp.float_dtype(logits))
    z = z / temperature if temperature != 1.0 else z
    rows = []
    for row in z:
        lse = torch.logsumexp(row, -1)
        rows.append(lse - torch.linalg.vecdot((row - lse.unsqueeze(-1)).exp(), row))
    return torch.stack(rows)


def case(dtype, vocab=20011, seed=0):
    """Logits ``(3, 31, V)`` sliced as the trainer slices them (not contiguous), labels, an upstream gradient.
    At this vocabulary a chunk on CPU is 13 positions: 31 positions make two full chunks and a partial one."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(3, 32, vocab, generator=g) * 3).to(dtype)
    labels = torch.randint(0, vocab, (3, 31), generator=g)
    return full[:, :-1], labels, torch.randn(3, 31, generator=g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_autograd_through_the_plain_formula_to_the_bit(dtype, temperature):
    logits, labels, upstream = case(dtype)
    assert lp._chunk_positions(logits, torch.float32) == 13
    a = logits.detach().clone().requires_grad_()
    b = logits.detach().clone().requires_grad_()
    plain = plain_logp(a, labels, temperature)
    plain.backward(upstream)
    fast = token_logprobs(b, labels, temperature)
    fast.backward(upstream)
    assert fast.dtype == torch.float32 and b.grad.dtype == dtype
    assert torch.equal(fast, plain)
    assert torch.equal(b.grad, a.grad)
    # with the entropy (the experience pass): the same log-probs and gradient, the entropy the row-wise one's
    c = logits.detach().clone().requires_grad_()
    logp, entropy = token_logprobs(c, labels, temperature, entropy=True)
    logp.backward(upstream)
    assert torch.equal(logp, plain) and torch.equal(c.grad, a.grad)
    assert torch.equal(entropy, plain_entropy(logits, temperature))
    assert not entropy.requires_grad
    # contiguous logits (on a GPU taken as one row of B * T positions): the same bits
    d = logits.detach().contiguous().requires_grad_()
    logp, entropy = token_logprobs(d, labels, temperature, entropy=True)
    logp.backward(upstream)
    assert torch.equal(logp, plain) and torch.equal(d.grad, a.grad)
    assert torch.equal(entropy, plain_entropy(logits, temperature))


def test_a_decoding_step_has_the_plain_numbers():
    """The sampler's call: ``(B, 1, V)`` scores, one position per row, equal to the plain formula's bits
    with this process's threads (a reduction given all six rows at once splits differently across threads)."""
    g = torch.Generator().manual_seed(2)
    scores, tokens = torch.randn(6, 50272, generator=g) * 3, torch.randint(0, 50272, (6,), generator=g)
    assert torch.equal(logprobs_from_logits(scores[:, None], tokens[:, None]), plain_logp(scores[:, None], tokens[:, None]))


def test_the_gradient_is_the_softmax_closed_form():
    """Finite differences in float64, and the closed form (onehot - softmax(z / T)) / T by hand."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([[0, 6, 3], [2, 2, 5]])
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, labels, 0.7), (logits,))
    upstream = torch.randn(2, 3, generator=g, dtype=torch.float64)
    token_logprobs(logits, labels, 0.7).backward(upstream)
    onehot = torch.nn.functional.one_hot(labels, 7).double()
    expected = (onehot - torch.softmax(logits.detach() / 0.7, -1)) / 0.7 * upstream.unsqueeze(-1)
    torch.testing.assert_close(logits.grad, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (0, 0.6), (4, 0.7)])
def test_filtered_logprobs_are_the_filtered_softmax_and_keep_their_label(top_k, top_p):
    """With top-k / top-p: the log-softmax over the kept tokens and the label, its gradient
    (onehot - softmax over them) / T and 0 on the dropped tokens, by autograd through the plain
    formula; a label the filter dropped gets a finite log-prob (it is counted); the entropy is the
    filtered distribution's; with no filter the numbers are the unfiltered ones."""
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 3, 11, generator=g, dtype=torch.float64) * 2).requires_grad_()
    z = logits.detach() / 0.7
    kept = torch.isfinite(lp.sampling_filter(z, top_k, top_p))
    dropped = (~kept).nonzero()[0]  # one position's dropped token becomes its label
    labels = z.argmax(-1)
    labels[dropped[0], dropped[1]] = dropped[2]
    assert int((~kept).sum()) > 0 and bool(kept.sum(-1).lt(11).all())
    kept = kept | torch.nn.functional.one_hot(labels, 11).bool()
    upstream = torch.randn(2, 3, generator=g, dtype=torch.float64)
    logp, ent = token_logprobs(logits, labels, 0.7, entropy=True, top_k=top_k, top_p=top_p)
    (logp * upstream).sum().backward()
    x = logits.detach().clone().requires_grad_()
    plain = torch.log_softmax((x / 0.7).masked_fill(~kept, -math.inf), -1)
    want = plain.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    (want * upstream).sum().backward()
    torch.testing.assert_close(logp, want.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(logits.grad, x.grad, rtol=0, atol=1e-12)
    assert bool((logits.grad[~kept] == 0).all()) and bool(torch.isfinite(logp).all())
    q = plain.detach().exp()
    torch.testing.assert_close(ent, -(q * plain.detach().nan_to_num(neginf=0.0)).sum(-1), rtol=0, atol=1e-12)
    unfiltered = token_logprobs(logits.detach(), labels, 0.7)
    assert torch.equal(token_logprobs(logits.detach(), labels, 0.7, top_k=0, top_p=1.0), unfiltered)
    assert bool((logp.detach() > unfiltered).all())  # the kept mass is < 1 at every position


def test_uniform_logits_by_hand():
    """Equal logits over V tokens: log-prob -log V, entropy log V, gradient (onehot - 1/V) / T."""
    logits = torch.zeros(1, 2, 5, requires_grad=True)
    logp, entropy = token_logprobs(logits, torch.tensor([[1, 4]]), 0.5, entropy=True)
    torch.testing.assert_close(logp, torch.full((1, 2), -math.log(5)))
    torch.testing.assert_close(entropy, torch.full((1, 2), math.log(5)))
    logp.sum().backward()
    expected = torch.full((1, 2, 5), -0.2 / 0.5)
    expected[0, 0, 1] = expected[0, 1, 4] = 0.8 / 0.5
    torch.testing.assert_close(logits.grad, expected)


def test_the_public_helpers_are_token_logprobs_at_temperature_one():
    logits, labels, _ = case(torch.bfloat16, vocab=301)
    assert torch.equal(logprobs_from_logits(logits, labels), plain_logp(logits, labels))
    logp, entropy = logprobs_and_entropy(logits, labels)
    assert torch.equal(logp, plain_logp(logits, labels)) and torch.equal(entropy, plain_entropy(logits))
    empty = logprobs_from_logits(torch.zeros(2, 0, 5), torch.zeros(2, 0, dtype=torch.long))
    assert empty.shape == (2, 0) and empty.dtype == torch.float32
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\)"):
        logprobs_from_logits(torch.zeros(1, 2, 5), torch.tensor([[0, 5]]))
    for bad in (0.0, -0.7):
        with pytest.raises(ValueError, match="temperature must be > 0"):
            token_logprobs(torch.zeros(1, 2, 5), torch.tensor([[0, 4]]), bad)


def test_chunk_size_is_about_a_mebibyte_on_cpu():
    assert lp._chunk_positions(torch.zeros(1, 1, 50272), torch.float32) == 5  # OPT's vocabulary
    assert lp._chunk_positions(torch.zeros(1, 1, 151936), torch.float32) == 1  # Qwen2's
    assert lp._chunk_positions(torch.zeros(1, 1, 50272), torch.float64) == 2
