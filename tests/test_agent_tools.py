"""Agent tools and tool-call formats (megatron_rl/recipes/agent/tools.py): parsing each template family's
tool calls (malformed ones become error lines, never exceptions), round trips through the published chat
templates rendered by transformers' apply_chat_template, and the calculator against Python's own
arithmetic."""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from megatron_rl.config import ConfigError
from megatron_rl.data.tool_calls import (
    FORMATS,
    ToolCall,
    template_renders_tools,
    tool_call_format,
    tool_call_format_for,
)
from megatron_rl.models.pretrained import smollm2_gguf_path
from megatron_rl.recipes.agent.sandbox import Sandbox, SandboxLimits
from megatron_rl.recipes.agent.tools import (
    Calculator,
    ExpressionError,
    PythonTool,
    echo_last_expression,
    evaluate_arithmetic,
    hermes_tools_prompt,
    run_tool_call,
)

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
HERMES, LLAMA3, MISTRAL = FORMATS["hermes"], FORMATS["llama3_json"], FORMATS["mistral"]


# --- parsing ---------------------------------------------------------------------------------------------
def test_hermes_calls_content_and_errors():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
            '<tool_call>{"arguments": {}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
            '<tool_call>["calculator"]</tool_call> done')
    parsed = HERMES.parse(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "2+2"}),
                                                             ("python", {"code": "print(1)"})]
    assert parsed.calls[0].text.startswith("<tool_call>") and parsed.calls[0].text.endswith("</tool_call>")
    assert parsed.content == "Let me compute.\n\n done"
    assert [e.split(":")[0] for e in parsed.errors] == ["tool call 3", "tool call 4", "tool call 5", "tool call 6"]
    assert "invalid JSON" in parsed.errors[0]
    assert "missing the string field 'name'" in parsed.errors[1]
    assert "'arguments' must be a JSON object, got list" in parsed.errors[2]
    assert "expected a JSON object, got list" in parsed.errors[3]
    assert all("\n" not in e for e in parsed.errors)


def test_hermes_unclosed_call():
    """A generation cut at a stop string may lack </tool_call>: a complete JSON body still counts."""
    parsed = HERMES.parse('<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n')
    assert [c.name for c in parsed.calls] == ["calculator"] and parsed.errors == []
    broken = HERMES.parse('<tool_call>\n{"name": "calculator", "argu')
    assert broken.calls == [] and broken.errors[0].startswith("tool call 1: <tool_call> without </tool_call>")
    assert HERMES.parse("no calls here").calls == [] and HERMES.parse("no calls here").content == "no calls here"
    next_call = HERMES.parse('<tool_call>{"name": "a"<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert [c.name for c in next_call.calls] == ["b"]
    assert next_call.errors[0].startswith("tool call 1: <tool_call> without")


def test_llama3_json_calls():
    parsed = LLAMA3.parse('{"name": "calculator", "parameters": {"expression": "3*3"}}')
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "3*3"})]
    tagged = LLAMA3.parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}')
    assert [(c.name, c.arguments) for c in tagged.calls] == [("a", {}), ("b", {"x": 1})] and tagged.errors == []
    plain = LLAMA3.parse("The answer is 9.")
    assert plain.calls == [] and plain.errors == [] and plain.content == "The answer is 9."
    bad = LLAMA3.parse('{"name": "calculator", "parameters": {"expression": "3*3"}')
    assert bad.calls == [] and bad.errors[0].startswith("tool call 1: invalid JSON")
    trailing = LLAMA3.parse('{"name": "a", "parameters": {}} and some words')
    assert [c.name for c in trailing.calls] == ["a"] and trailing.errors[0].startswith("tool call 2: invalid JSON")
    assert LLAMA3.parse("<|python_tag|>brave_search.call(query='x')").errors == [
        "tool call 1: <|python_tag|> not followed by a JSON object"]


def test_mistral_calls():
    parsed = MISTRAL.parse('Sure. [TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "7-1"}, '
                           '"id": "abcDEF123"}, {"name": "python", "arguments": {"code": "1"}}]')
    assert [(c.name, c.arguments, c.id) for c in parsed.calls] == [
        ("calculator", {"expression": "7-1"}, "abcDEF123"), ("python", {"code": "1"}, None)]
    assert parsed.content == "Sure." and parsed.errors == []
    assert MISTRAL.parse('[TOOL_CALLS] {"name": "a", "arguments": {}}').calls[0].name == "a"
    assert MISTRAL.parse("[TOOL_CALLS] [").errors[0].startswith("tool call 1: invalid JSON after [TOOL_CALLS]")
    assert MISTRAL.parse("[TOOL_CALLS] []").errors == ["tool call 1: empty list after [TOOL_CALLS]"]
    mixed = MISTRAL.parse('[TOOL_CALLS] [{"name": "a", "arguments": {}}, {"nom": "b"}] extra')
    assert [c.name for c in mixed.calls] == ["a"]
    assert mixed.errors[0] == "tool call 2: missing the string field 'name'"
    assert mixed.errors[1].startswith("tool call 3: unexpected text after the call list")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(list('{}[]":,; \nabc1') + ["<tool_call>", "</tool_call>", "[TOOL_CALLS]",
                                                           "<|python_tag|>", '"name"', '"arguments"']),
                max_size=40).map("".join))
