"""Tests for data.py: oracles are transformers (chat templates, tokenizer, checkpoint loading), vLLM (the tiny
checkpoint serves and its logprobs match transformers), the GSM8K files in data/gsm8k, and
arithmetic itself."""
import json
import re

import pytest
import torch

import data
import tasks
from conftest import GSM8K_DIR

# A Qwen2.5-style ChatML template (default system prompt, tools rendered as JSON, tool calls and tool results),
# written over several indented lines so trim_blocks / lstrip_blocks matter.
CHATML = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}{{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}
    {%- if message.role in ['user', 'system'] or (message.role == 'assistant' and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# A Llama-3-style template: bos_token, header ids, a dated system block, content trimmed, tools via tojson(indent).
LLAMA3 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if loop.index0 > 50 %}{% break %}{% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Undashed, indented block tags: the output depends on trim_blocks / lstrip_blocks; also strftime_now and loops.
PLAIN = """{% for m in messages %}
    {% if m.role == 'user' %}
User ({{ loop.index }}): {{ m.content }}
    {% else %}
{{ m.role | capitalize }}: {{ m.content }}
    {% endif %}
{% endfor %}
{% if tools %}Tools: {{ tools | tojson(indent=2) }}
{% endif %}
{% if add_generation_prompt %}
Assistant ({{ strftime_now("%Y") }}):
{% endif %}
"""

# The tiny template with transformers' {% generation %} markers: renders the same text, and lets transformers
# compute its own assistant mask as an oracle for sft_example.
TINY_WITH_GENERATION = ("{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{% generation %}"
                        "{{ m.content }}<|end|>{% endgeneration %}{% else %}<|{{ m.role }}|>{{ m.content }}<|end|>"
                        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <two> numbers & return 'sum' ≠ é",
                                            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]
CHATS = [
    [{"role": "user", "content": "Sue has 11 eggs. She finds 65 more. How many eggs now?"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi <b>&</b> 'quotes' é"},
     {"role": "assistant", "content": " 1 + 2 = 3. The answer is 3."}, {"role": "user", "content": "And\nthen?  "}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"},
     {"role": "assistant", "content": "d"}],
]


def write_tok_dir(path, src, template, specials=(), **cfg):
    """A tokenizer directory: the tiny tokenizer.json plus `specials` as added tokens, with another chat template
    and special tokens in tokenizer_config.json."""
    path.mkdir(parents=True, exist_ok=True)
    tj = json.loads((src / "tokenizer.json").read_text())
    for i, s in enumerate(specials):
        tj["added_tokens"].append({"id": len(tj["model"]["vocab"]) + i, "content": s, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tj))
    base = json.loads((src / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**base, "chat_template": template, **cfg}))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return data.make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return data.Tokenizer(tok_dir)


# ----------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_training_is_deterministic(tmp_path, tok_dir):
    again = data.make_tiny_tokenizer(tmp_path / "again")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (again / f).read_bytes() == (tok_dir / f).read_bytes()


def test_tiny_tokenizer_digits_specials_roundtrip(tok):
    assert tok.vocab_size <= 384
    assert (tok.eos_token, tok.eos_token_ids, tok.pad_token_id) == ("<|end|>", [tok.eos_token_id], 0)
    for number in ("7", "12345", "907", "100"):  # every digit is its own token, with or without the leading space
        assert [tok.decode([i]) for i in tok.encode(number)] == list(number)
        assert tok.encode(" " + number) == tok.encode(" ") + tok.encode(number)  # Qwen2's split: space apart
    for text in ("Zoe has 12 cups. She drops 3. How many cups now?", "x = {a: [1, 2]}; print('hi')\n  ok?~"):
        ids = tok.encode(text)
        assert tok.tok.token_to_id("<unk>") not in ids
        assert tok.decode(ids) == text
    ids = tok.encode("<|user|>hi<|end|>")
    assert ids[0] == tok.tok.token_to_id("<|user|>") and ids[-1] == tok.eos_token_id
    assert tok.decode(ids) == "hi" and tok.decode(ids, skip_special_tokens=False) == "<|user|>hi<|end|>"


def test_tokenizer_reads_eos_from_generation_config(tmp_path, tok_dir):
    d = write_tok_dir(tmp_path / "t", tok_dir, LLAMA3, eos_token="<|end|>", pad_token=None)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4], "pad_token_id": 5}))
    t = data.Tokenizer(d)
    assert (t.eos_token_id, t.eos_token_ids, t.pad_token_id) == (2, [2, 4], 5)


