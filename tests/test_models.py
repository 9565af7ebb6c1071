"""The runners' numpy policy is the learner's torch actor: same outputs, same log-probabilities."""

import math
import re

import gymnasium as gym
import numpy as np
import pytest
import torch

from rlfabric.models import ActionSpec, ActorCritic, NumpyPolicy
from rlfabric.models.mlp import categorical_logp_entropy, gaussian_logp_entropy, obs_dim_of

OBS_DIM = 5


def _model(action: ActionSpec, activation: str, seed: int = 0) -> ActorCritic:
    """A model with weights scaled up from the PPO init, so outputs are far from uniform/zero."""
    torch.manual_seed(seed)
    model = ActorCritic(OBS_DIM, action, [16, 8], activation, init_log_std=0.0)
    with torch.no_grad():
        for p in model.actor.parameters():
            p.normal_(0.0, 0.7)
        if action.kind == "continuous":
            model.log_std.copy_(torch.linspace(-1.0, 0.5, action.n))
    return model


def _obs(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(0.0, 2.0, size=(n, OBS_DIM)).astype(np.float32)


DISCRETE = ActionSpec("discrete", 4)
CONTINUOUS = ActionSpec("continuous", 3, (-1.0,) * 3, (1.0,) * 3)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("action", [DISCRETE, CONTINUOUS], ids=["discrete", "continuous"])
def test_numpy_forward_equals_torch_actor(action, activation):
    model = _model(action, activation)
    obs = _obs(64)
    expected = model.actor(torch.as_tensor(obs)).detach().numpy()
    got = NumpyPolicy(model.actor_arrays()).forward(obs)
    assert got.shape == (64, action.n)
    assert np.abs(expected).max() > 0.5  # the check is not trivially about near-zero outputs
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
@pytest.mark.parametrize("action", [DISCRETE, CONTINUOUS], ids=["discrete", "continuous"])
def test_sampled_logp_equals_torch_evaluate(action, activation):
    model = _model(action, activation)
    obs = _obs(256)
    actions, logp = NumpyPolicy(model.actor_arrays()).act(obs, np.random.default_rng(3))
    if action.kind == "discrete":
        assert actions.dtype == np.int64 and actions.shape == (256,)
        assert len(np.unique(actions)) > 1
    else:
        assert actions.dtype == np.float32 and actions.shape == (256, action.n)
    assert logp.dtype == np.float32 and logp.shape == (256,)
    expected, _, _ = model.evaluate(torch.as_tensor(obs), torch.as_tensor(actions))
    np.testing.assert_allclose(logp, expected.detach().numpy(), atol=1e-5, rtol=1e-5)


def test_deterministic_discrete_is_argmax():
    model = _model(DISCRETE, "tanh")
    obs = _obs(128)
    policy = NumpyPolicy(model.actor_arrays())
    actions, logp = policy.act(obs, np.random.default_rng(0), deterministic=True)
    logits = model.actor(torch.as_tensor(obs)).detach()
    np.testing.assert_array_equal(actions, logits.argmax(-1).numpy())
    np.testing.assert_allclose(logp, torch.log_softmax(logits, -1).max(-1).values.numpy(), atol=1e-5)


def test_deterministic_continuous_is_mean():
    model = _model(CONTINUOUS, "relu")
    obs = _obs(32)
    actions, logp = NumpyPolicy(model.actor_arrays()).act(obs, np.random.default_rng(0), deterministic=True)
    np.testing.assert_allclose(actions, model.actor(torch.as_tensor(obs)).detach().numpy(), atol=1e-5)
    # at the mean, log N(mu; mu, sigma) summed over dims = sum(-log sigma) - n/2 log(2 pi)
    log_std = np.linspace(-1.0, 0.5, 3)
    np.testing.assert_allclose(logp, -log_std.sum() - 1.5 * math.log(2 * math.pi), atol=1e-5)


def test_discrete_sampling_frequencies_match_softmax():
    model = _model(DISCRETE, "tanh")
    obs = np.repeat(_obs(1), 20_000, axis=0)
    actions, _ = NumpyPolicy(model.actor_arrays()).act(obs, np.random.default_rng(7))
    probs = torch.softmax(model.actor(torch.as_tensor(obs[:1])), -1).detach().numpy()[0]
    freq = np.bincount(actions, minlength=4) / len(actions)
    np.testing.assert_allclose(freq, probs, atol=0.015)


def test_continuous_sampling_mean_and_std():
    model = _model(CONTINUOUS, "tanh")
    obs = np.repeat(_obs(1), 20_000, axis=0)
    actions, _ = NumpyPolicy(model.actor_arrays()).act(obs, np.random.default_rng(7))
    mean = model.actor(torch.as_tensor(obs[:1])).detach().numpy()[0]
    np.testing.assert_allclose(actions.mean(0), mean, atol=0.05)
    np.testing.assert_allclose(actions.std(0), np.exp(np.linspace(-1.0, 0.5, 3)), rtol=0.03)


def test_actor_arrays_are_copies():
    model = _model(CONTINUOUS, "tanh")
    arrays = model.actor_arrays()
    before = NumpyPolicy(arrays).forward(_obs(4))
    with torch.no_grad():
        for p in model.actor.parameters():
            p.add_(1.0)
        model.log_std.add_(1.0)
    np.testing.assert_array_equal(NumpyPolicy(arrays).forward(_obs(4)), before)
    np.testing.assert_allclose(arrays["log_std"], np.linspace(-1.0, 0.5, 3), rtol=1e-6)


def test_action_spec_from_supported_spaces():
    assert ActionSpec.from_space(gym.spaces.Discrete(6)) == ActionSpec("discrete", 6)
    spec = ActionSpec.from_space(
        gym.spaces.Box(low=np.array([-1.0, 0.0], np.float32), high=np.array([1.0, 2.0], np.float32))
    )
    assert spec == ActionSpec("continuous", 2, (-1.0, 0.0), (1.0, 2.0))


@pytest.mark.parametrize(
    "space",
    [
        gym.spaces.MultiDiscrete([2, 3]),
        gym.spaces.MultiBinary(4),
        gym.spaces.Box(-1.0, 1.0, shape=(2, 2)),
        gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.Discrete(3))),
        gym.spaces.Dict({"a": gym.spaces.Discrete(2)}),
    ],
    ids=["multidiscrete", "multibinary", "box2d", "tuple", "dict"],
)
def test_action_spec_rejects_unsupported_spaces_naming_them(space):
    with pytest.raises(ValueError, match=re.escape(str(space))) as info:
        ActionSpec.from_space(space)
    assert "not supported" in str(info.value)