def test_parse_never_raises(text):
    for fmt in FORMATS.values():
        parsed = fmt.parse(text)
        assert all(isinstance(call.arguments, dict) and call.name for call in parsed.calls)
        assert all(isinstance(error, str) and "\n" not in error for error in parsed.errors)


def test_format_choice():
    def template(name):
        return (TEMPLATES / name).read_text()
    assert tool_call_format_for(template("Qwen-Qwen2.5-7B-Instruct.jinja")).name == "hermes"
    assert tool_call_format_for(template("Qwen-Qwen3-0.6B.jinja")).name == "hermes"
    assert tool_call_format_for(template("meta-llama-Llama-3.1-8B-Instruct.jinja")).name == "llama3_json"
    assert tool_call_format_for(template("meta-llama-Llama-3.2-3B-Instruct.jinja")).name == "llama3_json"
    assert tool_call_format_for(template("mistralai-Mistral-7B-Instruct-v0.3.jinja")).name == "mistral"
    assert tool_call_format_for(None).name == "hermes"
    assert all(template_renders_tools(template(f.name)) for f in TEMPLATES.glob("*.jinja"))
    assert not template_renders_tools(None)
    with pytest.raises(ConfigError, match="unknown format 'xml'.*hermes"):
        tool_call_format("xml")


# --- round trips through the published templates ------------------------------------------------------
# Qwen3 renders an empty thinking block into the last assistant turn (its template's text)
THINKING_PREFIX = {"qwen3": "<think>\n\n</think>\n\n"}
FAMILIES = {  # template file, bos, eos, the end-of-turn text after an assistant's tool call
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", None, "<|im_end|>", "<|im_end|>\n"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", None, "<|im_end|>", "<|im_end|>\n"),
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "llama3.2": ("meta-llama-Llama-3.2-3B-Instruct.jinja", "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "mistral": ("mistralai-Mistral-7B-Instruct-v0.3.jinja", "<s>", "</s>", "</s>"),
}


def _tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A word-level tokenizer carrying only the family's template and special tokens: rendering is text."""
    file, bos, eos, _ = FAMILIES[family]
    vocab = {"<unk>": 0, eos: 1} | ({bos: 2} if bos else {})
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
                                   chat_template=(TEMPLATES / file).read_text(), bos_token=bos, eos_token=eos,
                                   unk_token="<unk>")


