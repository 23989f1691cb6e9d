"""Issue 32: advantages, the clipped loss and the rewards registry against hand-worked examples."""

import jax.numpy as jnp
import numpy as np
import pytest

from valen_jax.reinforce import rewards as R
from valen_jax.reinforce.objective import clipped_loss, group_advantages


def test_group_advantages_by_hand():
    # two groups of G=2: rewards (1, 0) -> mean .5, std .5 -> (+1, -1); (1, 1) -> zero variance -> (0, 0)
    a = group_advantages(jnp.array([1.0, 0.0, 1.0, 1.0]), 2)
    np.testing.assert_allclose(np.asarray(a), [1.0, -1.0, 0.0, 0.0], atol=1e-5)
    # Dr.GRPO: no division by the std
    a = group_advantages(jnp.array([1.0, 0.0, 3.0, 1.0]), 2, scale_by_std=False)
    np.testing.assert_allclose(np.asarray(a), [0.5, -0.5, 1.0, -1.0], atol=1e-6)


def test_clipped_loss_by_hand():
    old = jnp.zeros((2, 2))
    # seq 0, A=+1: ratios 1.5 (clipped to 1.2) and 1 -> terms -1.2, -1
    # seq 1, A=-1: ratio 0.5 -> min(-0.5, 0.8*-1) = -0.8 -> term +0.8; its 2nd token is masked out
    logp = jnp.log(jnp.array([[1.5, 1.0], [0.5, 7.0]]))
    mask = jnp.array([[1, 1], [1, 0]])
    loss, stats = clipped_loss(logp, old, jnp.array([1.0, -1.0]), mask, clip_eps=0.2)
    np.testing.assert_allclose(float(loss), (-1.2 - 1.0 + 0.8) / 3, rtol=1e-6)  # token-level mean over 3 tokens
    np.testing.assert_allclose(float(stats["clip_fraction"]), 2 / 3, rtol=1e-6)
    # k3 KL to a reference equal to the policy is 0, and adds nothing
    loss_kl, stats = clipped_loss(logp, old, jnp.array([1.0, -1.0]), mask, 0.2, ref_logp=logp, kl_coef=0.5)
    np.testing.assert_allclose(float(loss_kl), float(loss), rtol=1e-6)
    assert float(stats["kl"]) == 0.0


def test_rewards_read_the_assistant_message():
    gold = {"role": "assistant", "content": "42"}
    assert R.exact("42", gold) == 1.0 and R.exact("42.", gold) == 0.0
    assert R.normalised("42.", gold) == 1.0
    assert R.json_equal('{"a": [1, 2]}', {"content": '{ "a":[1,2] }'}) == 1.0
    assert R.json_equal("not json", gold) == 0.0
    with pytest.raises(ValueError, match="reward 'json': the assistant message is not JSON"):
        R.json_equal("{}", {"content": "forty-two"})
    call = {"tool_calls": [{"function": {"name": "f", "arguments": '{"x": 1}'}}]}
    # evaluate's tool-call exact match: calls parsed from the template's rendering, compared in order
    chatml = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    assert R.tool_call(chatml, call) == 1.0
    assert R.tool_call(chatml.replace('"x": 1', '"x": 2'), call) == 0.0
    assert R.tool_call('[{"name": "f", "arguments": {"x": 1}}]', call) == 0.0  # a bare JSON list is no call
    assert R.tool_call('{"name": "f", "parameters": {"x": 1}}', call, family="llama3") == 1.0
    two = {"tool_calls": [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]}
    g_call = '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    assert R.tool_call(chatml + g_call, two) == 1.0 and R.tool_call(g_call + chatml, two) == 0.0  # order counts
    (_, fn, _), = R.resolve({"tool_call": 1.0}, family="llama3")
    assert fn('{"name": "f", "parameters": {"x": 1}}', call, True) == 1.0 and fn(chatml, call, True) == 0.0
    total, each = R.score(R.resolve({"exact": 1.0, "normalised": 0.5}), "42", gold, True)
    assert total == 1.5 and each == {"exact": 1.0, "normalised": 1.0}
    with pytest.raises(ValueError, match="config.rl.rewards: unknown reward 'bleu'"):
        R.resolve({"bleu": 1.0})