def test_obs_dim_of():
    assert obs_dim_of(gym.spaces.Box(-1.0, 1.0, shape=(3, 4))) == 12
    with pytest.raises(ValueError, match=re.escape(str(gym.spaces.Discrete(5)))):
        obs_dim_of(gym.spaces.Discrete(5))


def test_closed_form_logp_and_entropy_match_torch_distributions():
    """The learner's closed-form log-probabilities and entropies equal torch.distributions' on the same inputs."""
    gen = torch.Generator().manual_seed(0)
    mean, log_std = torch.randn(5, 3, generator=gen), torch.randn(3, generator=gen)
    actions = torch.randn(5, 3, generator=gen)
    logp, entropy = gaussian_logp_entropy(mean, log_std, actions)
    normal = torch.distributions.Normal(mean, log_std.exp().expand_as(mean))
    torch.testing.assert_close(logp, normal.log_prob(actions).sum(-1))
    torch.testing.assert_close(entropy, normal.entropy().sum(-1))

    logits, picks = torch.randn(5, 4, generator=gen), torch.tensor([0, 3, 1, 2, 3])
    logp, entropy = categorical_logp_entropy(logits, picks)
    categorical = torch.distributions.Categorical(logits=logits)
    torch.testing.assert_close(logp, categorical.log_prob(picks))
    torch.testing.assert_close(entropy, categorical.entropy())


def test_a_prompt_through_the_chat_template_is_the_token_ids_of_the_rendered_turn():
    from rlfabric.models.hf import build_char_tokenizer, encode_prompt

    tokenizer = build_char_tokenizer()
    # the character template: "user: " + text + "<eos>\n", then the assistant's turn opened
    rendered = "user: 1+2=<eos>\nassistant: "
    expected = tokenizer(rendered, add_special_tokens=False).input_ids
    assert encode_prompt(tokenizer, "1+2=", chat_template=True) == expected
    assert (
        encode_prompt(tokenizer, "1+2=", chat_template=False) == tokenizer("1+2=", add_special_tokens=False).input_ids
    )


def test_the_modules_runners_import_never_load_torch():
    """PPO and game runners act with the numpy actor: torch stays out of their processes (a game's language-model
    player loads it only where one plays)."""
    import subprocess
    import sys

    check = (
        "import sys, rlfabric.actors.env_runner, rlfabric.actors.game_runner, rlfabric.models;"
        "from rlfabric.models import ActionSpec, NumpyPolicy;"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('rlfabric'))"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
