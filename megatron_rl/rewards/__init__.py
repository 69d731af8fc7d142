"""Reward functions: a registry chosen by name in config, user functions by `module:function`.

    reward = Reward(RewardConfig(name="reasoning_gym"))   # registry.py; the config section is config.py
    result = reward(response_text, prompt)        # RewardResult(reward, correct, extracted, error)
    if not result.ok: count and skip the sample   # a raising reward never kills the run

`extract.py` finds the final answer in a response; `math_answer.py` compares answers with math-verify.
"""