def test_refusals_name_the_row(tmp_path):
    from ml_collections import ConfigDict

    from valen_jax.errors import ConfigError
    from valen_jax.reinforce.refusals import check_not_prepared, prompts

    config = ConfigDict({"data": {"format": "prepared", "eval_format": "prepared"}})
    with pytest.raises(ConfigError, match="config.data.format='prepared': a reinforcement run reads prompts"):
        check_not_prepared(config)
    path = tmp_path / "train.jsonl"
    ok = '{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}\n'
    path.write_text(ok + '{"messages": [{"role": "user", "content": [{"type": "image", "path": "a.png"}]}]}\n')
    with pytest.raises(ConfigError, match=rf"{path}:2: message 0 holds an image"):
        list(prompts(path))
    path.write_text(ok + '{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ConfigError, match=rf"{path}:2: no assistant message"):
        list(prompts(path))
    path.write_text(ok)
    [(prompt, gold, where)] = list(prompts(path))
    assert prompt == [{"role": "user", "content": "1+1"}] and gold["content"] == "2" and where == f"{path}:1"


def test_arithmetic_task_is_deterministic_and_disjoint():
    import importlib.util

    spec = importlib.util.spec_from_file_location("rl_arith_make", "data/rl_arith/make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    train, eval_ = make.make(300, 50, seed=0)
    assert (train, eval_) == make.make(300, 50, seed=0)
    prompts = lambda rows: {r["messages"][0]["content"] for r in rows}  # noqa: E731
    assert len(train) == 300 and len(eval_) == 50 and not prompts(train) & prompts(eval_)
    for row in train[:20]:
        question, answer = row["messages"][0]["content"], row["messages"][1]["content"]
        assert str(eval(question.rstrip("="))) == answer  # the gold answer is exact


def test_model_grader_on_a_scripted_grader():
    from valen_jax.reinforce.grader import grade

    seen = []

    def scripted(conversations):  # grades by reading the completion and the gold out of the prompt
        seen.extend(conversations)
        out = []
        for conv in conversations:
            user = conv[1]["content"]
            completion = user.split("Completion:\n")[1].split("\n\nGold answer:")[0]
            gold = user.split("Gold answer:\n")[1].split("\n\nScore")[0]
            out.append("Score: 1" if completion == gold else ("0.25 partly" if gold in completion else "no idea"))
        return out

    prompt = [{"role": "user", "content": "2+2="}]
    gold = {"role": "assistant", "content": "4"}
    scores, unparsed = grade(scripted, "Grade the answer.", [(prompt, "4", gold), (prompt, "it is 4", gold),
                                                             (prompt, "5", gold)])
    assert scores == [1.0, 0.25, 0.0] and unparsed == 1
    assert seen[0][0] == {"role": "system", "content": "Grade the answer."} and "2+2=" in seen[0][1]["content"]
    with pytest.raises(ValueError, match="grader_instructions is empty"):
        grade(scripted, " ", [(prompt, "4", gold)])


def test_rl_settings_checks_seeds_and_metrics():
    from valen_jax.errors import ConfigError
    from valen_jax.reinforce.settings import check, defaults, rollout_metrics, rollout_seeds

    rl = defaults()
    check(rl)
    rl.group_size = 1
    with pytest.raises(ConfigError, match="config.rl.group_size=1: group-relative"):
        check(rl)
    rl = defaults()
    rl.rewards = {"bleu": 1.0}
    with pytest.raises(ConfigError, match="config.rl.rewards.bleu: unknown reward"):
        check(rl)
    # a resumed run restores its step, hence its seeds
    assert (rollout_seeds(0, 5, 4) == rollout_seeds(0, 5, 4)).all()
    assert not (rollout_seeds(0, 5, 4) == rollout_seeds(0, 6, 4)).all()
    m = rollout_metrics({"exact": [1, 0, 1, 1]}, [1, 0, 1, 1], [1, -1, 0, 0], [2, 4, 3, 3], group_size=2)
    assert m["zero_variance_groups"] == 0.5 and m["reward/exact/mean"] == 0.75 and m["completion_length/mean"] == 3


def test_token_log_probs_agree_with_the_supervised_loss():
    import jax

    from valen_jax.reinforce.objective import token_log_probs
    from valen_jax.training.losses import token_losses

    logits = jax.random.normal(jax.random.key(0), (2, 3, 5))
    targets = jnp.array([[0, 4, 2], [1, 1, 3]])
    weights = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    lp = token_log_probs(logits, targets)
    np.testing.assert_allclose(-float((lp * weights).sum()), float(token_losses(logits, targets, weights)["ce"]),
                               rtol=1e-6)


def test_token_log_probs_are_those_of_the_distribution_the_rollout_samples_from():
    """The sampler draws from softmax(logits / temperature) over ids < vocab (`decoding.sampling`); the
    policy's log-probabilities must be that distribution's, or a temperature other than 1 (or the
    embedding's padding rows) clips and differentiates another policy than the one that drew."""
    import jax

    from valen_jax.decoding.sampling import Sampling, sample
    from valen_jax.reinforce.objective import token_log_probs

    logits = 2.0 * jax.random.normal(jax.random.key(1), (1, 1, 8))  # ids 6 and 7: padding rows
    vocab, temperature = 6, 0.5
    # every id < vocab as the target of one position
    lp = token_log_probs(jnp.broadcast_to(logits, (1, vocab, 8)), jnp.arange(vocab)[None], temperature, vocab)[0]
    np.testing.assert_allclose(float(jnp.exp(lp).sum()), 1.0, rtol=1e-5)  # the ids < vocab hold all the mass
    draws = 40_000
    keys = jax.random.split(jax.random.key(2), draws)
    drawn = sample(jnp.broadcast_to(logits[0, 0], (draws, 8)), keys, Sampling(temperature=temperature), vocab)
    frequencies = np.bincount(np.asarray(drawn), minlength=8) / draws
    assert frequencies[vocab:].sum() == 0
    # 40,000 draws: a frequency's std is at most 0.0025
    np.testing.assert_allclose(frequencies[:vocab], np.exp(np.asarray(lp)), atol=0.01)
    # the raw logits' softmax over every row (what the ratio read before) is another distribution here
    assert not np.allclose(frequencies, np.asarray(jax.nn.softmax(logits[0, 0])), atol=0.01)


def test_the_objective_trains_a_toy_policy():
    """A one-token policy over 4 answers, reward 1 for answer 2: rollouts of G=8, advantages, two
    clipped steps per rollout with the old log-probs from rollout time; the right answer's
    probability climbs from 1/4 past 0.9."""
    import jax

    from valen_jax.reinforce.objective import token_log_probs

    theta = jnp.zeros(4)

    def logp(theta, actions):
        return token_log_probs(jnp.broadcast_to(theta, (actions.shape[0], 1, 4)), actions[:, None])

    grad = jax.jit(jax.grad(lambda t, a, old, adv: clipped_loss(logp(t, a), old, adv, jnp.ones_like(old), 0.2)[0]))
    for step in range(40):
        actions = jax.random.categorical(jax.random.key(step), theta, shape=(8,))
        old = logp(theta, actions)
        adv = group_advantages((actions == 2).astype(jnp.float32), 8)
        for _ in range(2):
            theta = theta - 0.5 * grad(theta, actions, old, adv)
    assert float(jax.nn.softmax(theta)[2]) > 0.9
