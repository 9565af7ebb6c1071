"""Shared-prefix packing gives the padded layout's logprobs, entropies and gradients over fewer positions."""

import numpy as np
import pytest
import torch

from rlfabric.models.hf import build_small_model_dir, load_causal_lm
from rlfabric.models.packed_batch import pack_sequences
from rlfabric.models.prefix_packing import check_maskable, pack_shared_prefix
from rlfabric.models.sequences import response_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_small_model_dir(tmp_path_factory.mktemp("model"), num_layers=2, hidden_size=64, num_heads=4)


def _groups(seed: int = 0, groups: int = 3, per_group: int = 4) -> tuple[list, list]:
    """``groups`` prompts of 3-7 tokens, each with ``per_group`` responses of 1-9 tokens."""
    rng = np.random.default_rng(seed)
    prompts, responses = [], []
    for _ in range(groups):
        prompt = rng.integers(3, 60, rng.integers(3, 8)).tolist()
        for _ in range(per_group):
            prompts.append(prompt)
            responses.append(rng.integers(3, 60, rng.integers(1, 10)).tolist())
    return prompts, responses


def _padded(prompts, responses):
    batch = pack_sequences(prompts, responses, pad_id=0)
    return (
        torch.tensor(batch["input_ids"]),
        torch.tensor(batch["attention_mask"]),
        int(batch["prompt_len"]),
        torch.tensor(batch["response_mask"]),
    )


def test_pack_layout_by_hand():
    # Rows 0 and 2 share prompt [5, 6]; row 1 has its own. Padded: prompts left-padded to 2, responses to 2.
    prompts, responses = [[5, 6], [9], [5, 6]], [[7], [10, 11], [8, 4]]
    ids, attention, prompt_len, _ = _padded(prompts, responses)
    pack = pack_shared_prefix(ids.numpy(), attention.numpy(), prompt_len, feed_last=True)
    # One packed row: block [5, 6 | 7 | 8, 4], then block [9 | 10, 11]; positions restart at each prompt.
    np.testing.assert_array_equal(pack.input_ids, [[5, 6, 7, 8, 4, 9, 10, 11]])
    np.testing.assert_array_equal(pack.position_ids, [[0, 1, 2, 2, 3, 0, 1, 2]])
    np.testing.assert_array_equal(pack.segment_ids, [[0, 0, 1, 2, 2, 3, 4, 4]])
    np.testing.assert_array_equal(pack.prefix_ids, [[0, 0, 0, 0, 0, 3, 3, 3]])
    # Response tokens in padded order (row, column), each predicted by the position before it in its own segment.
    np.testing.assert_array_equal(pack.row, [0, 2, 2, 1, 1])
    np.testing.assert_array_equal(pack.column, [0, 0, 1, 0, 1])
    np.testing.assert_array_equal(pack.target, [7, 8, 4, 10, 11])
    np.testing.assert_array_equal(pack.source, [1, 1, 3, 5, 6])


def test_logprob_layout_leaves_each_responses_last_token_out():
    # For logprobs a response's last token is only predicted: the input is [5, 6 | - | 8] then [9 | 10], and the
    # same five tokens are predicted, each from the position before it (row 0's only token from the prompt's last).
    prompts, responses = [[5, 6], [9], [5, 6]], [[7], [10, 11], [8, 4]]
    ids, attention, prompt_len, _ = _padded(prompts, responses)
    pack = pack_shared_prefix(ids.numpy(), attention.numpy(), prompt_len, feed_last=False)
    np.testing.assert_array_equal(pack.input_ids, [[5, 6, 8, 9, 10]])
    np.testing.assert_array_equal(pack.position_ids, [[0, 1, 2, 0, 1]])
    np.testing.assert_array_equal(pack.segment_ids, [[0, 0, 2, 3, 4]])
    np.testing.assert_array_equal(pack.prefix_ids, [[0, 0, 0, 3, 3]])
    np.testing.assert_array_equal(pack.row, [0, 2, 2, 1, 1])
    np.testing.assert_array_equal(pack.column, [0, 0, 1, 0, 1])
    np.testing.assert_array_equal(pack.target, [7, 8, 4, 10, 11])
    np.testing.assert_array_equal(pack.source, [1, 1, 2, 3, 4])


