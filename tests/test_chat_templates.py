"""Chat prompts are rendered and tokenized exactly as transformers' `apply_chat_template` does, for the
published templates of Llama 3.1/3.2, Qwen2.5, Qwen3, Mistral v0.3 (tests/fixtures/chat_templates/), Gemma 3
(examples/chat_templates/, which the project ships) and
SmolLM2's (from its GGUF, read by our loader and compared with transformers' own GGUF loader).

The reference side is always transformers loaded independently of our code: `AutoTokenizer` on an HF
directory that transformers itself wrote (`save_pretrained`), or on the GGUF file. The vocabulary is
SmolLM2's for every family (no hub here), with each family's control tokens added as special tokens so
the ids of the template's markers are single, meaningful tokens.
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import json
import logging
import os
import pickle
import re
from pathlib import Path

import gguf
import pytest
from jinja2 import TemplateError
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils

from megatron_rl.config import ConfigError
from megatron_rl.data.tokenizer import ChatTokenizer
from tests.chat_families import FAMILIES, Family, save_family_tokenizer
from megatron_rl.models.gguf import read_gguf_tokenizer
from megatron_rl.models.pretrained import smollm2_gguf_path

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather in a city: \"quoted\", <b>html</b> & 'apostrophes', café ☀",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name, e.g. Zürich"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers (keys deliberately not sorted)",
        "parameters": {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}},
                       "required": ["b", "a"]}}},
]
TOOL_CALL = {"id": "call00001", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}}
FROZEN_NOW = datetime.datetime(2025, 2, 3, 10, 30)
NAMED_MARKER = "Tool-use variant.\n"


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly."}


@dataclasses.dataclass
class Case:
    messages: list
    kwargs: dict = dataclasses.field(default_factory=dict)  # passed to both sides
    ours_only: dict = dataclasses.field(default_factory=dict)  # ChatTokenizer(...) options for our side
    ours_default_generation_prompt: bool = False  # call ours without add_generation_prompt (default: on)
    expect_in_text: tuple[str, ...] = ()
    freeze_date: bool = False
    refused: bool = False  # the template raises (raise_exception): we must raise ConfigError with its message


def _cases(name: str, family: Family, template: str) -> dict[str, Case]:
    renders_tools = "tools" in template
    cases = {
        "user": Case([_user("What is 17 + 25?")], {"add_generation_prompt": True}),
        "default-generation-prompt": Case([_user("What is 17 + 25?")], {"add_generation_prompt": True},
                                          ours_default_generation_prompt=True),
        "system": Case([SYSTEM, _user("Name three prime numbers.")], {"add_generation_prompt": True}),
        "multi-turn": Case([SYSTEM, _user("Hi!"), _assistant("Hello, how can I help?"), _user("What is 2 + 2?")],
                           {"add_generation_prompt": True}),
        "no-generation-prompt": Case([_user("What is 2 + 2?"), _assistant("4")], {"add_generation_prompt": False}),
        "continue-final-message": Case([_user("Count to five."), _assistant("1, 2, 3")],
                                       {"add_generation_prompt": False, "continue_final_message": True}),
        "non-ascii": Case([_user("Grüße! 你好，世界 🌍 naïve café, مرحبا"), _assistant("Ça va très bien 😊"),
                           _user("¿Qué tal? Ελληνικά, русский,日本語")], {"add_generation_prompt": True},
                          expect_in_text=("你好，世界 🌍", "Ελληνικά")),
        "tools": Case([SYSTEM, _user("What's the weather in Zürich?")], {"add_generation_prompt": True, "tools": TOOLS},
                      # tojson as transformers defines it: no ASCII or HTML escaping
                      expect_in_text=("café ☀", "<b>html</b> & 'apostrophes'") if renders_tools else ()),
        "tool-round-trip": Case([_user("What's the weather in Zürich?"),
                                 {"role": "assistant", "content": "", "tool_calls": [TOOL_CALL]},
                                 {"role": "tool", "tool_call_id": "call00001", "name": "get_weather",
                                  "content": "{\"temperature\": 21, \"sky\": \"clear\"}"},
                                 _assistant("It is 21 °C and clear in Zürich."), _user("And tomorrow?")],
                                {"add_generation_prompt": True, "tools": TOOLS},
                                refused=name == "gemma-3"),  # (its template knows user and model turns only)
        "strftime-now-date": Case([SYSTEM, _user("What day is it?")], {"add_generation_prompt": True},
                                  freeze_date=True,
                                  expect_in_text=() if "strftime_now" not in template
                                  else ("2025-02-03",) if 'strftime_now("%Y-%m-%d")' in template  # (GPT-OSS)
                                  else ("03 Feb 2025",)),
        "date-string-argument": Case([_user("What day is it?")], {"add_generation_prompt": True,
                                                                  "date_string": "01 Jan 2030"},
                                     expect_in_text=("01 Jan 2030",) if "date_string" in template else ()),
        "date-string-instance-option": Case([_user("What day is it?")], {"add_generation_prompt": True,
                                                                         "date_string": "02 Mar 2031"},
                                            ours_only={"chat_template_kwargs": {"date_string": "02 Mar 2031"}}),
        "control-token-in-content": Case([_user(f"Print {family.eos} literally, then stop.")],
                                         {"add_generation_prompt": True}),
        "whitespace": Case([_user("  padded question \n\n"), _assistant("\n  answer with spaces  \n"),
                            _user("next\tone")], {"add_generation_prompt": True}),
        "roles-not-alternating": Case([_user("first"), _user("second")], {"add_generation_prompt": True},
                                      refused=name in ("mistral-v0.3", "gemma-3")),
        "empty-content": Case([_user("")], {"add_generation_prompt": True}),
    }
    if name == "qwen3":
        reasoning = [_user("What is 6 * 7?"),
                     {"role": "assistant", "content": "42", "reasoning_content": "6 * 7 = 42."}]
        cases.update({
            "enable-thinking-false": Case([_user("What is 6 * 7?")], {"add_generation_prompt": True,
                                                                     "enable_thinking": False},
                                          expect_in_text=("<think>\n\n</think>",)),
            "enable-thinking-true": Case([_user("What is 6 * 7?")], {"add_generation_prompt": True,
                                                                    "enable_thinking": True}),
            "enable-thinking-instance-option": Case([_user("What is 6 * 7?")],
                                                    {"add_generation_prompt": True, "enable_thinking": False},
                                                    ours_only={"chat_template_kwargs": {"enable_thinking": False}}),
            "reasoning-content": Case(reasoning, {"add_generation_prompt": False},
                                      expect_in_text=("<think>\n6 * 7 = 42.\n</think>",)),
            "think-in-content": Case([_user("Hi"), _assistant("<think>\nplan\n</think>\n\nHello!"), _user("Again")],
                                     {"add_generation_prompt": True}),
        })
    if name.startswith("llama"):
        cases["tools-in-system-message"] = Case([SYSTEM, _user("Weather in Oslo?")],
                                                {"add_generation_prompt": True, "tools": TOOLS,
                                                 "tools_in_user_message": False})
        cases["two-tool-calls-refused"] = Case([_user("Weather?"), {"role": "assistant",
                                                                   "tool_calls": [TOOL_CALL, TOOL_CALL]}],
                                               {"add_generation_prompt": False, "tools": TOOLS}, refused=True)
    if name == "llama-3.1":
        cases["builtin-tools"] = Case([_user("Search the web for rain.")],
                                      {"add_generation_prompt": True,
                                       "builtin_tools": ["brave_search", "wolfram_alpha", "code_interpreter"]},
                                      expect_in_text=("Tools: brave_search, wolfram_alpha",))
    if name == "mistral-v0.3":
        bad_call = dict(TOOL_CALL, id="call_1")
        cases["tool-call-id-refused"] = Case([_user("Weather?"), {"role": "assistant", "tool_calls": [bad_call]}],
                                             {"add_generation_prompt": False, "tools": TOOLS}, refused=True)
    return cases


def _all_cases():
    for name, family in FAMILIES.items():
        # SmolLM2's template comes from the GGUF at run time; it uses neither tools nor dates.
        template = family.template if family.template_file else ""
        for case_name, case in _cases(name, family, template).items():
            yield pytest.param(name, case, id=f"{name}-{case_name}")


# --- tokenizers built by transformers, independently of our code ------------------------------------------
@pytest.fixture(scope="module")
def gguf_spec():
    path = smollm2_gguf_path()
    spec = read_gguf_tokenizer(gguf.GGUFReader(path), path)
    assert spec.bos_token_id >= 0 and spec.pad_token_id >= 0  # SmolLM2 declares both
    return spec


def _tool_use_variant(template: str) -> str:
    return "{{- " + json.dumps(NAMED_MARKER) + " }}\n" + template


class Pairs:
    """name -> ((ours, reference), (ours, reference) with a named-template list), built on first use.

    Families: an HF directory written by transformers' `save_pretrained` (SmolLM2's vocabulary plus the
    family's control tokens, the family's template); the reference is `AutoTokenizer` on it. The named
    variant is the legacy form many published repos use: a list in tokenizer_config.json. SmolLM2: ours
    is our GGUF loader, the reference transformers' GGUF loader on the same file."""

    def __init__(self, root: Path, spec):
        self.root, self.spec, self.built = root, spec, {}
        self.vocabulary = ChatTokenizer.from_spec(spec).hf_tokenizer.backend_tokenizer.to_str()

    def __getitem__(self, name):
        if name not in self.built:
            self.built[name] = self._smollm2() if name == "smollm2" else self._family(name, FAMILIES[name])
        return self.built[name]

    def dirs(self, name):
        self[name]
        return self.root / name, self.root / f"{name}-named"

    def _family(self, name, family):
        single, named = self.root / name, self.root / f"{name}-named"
        save_family_tokenizer(single, family, self.vocabulary)
        named.mkdir()
        for file in ("tokenizer.json", "tokenizer_config.json"):
            (named / file).write_bytes((single / file).read_bytes())
        config = json.loads((named / "tokenizer_config.json").read_text(encoding="utf-8"))
        config["chat_template"] = [{"name": "default", "template": family.template},
                                   {"name": "tool_use", "template": _tool_use_variant(family.template)}]
        (named / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        return ((ChatTokenizer.from_hf_dir(single), AutoTokenizer.from_pretrained(single)),
                (ChatTokenizer.from_hf_dir(named), AutoTokenizer.from_pretrained(named)))

    def _smollm2(self):
        path = smollm2_gguf_path()
        reference = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        template = reference.chat_template
        named_reference = copy.deepcopy(reference)
        named_reference.chat_template = {"default": template, "tool_use": _tool_use_variant(template)}
        named_spec = dataclasses.replace(self.spec, chat_template=[
            {"name": "default", "template": self.spec.chat_template},
            {"name": "tool_use", "template": _tool_use_variant(self.spec.chat_template)}])
        return ((ChatTokenizer.from_spec(self.spec), reference),
                (ChatTokenizer.from_spec(named_spec), named_reference))


@pytest.fixture(scope="module")
def pairs(tmp_path_factory, gguf_spec):
    return Pairs(tmp_path_factory.mktemp("chat_templates"), gguf_spec)


@pytest.fixture
def frozen_now(monkeypatch):
    class FrozenDatetime(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return FROZEN_NOW

    monkeypatch.setattr(chat_template_utils, "datetime", FrozenDatetime)


def _expect_same(ours: ChatTokenizer, reference, messages, *, template=None, ours_kwargs=None, **kwargs):
    """Our text and ids equal transformers'; where transformers refuses, we refuse with its message."""
    ours_kwargs = kwargs if ours_kwargs is None else ours_kwargs
    try:
        text = reference.apply_chat_template(copy.deepcopy(messages), chat_template=template, tokenize=False,
                                             **kwargs)
        ids = reference.apply_chat_template(copy.deepcopy(messages), chat_template=template, tokenize=True,
                                            return_dict=False, **kwargs)
    except (TemplateError, ValueError) as exc:
        with pytest.raises(ConfigError, match=re.escape(str(exc).splitlines()[0])):
            ours.render_chat(copy.deepcopy(messages), template=template, **ours_kwargs)
        return None
    assert ours.render_chat(copy.deepcopy(messages), template=template, **ours_kwargs) == text
    got = ours.encode_chat(copy.deepcopy(messages), template=template, **ours_kwargs)
    assert got == list(ids), f"first difference at {next(i for i, (a, b) in enumerate(zip(got, ids)) if a != b)}"
    return text


# --- the parity cases ----------------------------------------------------------------------------------
@pytest.mark.parametrize("family,case", list(_all_cases()))
def test_ids_and_text_equal_transformers(request, pairs, family, case):
    if case.freeze_date:
        request.getfixturevalue("frozen_now")
    (ours, reference), _ = pairs[family]
    if case.ours_only:
        ours = ChatTokenizer(ours.hf_tokenizer, source=ours.source, **case.ours_only)
    ours_kwargs = dict(case.kwargs)
    if case.ours_only.get("chat_template_kwargs"):
        for key in case.ours_only["chat_template_kwargs"]:
            ours_kwargs.pop(key)
    if case.ours_default_generation_prompt:
        ours_kwargs.pop("add_generation_prompt")
    text = _expect_same(ours, reference, case.messages, ours_kwargs=ours_kwargs, **case.kwargs)
    assert (text is None) == case.refused
    for piece in case.expect_in_text:
        assert text is not None and piece in text, piece


@pytest.mark.parametrize("family", list(FAMILIES))
def test_named_template_list(pairs, family):
    """default without tools, tool_use picked by transformers when tools are given, and either by name."""
    _, (ours, reference) = pairs[family]
    assert set(ours.chat_template) == {"default", "tool_use"}
    messages = [SYSTEM, _user("What's the weather in Zürich?")]
    plain = _expect_same(ours, reference, messages, add_generation_prompt=True)
    assert not plain.startswith(NAMED_MARKER)
    with_tools = _expect_same(ours, reference, messages, add_generation_prompt=True, tools=TOOLS)
    assert with_tools.startswith(NAMED_MARKER)
    by_name = _expect_same(ours, reference, messages, template="tool_use", add_generation_prompt=True)
    assert by_name.startswith(NAMED_MARKER)
    default_with_tools = _expect_same(ours, reference, messages, template="default", add_generation_prompt=True,
                                      tools=TOOLS)
    assert not default_with_tools.startswith(NAMED_MARKER)
    chosen = ChatTokenizer(ours.hf_tokenizer, template="tool_use", source=ours.source)
    assert chosen.render_chat(messages) == by_name
    with pytest.raises(ConfigError, match=r"no chat template named 'missing' \(named templates: default, tool_use\)"):
        ChatTokenizer(ours.hf_tokenizer, template="missing", source=ours.source)


@pytest.mark.parametrize("family", [f for f in FAMILIES if FAMILIES[f].special or FAMILIES[f].plain])
def test_control_tokens_are_single_ids(pairs, family):
    (ours, reference), _ = pairs[family]
    for token in FAMILIES[family].special + FAMILIES[family].plain:
        ids = ours.encode(token)
        assert ids == [reference.convert_tokens_to_ids(token)] and ids[0] >= 49152, token
    ids = ours.encode_chat([SYSTEM, _user("Hi")])
    # where eos does not end turns
    turn_marker = {"mistral-v0.3": "[INST]", "gemma-3": "<end_of_turn>", "gpt-oss": "<|end|>"}.get(family)
    assert ours.eos_token_id in ids or reference.convert_tokens_to_ids(turn_marker) in ids
    bos = FAMILIES[family].bos
    if bos:
        # The tokenizer prepends BOS to plain text and the template writes it too: a chat prompt has it once.
        bos_id = reference.convert_tokens_to_ids(bos)
        assert reference("Hi")["input_ids"][0] == bos_id
        assert ids[0] == bos_id and ids.count(bos_id) == 1
        assert ours.encode("Hi") == reference.encode("Hi", add_special_tokens=False)


# --- loading, saving, errors ------------------------------------------------------------------------------
def test_hf_dir_with_chat_template_jinja(pairs):
    single, _ = pairs.dirs("qwen3")
    assert os.path.isfile(os.path.join(single, "chat_template.jinja"))
    assert "chat_template" not in json.loads(Path(single, "tokenizer_config.json").read_text(encoding="utf-8"))
    assert ChatTokenizer.from_hf_dir(single).chat_template == FAMILIES["qwen3"].template


def test_named_templates_saved_by_transformers(tmp_path, pairs):
    """transformers writes named templates as chat_template.jinja + additional_chat_templates/*.jinja."""
    _, named = pairs.dirs("llama-3.2")
    AutoTokenizer.from_pretrained(named).save_pretrained(tmp_path)
    assert (tmp_path / "additional_chat_templates" / "tool_use.jinja").is_file()
    ours, reference = ChatTokenizer.from_hf_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    assert ours.chat_template == reference.chat_template and set(ours.chat_template) == {"default", "tool_use"}
    _expect_same(ours, reference, [_user("Weather?")], add_generation_prompt=True, tools=TOOLS)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.parametrize("family", ["smollm2", "qwen3", "mistral-v0.3"])
def test_save_hf_loads_in_transformers_without_warnings(tmp_path, pairs, family):
    (ours, reference), (named, named_reference) = pairs[family]
    handler = _Records()
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        for tokenizer, ref, sub in ((ours, reference, "single"), (named, named_reference, "named")):
            tokenizer.save_hf(tmp_path / sub)
            loaded = AutoTokenizer.from_pretrained(tmp_path / sub)
            assert loaded.chat_template == ref.chat_template
            messages = [SYSTEM, _user("Grüße, what is 2 + 2?")]
            assert loaded.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == \
                tokenizer.encode_chat(messages)
            again = ChatTokenizer.from_hf_dir(tmp_path / sub)
            assert again.encode_chat(messages) == tokenizer.encode_chat(messages)
            assert (again.bos_token_id, again.eos_token_id, again.pad_token_id) == \
                (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    finally:
        logger.removeHandler(handler)
    assert not handler.records, [r.getMessage() for r in handler.records]
    assert (tmp_path / "single" / "chat_template.jinja").is_file()


def test_gguf_tokenizer_matches_transformers_gguf_loader(pairs):
    (ours, reference), _ = pairs["smollm2"]
    assert (ours.bos_token_id, ours.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)
    assert ours.chat_template == reference.chat_template
    text = "Hello world, 12345 + 67.8 = ?\n\tÜber naïve 🌍 <|im_start|>"
    assert ours.encode(text) == reference.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


def test_pickled_tokenizer_renders_the_same(pairs):
    (ours, _), _ = pairs["qwen3"]
    options = ChatTokenizer(ours.hf_tokenizer, chat_template_kwargs={"enable_thinking": False}, source=ours.source)
    back = pickle.loads(pickle.dumps(options))
    messages = [_user("What is 6 * 7?")]
    assert back.encode_chat(messages) == options.encode_chat(messages) != ours.encode_chat(messages)


def test_no_template_and_conflicting_options(pairs, gguf_spec):
    bare = ChatTokenizer.from_spec(dataclasses.replace(gguf_spec, chat_template=None))
    with pytest.raises(ConfigError, match="has no chat template; pass raw prompts instead"):
        bare.encode_chat([_user("hi")])
    (ours, _), _ = pairs["qwen2.5"]
    with pytest.raises(ConfigError, match="add_generation_prompt and continue_final_message exclude each other"):
        ours.render_chat([_user("hi"), _assistant("he")], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ConfigError, match=r"no chat template named 'tool_use' \(named templates: none"):
        ours.render_chat([_user("hi")], template="tool_use")


def test_garbage_tokenizer_json_is_one_line_error(tmp_path, pairs):
    single, _ = pairs.dirs("qwen2.5")
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(single):
        (broken / name).write_bytes(Path(single, name).read_bytes())
    file = broken / "tokenizer.json"
    for garbage in ('{"version": "1.0", "model": {"type": "BPE", "vocab": [1, 2', '{"version": "1.0", "model": [1, 2]}'):
        file.write_text(garbage, "utf-8")
        with pytest.raises(ConfigError) as info:
            ChatTokenizer.from_hf_dir(broken)
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"{file}: not a valid tokenizers file ("), message
    file.write_bytes(Path(single, "tokenizer.json").read_bytes())
    (broken / "tokenizer_config.json").write_text("{\"eos_token\": ", "utf-8")
    with pytest.raises(ConfigError, match=re.escape(f"{broken / 'tokenizer_config.json'}: not valid JSON (")):
        ChatTokenizer.from_hf_dir(broken)


def test_a_run_config_picks_the_template_and_its_variables(pairs):
    """`model.chat_template_kwargs` (e.g. Qwen3's enable_thinking) reach every prompt the run renders."""
    from megatron_rl.config import load_yaml
    from megatron_rl.run_config import RunConfig

    repo = Path(__file__).resolve().parent.parent
    config = load_yaml(RunConfig, str(repo / "examples" / "configs" / "quickstart.yaml"),
                       ["model.chat_template_kwargs={enable_thinking: false}"])
    _, (ours, reference) = pairs["qwen3"]
    ours = pickle.loads(pickle.dumps(ours))  # a private copy: the fixture is shared
    messages = [_user("What is 2 + 2?")]
    thinking = ours.render_chat(messages)
    ours.use_template(config.model.chat_template, config.model.chat_template_kwargs)
    plain = ours.render_chat(messages)
    assert plain != thinking
    assert plain == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  enable_thinking=False)
    with pytest.raises(ConfigError, match="no chat template named 'missing'"):
        ours.use_template("missing", {})


def test_a_template_file_replaces_the_models_own(pairs, tmp_path):
    """`model.chat_template: file.jinja` (a base model without a template, e.g. Gemma-3-270M): resolved beside the
    recipe, checked at config time, rendered by transformers as if the tokenizer had shipped it."""
    from megatron_rl.config import load_yaml
    from megatron_rl.run_config import RunConfig

    repo = Path(__file__).resolve().parent.parent
    config = load_yaml(RunConfig, str(repo / "examples" / "configs" / "quickstart_gemma3.yaml"), [])
    assert os.path.samefile(config.model.chat_template, repo / "examples" / "chat_templates" / "completion.jinja")
    _, (ours, reference) = pairs["qwen3"]
    ours = pickle.loads(pickle.dumps(ours))
    ours.use_template(config.model.chat_template, {})
    messages = [SYSTEM, _user("What is 2 + 2 =")]
    reference = copy.deepcopy(reference)
    reference.chat_template = Path(config.model.chat_template).read_text(encoding="utf-8")
    assert ours.encode_chat(messages) == reference.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert ours.render_chat(messages) == f"{SYSTEM['content']}\n\nWhat is 2 + 2 ="  # (this vocabulary has no bos)
    with pytest.raises(ConfigError, match="template file not found"):
        load_yaml(RunConfig, str(repo / "examples" / "configs" / "quickstart.yaml"),
                  [f"model.chat_template={tmp_path / 'missing.jinja'}"])
