#!/usr/bin/env python3
"""Writes the chat-template fixtures: what transformers' apply_chat_template makes of a set of
conversations, for the harvester's conversation tests to equal.

    python3 scripts/reference/make_chat_fixtures.py      (transformers and jinja2; no torch)

It writes, under harvester/tests/fixtures/chat/:
  llama3/, qwen2/, mistral/   the tiny test tokenizers (tiny-*/tokenizer.json) with each family's
                              chat markers added as special tokens, and a tokenizer_config.json
                              with the family's chat template and special tokens: Llama 3's
                              template writes <|begin_of_text|> and its tokenizer adds it too;
                              Qwen2's has no BOS; Mistral's writes <s>, which its tokenizer adds;
  reference.json              for each of those and for SmolLM2 (its real tokenizer and template,
                              as imported from the GGUF into the model cache), every conversation
                              below rendered and tokenized by transformers
                              (apply_chat_template(tokenize=True)), with and without the
                              generation prompt, and the conversations a template refuses;
                              with each token's role id and turn, found by rendering the
                              conversation message by message with transformers (message i's
                              part of the text is what rendering the first i+1 messages adds;
                              inside it, its content is its role's, the rest the template's)
                              and the fast tokenizer's offset mapping.
"""
import json
import os
import pathlib
import shutil

from tokenizers import AddedToken, Tokenizer, processors
from transformers import PreTrainedTokenizerFast

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "harvester" / "tests" / "fixtures"
OUT = FIXTURES / "chat"
CACHE = pathlib.Path(os.environ.get("HARVEST_CACHE", pathlib.Path.home() / ".cache" / "harvest"))

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
    "{% endfor %}"
)

# family: (tiny tokenizer, template, added special tokens, bos, eos, whether the tokenizer adds BOS)
FAMILIES = {
    "llama3": ("tiny-llama3-f16-sharded", LLAMA3,
               ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", True),
    "qwen2": ("tiny-qwen2-f32", QWEN2, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
              None, "<|im_end|>", False),
    "mistral": ("tiny-mistral-window-bf16", MISTRAL, [], "<s>", "</s>", True),
}

CONVERSATIONS = [
    [{"role": "user", "content": "What does the residual stream carry?"}],
    [{"role": "system", "content": "You answer briefly."},
     {"role": "user", "content": "Name a probe."},
     {"role": "assistant", "content": "A linear one."}],
    [{"role": "user", "content": "  Padded question?  "},
     {"role": "assistant", "content": "Trimmed, by some templates."},
     {"role": "user", "content": "Ünïcödé — and <angle brackets> & quotes \"here\"."},
     {"role": "assistant", "content": "Fine.\nTwo lines."}],
    [{"role": "user", "content": "Call the tool."},
     {"role": "assistant", "content": "Calling."},
     {"role": "tool", "content": "{\"result\": 42}"}],
]


def family_dir(name, tiny, template, added, bos, eos, adds_bos):
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(FIXTURES / tiny / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    if bos and adds_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokenizer.token_to_id(bos))])
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": eos, "unk_token": "<unk>", "chat_template": template,
              "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return out


ROLE_IDS = {"system": 1, "user": 2, "assistant": 3, "tool": 4}  # 0: the template's own


def render(tokenizer, messages, generation):
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation)


def spans(tokenizer, messages, generation):
    """(start, end, role, turn) in characters of the rendered text, by per-message rendering."""
    text = render(tokenizer, messages, generation)
    out, start = [], 0
    for turn, message in enumerate(messages):
        last = turn == len(messages) - 1
        prefix = render(tokenizer, messages[:turn + 1], last and generation)
        assert text.startswith(prefix), "the template rewrites earlier turns"
        end = len(text) if last else len(prefix)
        part = text[start:end]
        content = None
        for candidate in (message["content"], message["content"].strip()):
            if candidate and candidate in part:
                at = start + part.index(candidate)
                content = (at, at + len(candidate))
                break
        if content:
            out += [(start, content[0], 0, turn), (*content, ROLE_IDS[message["role"]], turn),
                    (content[1], end, 0, turn)]
        else:
            out.append((start, end, 0, turn))
        start = end
    if generation:
        without = render(tokenizer, messages, False)
        if out[-1][2] == 0 and out[-1][0] <= len(without):
            out[-1] = (out[-1][0], len(without), 0, out[-1][3])
            out.append((len(without), len(text), 0, len(messages)))
    return text, [s for s in out if s[1] > s[0]]


def roles_of(tokenizer, messages, generation, n_ids):
    """Each token's (role, turn): content overlapping a token makes it the message's."""
    text, found = spans(tokenizer, messages, generation)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    roles, turns = [], []
    for start, end in offsets:
        hit = None
        if end > start:
            hit = next((s for s in found if s[2] != 0 and s[0] < end and start < s[1]), None)
            hit = hit or next((s for s in found if s[0] <= start < s[1]), None)
        roles.append(hit[2] if hit else 0)
        turns.append(hit[3] if hit else 0)
    # One BOS at the start, as apply_chat_template's ids have: a BOS added in front is the
    # template's, an extra one dropped.
    while len(roles) > n_ids:
        roles.pop(0), turns.pop(0)
    while len(roles) < n_ids:
        roles.insert(0, 0), turns.insert(0, 0)
    return roles, turns


def reference(directory):
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory))
    cases, refused = [], []
    for index, messages in enumerate(CONVERSATIONS):
        for generation in (False, True):
            try:
                ids = tokenizer.apply_chat_template(messages, tokenize=True,
                                                    add_generation_prompt=generation)
                if hasattr(ids, "keys"):
                    ids = ids["input_ids"]
            except Exception as error:  # the template's raise_exception
                refused.append({"conversation": index, "add_generation_prompt": generation,
                                "error": str(error)})
                continue
            roles, turns = roles_of(tokenizer, messages, generation, len(ids))
            cases.append({"conversation": index, "add_generation_prompt": generation,
                          "ids": list(ids), "roles": roles, "turns": turns})
    return {"cases": cases, "refused": refused}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    result = {"conversations": CONVERSATIONS, "families": {}}
    for name, spec in FAMILIES.items():
        directory = family_dir(name, *spec)
        result["families"][name] = {"dir": name, **reference(directory)}
    smollm2 = CACHE / "models" / "smollm2-135m"
    result["families"]["smollm2"] = {"dir": None, **reference(smollm2)}
    (OUT / "reference.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    for name, family in result["families"].items():
        print(f"{name}: {len(family['cases'])} cases, {len(family['refused'])} refused")


if __name__ == "__main__":
    main()