def test_max_tokens_bounds_blocks_and_rows():
    # A block may not pass 6 tokens: the third response starts another block behind the same prompt; and a row
    # may not either, so that block starts the second row, padded at its end.
    prompts, responses = [[5, 6]] * 3, [[7, 7], [8, 8], [9, 9]]
    ids, attention, prompt_len, _ = _padded(prompts, responses)
    pack = pack_shared_prefix(ids.numpy(), attention.numpy(), prompt_len, max_tokens=6, feed_last=True)
    np.testing.assert_array_equal(pack.input_ids, [[5, 6, 7, 7, 8, 8], [5, 6, 9, 9, 0, 0]])
    np.testing.assert_array_equal(pack.segment_ids, [[0, 0, 1, 1, 2, 2], [0, 0, 1, 1, -1, -1]])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("max_tokens", [4096, 12], ids=["one-row", "split-blocks-and-rows"])
def test_logprobs_entropy_and_gradients_equal_the_padded_layout(model_dir, attention, max_tokens):
    from rlfabric.models.prefix_packing import response_logprobs_shared_prefix

    model = load_causal_lm(model_dir)
    model.set_attn_implementation(attention)
    model.train()
    prompts, responses = _groups()
    ids, mask_2d, prompt_len, response_mask = _padded(prompts, responses)
    advantages = torch.linspace(-1.0, 1.0, len(prompts))[:, None]

    def loss_and_grads(logp, entropy):
        loss = -(logp * advantages * response_mask).sum() + 0.1 * (entropy * response_mask).sum()
        model.zero_grad()
        loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    padded_logp, padded_entropy = response_logprobs(model, ids, mask_2d, prompt_len, 0.7, with_entropy=True)
    packed_logp, packed_entropy = response_logprobs_shared_prefix(
        model, ids, mask_2d, prompt_len, 0.7, with_entropy=True, max_tokens=max_tokens
    )
    real = response_mask.bool()
    assert real.sum() > 20 and padded_logp[real].std() > 0.05  # not a trivially flat distribution
    torch.testing.assert_close(packed_logp[real], padded_logp[real], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(packed_entropy[real], padded_entropy[real], atol=2e-5, rtol=1e-5)
    assert float(packed_logp.detach()[~real].abs().sum()) == 0.0
    padded_grads = loss_and_grads(*response_logprobs(model, ids, mask_2d, prompt_len, 0.7, with_entropy=True))
    packed_grads = loss_and_grads(
        *response_logprobs_shared_prefix(model, ids, mask_2d, prompt_len, 0.7, with_entropy=True, max_tokens=max_tokens)
    )
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packing_runs_each_prompt_once(model_dir):
    prompts, responses = _groups(groups=3, per_group=4)
    ids, attention, prompt_len, _ = _padded(prompts, responses)
    pack = pack_shared_prefix(ids.numpy(), attention.numpy(), prompt_len, feed_last=False)
    distinct_prompt_tokens = sum(len(p) for p in prompts[::4])
    real_tokens = distinct_prompt_tokens + sum(len(r) - 1 for r in responses)  # the last ones are targets only
    assert pack.input_ids.shape == (1, real_tokens)  # every block in one row, no padding
    assert int((pack.segment_ids >= 0).sum()) == real_tokens


def test_attention_without_custom_masks_is_refused_with_the_field(model_dir):
    model = load_causal_lm(model_dir)
    model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match=r"learner.sequence_packing = 'shared_prefix'.*'flex_attention'.*padded"):
        check_maskable(model)


def test_auto_packs_short_responses_and_keeps_long_equal_ones_padded(model_dir):
    from rlfabric.models.sequences import packed_layout

    model = load_causal_lm(model_dir)  # hidden size 64: rows of up to 64 tokens
    rng = np.random.default_rng(0)
    for response_length, packs in ((2, True), (40, False)):
        prompts = [p for p in (rng.integers(3, 60, 6).tolist() for _ in range(4)) for _ in range(8)]
        responses = [rng.integers(3, 60, response_length).tolist() for _ in prompts]
        ids, attention, prompt_len, _ = _padded(prompts, responses)
        layout = packed_layout(model, ids.numpy(), attention.numpy(), prompt_len, "auto")
        if packs:  # 4 blocks of 6 + 8 x 1 = 14 tokens (a response's last token is not fed): one row of 56
            assert layout is not None and layout.input_ids.shape == (1, 56)
        else:  # 6 + 39 + 39 passes 64 tokens: one response per block and row, no cheaper than padded rows
            assert layout is None