def _render(tokenizer, messages, tools, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tool_call_round_trip_through_the_template(family):
    tokenizer = _tokenizer(family)
    fmt = tool_call_format_for(tokenizer.chat_template)
    tools = [Calculator(), PythonTool()]
    schemas = [tool.schema() for tool in tools]
    call = ToolCall("calculator", {"expression": "12345*6789", "note": "ünïcode \"quoted\""})
    # Mistral's template puts the system text into the last user turn only: no system message there
    prompt = ([] if family == "mistral" else [{"role": "system", "content": "Use tools."}]) + [
        {"role": "user", "content": "What is 12345*6789?"}]
    before = _render(tokenizer, prompt, schemas, add_generation_prompt=family != "mistral")
    for tool in tools:  # the template rendered our schemas
        assert tool.name in before and tool.description in before
    with_call = prompt + [fmt.assistant_message("", [call])]
    rendered = _render(tokenizer, with_call, schemas)
    assert rendered.startswith(before)
    turn = rendered[len(before):]
    end_of_turn = FAMILIES[family][3]
    assert turn.endswith(end_of_turn)
    generated = turn[: -len(end_of_turn)]
    assert generated == THINKING_PREFIX.get(family, "") + fmt.render_call(call)
    parsed = fmt.parse(generated)
    assert parsed.errors == [] and [(c.name, c.arguments) for c in parsed.calls] == [(call.name, call.arguments)]
    # the tool's answer renders as the template's tool turn, holding the content
    answer = "83810205"
    full = _render(tokenizer, with_call + [fmt.tool_message(parsed.calls[0], answer)], schemas)
    assert full.index(fmt.render_call(call)) < full.rindex(answer)
    if family == "mistral":
        assert f'[TOOL_RESULTS] {{"content": "{answer}", "call_id": "{parsed.calls[0].id}"}}[/TOOL_RESULTS]' in full


def test_qwen_renders_schemas_verbatim():
    tokenizer = _tokenizer("qwen2.5")
    schema = Calculator().schema()
    text = _render(tokenizer, [{"role": "user", "content": "hi"}], [schema])
    assert "<tools>\n" + json.dumps(schema, ensure_ascii=False) + "\n</tools>" in text


def test_hermes_prompt_for_templates_without_tools():
    prompt = hermes_tools_prompt([Calculator()])
    assert json.dumps(Calculator().schema()) in prompt and "<tool_call>" in prompt


def test_render_call_round_trips_in_every_format():
    call = ToolCall("python", {"code": "print('a\\nb')", "n": [1, 2.5, None, True], "deep": {"x": {"y": "}"}}})
    for fmt in FORMATS.values():
        parsed = fmt.parse(fmt.render_call(call))
        assert parsed.errors == [] and [(c.name, c.arguments) for c in parsed.calls] == [(call.name, call.arguments)]


@pytest.mark.parametrize("name", list(FORMATS))
def test_call_openings_and_where_a_call_may_start(name):
    """A call rendered after an opening parses to the call; streaming never lets out as content a character
    of a call: at every prefix of a turn, `call_start` is at or before where the call begins."""
    fmt = FORMATS[name]
    call = ToolCall("python", {"code": "print(1)"})
    rendered = fmt.render_call(call)
    for opening in (fmt.call_opening(None), fmt.call_opening("python")):
        assert rendered.startswith(opening.rstrip())
        parsed = fmt.parse(opening + rendered[len(opening):])
        assert [(c.name, c.arguments) for c in parsed.calls] == [(call.name, call.arguments)]
    preamble = "" if name == "llama3_json" else "Let me run it: {x} <b>\n"
    turn = preamble + rendered
    for end in range(len(turn) + 1):
        assert fmt.call_start(turn[:end]) <= min(end, len(preamble) if end > len(preamble) else end)
    assert fmt.call_start("Plain answer.") == len("Plain answer.") and fmt.call_start("") == 0

# --- running calls ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxLimits(wall_time_s=10.0)) as box:
        yield box


def test_run_tool_call_errors_never_raise(sandbox):
    tools = {tool.name: tool for tool in (Calculator(), PythonTool())}
    assert run_tool_call(ToolCall("search", {}), tools, sandbox).error == \
        "unknown tool 'search' (available: calculator, python)"
    assert run_tool_call(ToolCall("calculator", {}), tools, sandbox).error == \
        "calculator: missing required argument 'expression'"
    assert run_tool_call(ToolCall("calculator", {"expression": 5}), tools, sandbox).error == \
        "calculator: argument 'expression' must be string, got int"
    extra = run_tool_call(ToolCall("calculator", {"expression": "1", "mode": "x"}), tools, sandbox)
    assert extra.error == "calculator: unknown argument 'mode' (expected expression)"
    assert extra.content == "Error: " + extra.error

    class Broken(Calculator):
        name = "broken"

        def run(self, arguments, sandbox):
            raise RuntimeError("bug in the tool")
    assert run_tool_call(ToolCall("broken", {"expression": "1"}), {"broken": Broken()}, sandbox).error == \
        "broken failed: RuntimeError: bug in the tool"


def test_calculator_in_the_sandbox(sandbox):
    calculator = Calculator()
    assert calculator.run({"expression": "12345*6789"}, sandbox).content == str(12345 * 6789)
    assert calculator.run({"expression": "2**4000 - 1"}, sandbox).content == str(2**4000 - 1)
    assert calculator.run({"expression": "1/0"}, sandbox).error == "division by zero"
    assert calculator.run({"expression": "10**10**10"}, sandbox).error.startswith("result too large")
    assert calculator.run({"expression": "__import__('os').system('true')"}, sandbox).error.startswith(
        "unsupported syntax")


def test_python_tool(sandbox):
    python = PythonTool()
    assert python.run({"code": "x = 21\nx * 2"}, sandbox).content == "42"
    assert python.run({"code": "print('hi')"}, sandbox).content == "hi"
    assert python.run({"code": "x = 1"}, sandbox).content == "(no output)"
    failed = python.run({"code": "a = 1\n\nb = a / 0\nb"}, sandbox)
    assert failed.error == "ZeroDivisionError: division by zero"
    assert 'line 3' in failed.content and failed.content.endswith("Error: ZeroDivisionError: division by zero")
    with Sandbox(SandboxLimits(wall_time_s=1.0)) as short:
        assert python.run({"code": "while True: pass"}, short).error == "timed out after 1 s"


def test_echo_last_expression_keeps_lines():
    code = "x = 2\ny = [x,\n     x * 3]\ny"
    echoed = echo_last_expression(code)
    assert len(echoed.splitlines()) == len(code.splitlines())
    assert echo_last_expression("print(1)") == "print(1)" and echo_last_expression("x = (") == "x = ("
    assert ast.parse(echo_last_expression("a = 1; a")) is not None


# --- the calculator against Python ----------------------------------------------------------------------
NUMBERS = st.one_of(st.integers(-10**40, 10**40), st.floats(-1e6, 1e6, allow_nan=False).map(abs))


@st.composite
def expressions(draw, depth=3):
    if depth == 0 or draw(st.booleans()):
        number = draw(NUMBERS)
        return repr(number) if number >= 0 else f"({number!r})"
    op = draw(st.sampled_from(["+", "-", "*", "/", "//", "%", "**", "neg"]))
    if op == "neg":
        return f"-({draw(expressions(depth - 1))})"
    left = draw(expressions(depth - 1))
    right = str(draw(st.integers(0, 12))) if op == "**" else draw(expressions(depth - 1))
    return f"({left}) {op} ({right})"


@pytest.fixture
def unlimited_int_digits():
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    yield
    sys.set_int_max_str_digits(limit)


@settings(max_examples=200, deadline=None)
@given(expressions())
def test_calculator_matches_python(expression):
    with_unlimited_digits = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        try:
            expected = eval(expression, {"__builtins__": {}})  # the reference: Python's own arithmetic
        except ZeroDivisionError:
            with pytest.raises(ExpressionError, match="division by zero"):
                evaluate_arithmetic(expression)
            return
        except OverflowError:
            with pytest.raises(ExpressionError, match="too large"):
                evaluate_arithmetic(expression)
            return
        if isinstance(expected, complex):
            with pytest.raises(ExpressionError, match="not a real number"):
                evaluate_arithmetic(expression)
            return
        assert evaluate_arithmetic(expression) == (str(expected) if isinstance(expected, int) else repr(expected))
    finally:
        sys.set_int_max_str_digits(with_unlimited_digits)


@pytest.mark.parametrize("expression, message", [
    ("", "empty expression"), ("2 +", "not an arithmetic expression"), ("abs(-1)", "unsupported syntax"),
    ("True + 1", "unsupported constant True"), ("'a' * 3", "unsupported constant 'a'"), ("1 << 5", "unsupported"),
    ("9 ** 9 ** 9", "result too large"), ("(10 ** 200000) * (10 ** 200000)", "result too large"),
    ("2.0 ** 5000", "result too large")])
def test_calculator_refusals(expression, message):
    with pytest.raises(ExpressionError, match=message):
        evaluate_arithmetic(expression)


def test_calculator_big_integers_are_exact(unlimited_int_digits):
    assert evaluate_arithmetic("2 ** 30000 // 3 ** 100") == str(2 ** 30000 // 3 ** 100)  # 9000+ digits
    assert evaluate_arithmetic("-(7) ** 2") == "-49" and evaluate_arithmetic("(-7) ** 2") == "49"


@pytest.mark.slow  # reading the GGUF's metadata takes seconds
def test_smollm2_template_uses_hermes_in_the_system_prompt():
    """SmolLM2's template ignores `tools` and `tool_calls`: hermes is the default, the tools go into the
    system prompt, and a call generated as plain assistant text parses back."""
    field = gguf.GGUFReader(smollm2_gguf_path()).fields["tokenizer.chat_template"]
    template = bytes(field.parts[field.data[0]]).decode("utf-8")
    assert not template_renders_tools(template) and tool_call_format_for(template).name == "hermes"
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0, "<|im_end|>": 1},
                                                                                    unk_token="<unk>")),
                                        chat_template=template, eos_token="<|im_end|>", unk_token="<unk>")
    call = ToolCall("calculator", {"expression": "12345*6789"})
    prompt = [{"role": "system", "content": hermes_tools_prompt([Calculator()])},
              {"role": "user", "content": "What is 12345*6789?"}]
    before = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert json.dumps(Calculator().schema()) in before
    rendered = tokenizer.apply_chat_template(prompt + [{"role": "assistant", "content": HERMES.render_call(call)}],
                                             tokenize=False)
    parsed = HERMES.parse(rendered[len(before):])
    assert [(c.name, c.arguments) for c in parsed.calls] == [(call.name, call.arguments)]