# ----------------------------------------------------------------------------------------------- chat templates
@pytest.fixture(scope="module")
def template_dirs(tok_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("templates")
    dirs = {
        "tiny": tok_dir,
        "chatml": write_tok_dir(root / "chatml", tok_dir, CHATML, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
                                eos_token="<|im_end|>", pad_token="<|endoftext|>"),
        "llama3": write_tok_dir(root / "llama3", tok_dir, LLAMA3, ["<|begin_of_text|>", "<|eot_id|>",
                                "<|start_header_id|>", "<|end_header_id|>"], bos_token="<|begin_of_text|>",
                                eos_token={"__type": "AddedToken", "content": "<|eot_id|>", "special": True}),
        "generation": write_tok_dir(root / "gen", tok_dir, TINY_WITH_GENERATION),
        "plain": write_tok_dir(root / "plain", tok_dir, PLAIN),
        "jinja_file": write_tok_dir(root / "jinja", tok_dir, TINY_WITH_GENERATION),
    }
    (dirs["jinja_file"] / "chat_template.jinja").write_text(LLAMA3)  # transformers v5: the file wins over the config
    return dirs


@pytest.mark.parametrize("name", ["tiny", "chatml", "llama3", "plain", "generation", "jinja_file"])
def test_chat_template_matches_transformers(template_dirs, name):
    from transformers import AutoTokenizer
    ours, theirs = data.Tokenizer(template_dirs[name]), AutoTokenizer.from_pretrained(str(template_dirs[name]))
    for chat in CHATS:
        for agp in (False, True):
            want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=agp)
            assert ours.apply_chat_template(chat, add_generation_prompt=agp) == want
            for kw in ({"tools": TOOLS}, {"date_string": "1 Jan 2025"}):
                want = theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=agp, **kw)
                assert ours.apply_chat_template(chat, add_generation_prompt=agp, **kw) == want
    if name == "tiny":
        got = ours.apply_chat_template(CHATS[1], add_generation_prompt=True, tokenize=True)
        assert got == theirs.apply_chat_template(CHATS[1], add_generation_prompt=True, return_dict=False)


def test_chat_template_features_render(template_dirs):
    chatml, llama3 = data.Tokenizer(template_dirs["chatml"]), data.Tokenizer(template_dirs["llama3"])
    text = chatml.apply_chat_template(CHATS[0], tools=TOOLS)
    assert "Add <two> numbers & return 'sum' ≠ é" in text  # our tojson neither HTML-escapes nor \\u-escapes
    assert text.count("\n") == 9 and "    " not in text  # trim_blocks / lstrip_blocks
    text = llama3.apply_chat_template(CHATS[1], add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|>") and "Be brief.<|eot_id|>" in text and "Today Date: 26 Jul 2024" in text
    text = data.Tokenizer(template_dirs["plain"]).apply_chat_template(CHATS[1][1:3], add_generation_prompt=True)
    assert text.startswith("User (1): Hi <b>&</b> 'quotes' é\nAssistant:  1 + 2 = 3.") and text.endswith("):\n")
    with pytest.raises(Exception, match="unknown role robot"):
        chatml.apply_chat_template([{"role": "robot", "content": "x"}])


# ----------------------------------------------------------------------------------------------- SFT examples
def test_sft_mask_is_assistant_content_and_eos(tok, template_dirs):
    from transformers import AutoTokenizer
    chat = CHATS[2] + [{"role": "user", "content": "Sam has 9 pens. He drops 2. How many pens now?"},
                       {"role": "assistant", "content": " 9 - 2 = 7. The answer is 7."}]
    ids, mask = data.sft_example(tok, chat)
    assert ids == tok.apply_chat_template(chat, tokenize=True) and len(mask) == len(ids)
    masked = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(masked, skip_special_tokens=False) == "b<|end|>d<|end|> 9 - 2 = 7. The answer is 7.<|end|>"
    assert masked.count(tok.eos_token_id) == 3 and tok.tok.token_to_id("<|assistant|>") not in masked
    # oracle: transformers' own assistant mask from the {% generation %} version of the same template
    hf = AutoTokenizer.from_pretrained(str(template_dirs["generation"]))
    out = hf.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)
    assert out["input_ids"] == ids and out["assistant_masks"] == mask


