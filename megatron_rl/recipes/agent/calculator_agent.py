"""An agent written against the OpenAI API, as users write theirs: a plain loop over the official `openai`
client that asks the model, runs the tool calls it writes, and asks again until it answers. The recipe
trains it through its server (docs/agents.md):

    megatron-rl train examples/configs/agent_calculator.yaml \
        agent.openai_agent=megatron_rl.recipes.agent.calculator_agent:calculator_agent

The task, its tools and its worked examples are the calculator recipe's own (ToolEnvironment), so the two
ways of training the same agent can be compared."""
from __future__ import annotations

import dataclasses

from megatron_rl.data.prompts import Prompt
from megatron_rl.data.tool_calls import template_renders_tools
from megatron_rl.recipes.agent.config import AgentConfig
from megatron_rl.recipes.agent.recipe import environment_factory


def calculator_agent(config: AgentConfig, tokenizer):
    """agent(client, model, prompt) -> reward, for `agent.openai_agent`."""
    make_environment = environment_factory(dataclasses.replace(config, openai_agent=""), tokenizer)
    template = tokenizer.chat_template
    renders_tools = any(template_renders_tools(t) for t in (template.values() if isinstance(template, dict)
                                                            else [template]))

    def agent(client, model: str, prompt: Prompt) -> float:
        env = make_environment()
        try:
            messages = env.reset(prompt)
            tools = {"tools": [tool.schema() for tool in env.tools]} if renders_tools and env.tools else {}
            while True:
                reply = client.chat.completions.create(model=model, messages=messages, **tools)
                text = reply.choices[0].message.content or ""
                step = env.step(text)
                if step.done:
                    return float(step.reward or 0.0)
                messages += [{"role": "assistant", "content": text}, *step.messages]
        finally:
            env.close()
    return agent