def test_sft_mask_chatml_excludes_header_and_glue(template_dirs):
    t = data.Tokenizer(template_dirs["chatml"])
    assert (t.eos_token_id, t.pad_token_id) == (t.tok.token_to_id("<|im_end|>"), t.tok.token_to_id("<|endoftext|>"))
    chat = CHATS[1] + [{"role": "assistant", "content": "ok"}]
    ids, mask = data.sft_example(t, chat)
    assert ids == t.apply_chat_template(chat, tokenize=True)
    # ChatML renders "<|im_start|>assistant\n{content}<|im_end|>\n": header out, the newline after the
    # end-of-turn token is template glue the model never generates, so it is out too
    masked = t.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert masked == " 1 + 2 = 3. The answer is 3.<|im_end|>ok<|im_end|>"


def test_step_batch_is_a_permutation_per_epoch_and_a_function_of_seed_and_step():
    train = list(range(10))
    B = 3  # 3 steps per epoch, the last item of each epoch's permutation unused
    epoch0 = [p for s in range(3) for p in data.step_batch(train, s, B, seed=1)]
    assert len(epoch0) == len(set(epoch0)) == 9  # no repeats within an epoch
    assert data.step_batch(train, 4, B, seed=1) == data.step_batch(list(train), 4, B, seed=1)  # resume
    assert epoch0 != [p for s in range(3, 6) for p in data.step_batch(train, s, B, seed=1)]  # new epoch order
    assert epoch0 != [p for s in range(3) for p in data.step_batch(train, s, B, seed=2)]  # seed matters


# ----------------------------------------------------------------------------------------------- GSM8K
@pytest.mark.parametrize("split,n", [("test", 1319), ("train", 7473)])
def test_gsm8k_local_jsonl(split, n, capsys):
    rows = data.load_gsm8k(str(GSM8K_DIR / f"{split}.jsonl"), split)
    assert len(rows) == n and "skipped" not in capsys.readouterr().err
    for r in rows:
        assert r["question"].strip() and r["solution"].endswith("#### " + r["solution"].split("#### ")[-1])
        assert re.fullmatch(r"-?\d+", r["target"]), r["target"]  # GSM8K targets are integers
        assert float(r["target"]) == float(r["solution"].rsplit("####", 1)[1].replace(",", ""))
    if split == "test":
        assert rows[0]["target"] == "18" and rows[0]["question"].startswith("Janet")


def test_gsm8k_parquet_and_directory(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    lines = (GSM8K_DIR / "test.jsonl").read_text().splitlines()[:50]
    pq.write_table(pa.Table.from_pylist([json.loads(x) for x in lines]), tmp_path / "test-00000-of-00001.parquet")
    want = data.load_gsm8k(str(GSM8K_DIR / "test.jsonl"), "test")[:50]
    assert data.load_gsm8k(str(tmp_path / "test-00000-of-00001.parquet"), "test") == want
    assert data.load_gsm8k(str(tmp_path), "test") == want
    assert len(data.load_gsm8k(str(GSM8K_DIR), "test")) == 1319


def test_gsm8k_malformed_rows_skipped_or_abort(tmp_path, capsys):
    good = [{"question": f"q{i}", "answer": f"work\n#### {i},000"} for i in range(97)]
    bad = [{"answer": "#### 1"}, {"question": "q", "answer": "no marker"}, {"question": "q", "answer": "#### ten"},
           {"question": "  ", "answer": "#### 3"}]
    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in good[:50] + bad + good[50:]) + "\n{not json\n")
    rows = data.load_gsm8k(str(f), "train", max_bad_fraction=0.1)
    assert len(rows) == 97 and rows[5]["target"] == "5000"
    err = capsys.readouterr().err
    assert "skipped 5/102" in err and "row 50: KeyError: 'question'" in err and "row 51" in err and "row 53" not in err
    with pytest.raises(ValueError, match="5/102 rows malformed"):
        data.load_gsm8k(str(f), "train", max_bad_fraction=0.01)


# ----------------------------------------------------------------------------------------------- arithmetic task
def test_tiny_task_token_lengths(tok):
    lengths = [(len(data.prompt_ids(tok, r["question"])), len(tok.encode(r["solution"])) + 1)  # + end of turn
               for r in tasks.make_arith(1000, seed=0, min_digits=1, max_digits=2)]
    assert max(p for p, _ in lengths) <= 22 and max(c for _, c in lengths) <= 22


# ----------------------------------------------------------------------------------------------- tiny checkpoint
def test_tiny_checkpoint_deterministic_and_idempotent(tmp_path, tiny_ckpt):
    p = data.make_tiny_checkpoint(tmp_path / "a", seed=0)
    for f in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (p / f).read_bytes() == (tiny_ckpt / f).read_bytes(), f
    mtime = (p / "model.safetensors").stat().st_mtime_ns
    assert data.make_tiny_checkpoint(p, seed=0) == p and (p / "model.safetensors").stat().st_mtime_ns == mtime
    data.make_tiny_checkpoint(p, seed=1)  # other settings: rewritten with other weights
    assert (p / "model.safetensors").read_bytes() != (tiny_ckpt / "model.safetensors").read_bytes()


@pytest.mark.parametrize("which", ["tied", "untied", "qwen3", "llama"])
def test_tiny_checkpoint_loads_in_transformers(which, tiny_ckpt, tiny_ckpt_untied, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = {"tied": tiny_ckpt, "untied": tiny_ckpt_untied}.get(which)
    if path is None:
        path = data.make_tiny_checkpoint(tmp_path / which, seed=0, model_type=which, num_hidden_layers=2)
    model, info = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    assert type(model).__name__ == {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}.get(which, "Qwen2ForCausalLM")
    sd = load_file(str(path / "model.safetensors"))
    assert ("lm_head.weight" in sd) == (which == "untied")
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == (which != "untied")
    for name, w in sd.items():
        assert torch.equal(model.state_dict()[name], w), name
    emb = sd["model.embed_tokens.weight"]
    assert abs(emb.std().item() - 0.02) < 0.002 and emb.shape == (384, 128)
    if which != "tied":
        return
    hf, ours = AutoTokenizer.from_pretrained(str(path)), data.Tokenizer(path)
    assert (hf.eos_token_id, hf.pad_token_id) == (ours.eos_token_id, ours.pad_token_id)
    assert model.generation_config.eos_token_id == ours.eos_token_id
    for text in ("Ünïcode ≠ ascii, 1,234.5 \t tabs\n\nand  spaces", "<|user|>x<|end|><pad>"):
        assert hf.encode(text, add_special_tokens=False) == ours.encode(text)  # transformers rebuilds the pipeline
        assert hf.decode(ours.encode(text), skip_special_tokens=True) == ours.decode(ours.encode(text))
    assert ours.decode(ours.encode("Ünïcode ≠ ascii")) == "Ünïcode ≠ ascii"  # byte-level: nothing is lost
    for r in tasks.make_arith(20, seed=9):
        chat = [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["solution"]}]
        ids = hf.apply_chat_template(chat, return_dict=False)
        assert ids == ours.apply_chat_template(chat, tokenize=True) == data.sft_example(ours, chat)[0]
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids) == r["question"] + r["solution"]
    with torch.no_grad():
        logits = model(torch.tensor([data.prompt_ids(ours, "Sue has 1 cup.")])).logits
    assert torch.isfinite(logits).all()


@pytest.mark.slow
def test_tiny_checkpoint_serves_in_vllm(tiny_ckpt):
    """vLLM opens the checkpoint and its tokenizer; greedy tokens' logprobs match a transformers forward pass."""
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    tok = data.Tokenizer(tiny_ckpt)
    llm = LLM(model=str(tiny_ckpt), dtype="float32", max_model_len=256, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, seed=0)
    problems = tasks.make_arith(4, seed=5)
    assert llm.get_tokenizer().encode(problems[0]["question"], add_special_tokens=False) == tok.encode(problems[0]["question"])
    prompts = [data.prompt_ids(tok, r["question"]) for r in problems]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, detokenize=False, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_ckpt), dtype=torch.float32)
    for p, out in zip(prompts, outs):
        gen = list(out.outputs[0].token_ids)
        assert len(gen) == 8 and all(0 <= t < 384 for t in gen)
        vllm_logp = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen)])
        with torch.no_grad():
            logits = hf(torch.tensor([p + gen])).logits[0, len(p) - 1:-1]
        logp = torch.log_softmax(logits.float(), -1)
        assert gen == logp.argmax(-1).tolist()  # greedy under transformers too
        assert torch.allclose(vllm_logp, logp.gather(-1, torch.tensor(gen)[:, None])[:, 0], atol=1e-4)
