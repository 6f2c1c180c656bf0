"""Data: tokenizer + chat templates, datasets (GSM8K, a user's loader), the tiny checkpoint, SFT.

- `Tokenizer`: a `tokenizers.Tokenizer` from a checkpoint's tokenizer.json, plus the special tokens
  from tokenizer_config.json (eos/pad/...) and generation_config.json (extra eos ids, e.g. Llama-3's
  <|eot_id|>).
- Chat templates: the checkpoint's own `chat_template`, rendered with jinja2 in the sandboxed
  environment and with the variables transformers uses (trim/lstrip blocks, loop controls,
  `raise_exception`, a non-escaping `tojson`, `strftime_now`; the named special tokens, `tools`,
  `documents`); tests check byte-identity with transformers.
- `load_gsm8k`: GSM8K from the hub or a local .jsonl/.parquet as {question, solution, target}
  (target: the number after "####", commas stripped). A user's loader returns such records;
  `check_record` checks each the same way.
- `make_tiny_checkpoint`: a BPE tokenizer trained deterministically on tasks.make_arith's problems
  (Qwen2's pre-tokenizer: a token per digit) and a random Qwen2 model in Hugging Face format; vLLM
  and transformers open and tokenize it as we do.
- `sft_example`: ids + a loss mask, 1 exactly on assistant content and its end-of-turn token;
  `pack`: documents first-fit into rows whose positions restart per document; `step_batch`: a
  dataset's order per (seed, step).

Malformed rows (missing or empty question/answer, a bad target) are skipped, counted, the first few
shown; more than `max_bad_fraction` aborts (a wrong file or format). Nothing heavy is imported here.
Left out: streaming.
"""
import json
import random
import re
import sys
import tempfile
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

import config
import packing
import seeds
import tasks

# --------------------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------------------
# transformers passes these named special tokens (when set) to every template as strings.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")


class _GenerationTag(jinja2.ext.Extension):
    # Some templates wrap assistant turns in {% generation %}...{% endgeneration %} (transformers
    # uses it to find assistant tokens). We only need it to parse; it renders its body unchanged.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson HTML-escapes <, >, &, ' — chat templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile_template(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text()) if p.exists() else {}


def _token_str(v):
    # tokenizer_config may store an AddedToken as a dict
    return v["content"] if isinstance(v, dict) else v


class Tokenizer:
    """tokenizer.json + the special tokens and chat template of a Hugging Face checkpoint
    directory."""

    def __init__(self, path):
        path = Path(path)
        if not (path / "tokenizer.json").exists():  # tokenizers' own error does not say which file
            raise FileNotFoundError(f"missing tokenizer file {path / 'tokenizer.json'}")
        self.tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg, gen = (_read_json(path / "tokenizer_config.json"),
                    _read_json(path / "generation_config.json"))
        self.special_tokens = {k: _token_str(cfg[k]) for k in SPECIAL_TOKEN_NAMES
                               if cfg.get(k) is not None}
        # named model-specific tokens are template variables too
        if isinstance(cfg.get("extra_special_tokens"), dict):
            self.special_tokens.update({k: _token_str(v)
                                        for k, v in cfg["extra_special_tokens"].items()})
        self.eos_token = self.special_tokens.get("eos_token")
        gen_eos = gen.get("eos_token_id")
        gen_eos = ([] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int)
                   else list(gen_eos))
        self.eos_token_id = ((self.tok.token_to_id(self.eos_token) if self.eos_token else None)
                             or (gen_eos or [None])[0])
        if self.eos_token_id is None:
            raise ValueError(f"{path}: no eos_token in tokenizer_config.json nor eos_token_id in "
                             "generation_config.json")
        # generation stops on any of them
        self.eos_token_ids = sorted({self.eos_token_id, *gen_eos})
        pad_id = self.tok.token_to_id(self.special_tokens.get("pad_token", ""))
        self.pad_token_id = (pad_id if pad_id is not None
                             else gen.get("pad_token_id", self.eos_token_id))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        # transformers v5 prefers chat_template.jinja beside the config; a list means named
        # templates
        jinja_file = path / "chat_template.jinja"
        tmpl = jinja_file.read_text() if jinja_file.exists() else cfg.get("chat_template")
        self.chat_template = ({t["name"]: t["template"] for t in tmpl}.get("default")
                              if isinstance(tmpl, list) else tmpl)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False, **kw):
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat_template")
        # Same variables as transformers: special tokens first, explicit keywords override them.
        ctx = {**self.special_tokens, "tools": None, "documents": None, **kw}
        text = _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **ctx)
        return self.encode(text) if tokenize else text


def prompt_ids(tok: Tokenizer, question: str) -> list[int]:
    """Token ids of a one-turn user prompt followed by the assistant header (what generation starts
    from)."""
    return tok.apply_chat_template([{"role": "user", "content": question}],
                                   add_generation_prompt=True, tokenize=True)


# --------------------------------------------------------------------------------------------------
# SFT examples and packing
# --------------------------------------------------------------------------------------------------
def sft_example(tok: Tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """ids and loss_mask for a (multi-turn) chat: 1 on each assistant message's content and its
    end-of-turn token.

    The chat is rendered incrementally: render(messages[:i], add_generation_prompt=True) ends where
    assistant message i's content begins and render(messages[:i+1]) ends where it stops, so the
    template's own headers are never guessed. Each segment is tokenized on its own, which is exactly
    how the model sees it at generation time (the prompt is tokenized, then the sampled tokens are
    appended). Template glue after the end-of-turn token (ChatML's trailing newline) is not
    something the model generates, so it stays out of the mask.
    """
    spans, prev = [], ""  # (text, is_assistant)

    def add(text, is_asst):
        nonlocal prev
        if not text.startswith(prev):
            raise ValueError(
                "chat template is not prefix-consistent (it rewrites earlier turns); cannot mask")
        spans.append((text[len(prev):], is_asst))
        prev = text

    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            # up to the header
            add(tok.apply_chat_template(messages[:i], add_generation_prompt=True), False)
        add(tok.apply_chat_template(messages[: i + 1]), m["role"] == "assistant")
    ids, loss_mask = [], []
    for text, is_asst in spans:
        seg = tok.encode(text)
        seg_mask = [int(is_asst)] * len(seg)
        if is_asst:
            ends = [j for j, t in enumerate(seg) if t in tok.eos_token_ids]
            if ends:  # zero the glue after the last end-of-turn token
                seg_mask[ends[-1] + 1:] = [0] * (len(seg) - ends[-1] - 1)
        ids += seg
        loss_mask += seg_mask
    return ids, loss_mask


def first_fit(docs, pack_len):
    """Rows as lists of documents, first fit in data order (packing.first_fit; pack_len 0: a
    document a row)."""
    return [[docs[i] for i in b]
            for b in packing.first_fit([len(doc[0]) - 1 for doc in docs], pack_len)]


def pack(docs, pack_len, pad_id, num_rows=0):
    """Documents -> rows of next-token pairs, first fit in data order. A document of n tokens gives
    n-1 pairs (ids[:-1] -> ids[1:]) at positions 0..n-2; a position restarting at 0 is a document
    boundary for model.py. pack_len=0: one document per row. Rows are right-padded to the longest;
    the padding is a document of its own with loss mask 0. num_rows: append empty rows up to this
    count (equal micro-batch counts on every rank, which FSDP2's collectives need). Returns ids,
    pos, tgt (R, L) long, mask (R, L)."""
    rows = first_fit(docs, pack_len)
    rows += [[] for _ in range(num_rows - len(rows))]
    R, L = len(rows), max([sum(len(d[0]) - 1 for d in row) for row in rows] + [1])
    ids, tgt = (torch.full((R, L), pad_id, dtype=torch.long),
                torch.full((R, L), pad_id, dtype=torch.long))
    pos, mask = torch.zeros((R, L), dtype=torch.long), torch.zeros((R, L))
    for r, row in enumerate(rows):
        c = 0
        for doc_ids, loss_mask in row:
            n = len(doc_ids) - 1
            ids[r, c:c + n], tgt[r, c:c + n] = torch.tensor(doc_ids[:-1]), torch.tensor(doc_ids[1:])
            # predicts token t+1
            mask[r, c:c + n] = torch.tensor(loss_mask[1:], dtype=torch.float32)
            pos[r, c:c + n] = torch.arange(n)
            c += n
        pos[r, c:] = torch.arange(L - c)
    return dict(ids=ids, pos=pos, tgt=tgt, mask=mask)


# --------------------------------------------------------------------------------------------------
# GSM8K and malformed rows
# --------------------------------------------------------------------------------------------------
def keep_good(rows, parse, max_bad_fraction: float, what: str, show: int = 3) -> list[dict]:
    """parse(row) -> record or raises ValueError(reason). Skip bad rows with a report; abort if too
    many."""
    good, bad = [], []
    for i, row in enumerate(rows):
        try:
            good.append(parse(row))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            bad.append((i, f"{type(e).__name__}: {e}"))
    n = len(good) + len(bad)
    if bad:
        first = "; ".join(f"row {i}: {why}" for i, why in bad[:show])
        print(f"{what}: skipped {len(bad)}/{n} malformed rows (first: {first})", file=sys.stderr)
        if len(bad) > max_bad_fraction * n:
            raise ValueError(f"{what}: {len(bad)}/{n} rows malformed, more than max_bad_fraction="
                             f"{max_bad_fraction} (first: {first})")
    return good


def check_record(r: dict) -> dict:
    """A task record as every trainer reads it: {question (non-empty), solution (str), target
    (str, non-empty)}."""
    question, solution, target = r["question"], r["solution"], str(r["target"]).strip()
    if not isinstance(question, str) or not question.strip():
        raise ValueError("empty question")
    if not isinstance(solution, str) or not target:
        raise ValueError("solution is not a string" if target else "empty target")
    return {"question": question, "solution": solution, "target": target}


def parse_gsm8k_row(row: dict | str) -> dict:
    # a JSON line (JSONDecodeError is a ValueError)
    row = json.loads(row) if isinstance(row, str) else row
    solution = row["answer"]
    if not isinstance(solution, str) or "####" not in solution:
        raise ValueError("answer has no '####' line")
    target = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not re.fullmatch(r"-?\d+(\.\d+)?", target):
        raise ValueError(f"non-numeric target {target!r}")
    return check_record({"question": row["question"], "solution": solution, "target": target})


def load_gsm8k(source: str = "openai/gsm8k", split: str = "train",
               max_bad_fraction: float = 0.01) -> list[dict]:
    """GSM8K as [{question, solution, target}]. `source` is a local .jsonl/.parquet file, a
    directory holding `<split>.jsonl` / `<split>*.parquet`, or a hub dataset name (needs network and
    the `datasets` cache)."""
    p = Path(source)
    if p.is_dir():
        found = sorted(p.glob(f"{split}.jsonl")) + sorted(p.glob(f"{split}*.parquet"))
        if not found:
            raise FileNotFoundError(f"no {split}.jsonl or {split}*.parquet in {p}")
        p = found[0]
    if p.suffix == ".jsonl":
        with open(p) as f:  # lines are parsed per row, so one broken line is one malformed row
            rows = [line for line in f if line.strip()]
    elif p.suffix == ".parquet":
        import pyarrow.parquet as pq  # installed with datasets
        rows = pq.read_table(p).to_pylist()
    elif p.exists():
        raise ValueError(f"{p}: expected a .jsonl or .parquet file")
    else:
        import datasets  # hub name, e.g. openai/gsm8k (config "main")
        rows = datasets.load_dataset(source, "main", split=split)
    return keep_good(rows, parse_gsm8k_row, max_bad_fraction, f"gsm8k {source} [{split}]")


def load_split(d, source, split):
    """[{question, solution, target}] of one split of a non-synthetic dataset (every row checked,
    malformed ones counted and skipped: keep_good). A user's loader is called as
    loader(source, split)."""
    if d.name == "gsm8k":
        return load_gsm8k(source, split, d.max_bad_fraction)
    loader = config.load_object(d.name, "data.name")
    return keep_good(loader(source, split), check_record, d.max_bad_fraction,
                     f"{d.name} {source} [{split}]")


# a synthetic task's train set, when it is a fixed set
SYNTHETIC_TRAIN = {"arith": 20_000, "code": 1000}


def problems(d, split, seed, n=None, digits=None):
    """The one task loader of both trainers: split "train", "dev" (SFT's stopping rule) or "test"
    (the held-out eval) for the data section d. A synthetic task draws n problems of that split
    (tasks.split_of; train: SYNTHETIC_TRAIN's) from the stream (seed, split), operands of
    `digits` = (lo, hi) or d's digits; a dataset reads its train file, or the first n rows of its
    test file (data.eval_source when set) for dev and test."""
    if d.name in SYNTHETIC_TRAIN:
        n, s = n or SYNTHETIC_TRAIN[d.name], seeds.seed(seed, "problems", split)
        if d.name == "code":
            return tasks.make_code(n, s, split=split)
        lo, hi = digits or (d.min_digits, d.max_digits)
        return tasks.make_arith(n, s, min_digits=lo, max_digits=hi, split=split)
    if split == "train":
        return load_split(d, d.source, "train")
    return load_split(d, d.eval_source or d.source, "test")[:n]


def step_batch(rows, step, batch, seed, stream="order"):
    """Step s's rows from (seed, s) alone, epoch e a fixed permutation: same on every rank, exact on
    resume. `stream` names the permutation (DAPO's refill rounds draw from streams of their own)."""
    epoch, pos = divmod(step, len(rows) // batch)
    order = list(range(len(rows)))
    random.Random(seeds.seed(seed, stream, epoch)).shuffle(order)
    return [rows[i] for i in order[pos * batch:(pos + 1) * batch]]


# --------------------------------------------------------------------------------------------------
# The tiny tokenizer and checkpoint
# --------------------------------------------------------------------------------------------------
# ids 0..5; <|end|> = eos
SPECIALS = ["<pad>", "<unk>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# Qwen2's pre-tokenizer split. NOTE: transformers 5 rebuilds the tokenizer of every model_type
# "qwen2" checkpoint as Qwen2Tokenizer (NFC, this split, byte-level BPE) from tokenizer.json's vocab
# and merges, ignoring the rest of its pipeline; vLLM loads it through transformers. So the tiny
# tokenizer uses exactly that pipeline, or the three would tokenize differently. It spells every
# number digit by digit (\p{N} matches one digit), which lets the model learn carrying; the price is
# that the space before a number is a token of its own.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
               r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def make_tiny_tokenizer(path, vocab_size: int = 384) -> Path:
    """Train the arithmetic BPE tokenizer and write tokenizer.json + tokenizer_config.json into
    `path`. 256 byte tokens (any text encodes) + 6 specials + merges learnt on the task's text.
    Deterministic: a fixed corpus (tasks.make_arith with its own seed) and BPE's deterministic merge
    order (ties broken by pair id)."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _HFTokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    problems = tasks.make_arith(4000, seed=1234, min_digits=1, max_digits=3)
    corpus = [t for r in problems for t in (r["question"], r["solution"])]
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|end|>",
              "pad_token": "<pad>", "unk_token": "<unk>",
              "extra_special_tokens": ["<|user|>", "<|assistant|>", "<|system|>"],
              "chat_template": TINY_CHAT_TEMPLATE, "model_max_length": 2048,
              "clean_up_tokenization_spaces": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def make_tiny_checkpoint(path, seed=0, model_type="qwen2", hidden_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                         intermediate_size=384, tie_word_embeddings=True, vocab_size=None) -> Path:
    """A random tiny model (init N(0, 0.02), output projections N(0, 0.02/sqrt(2L)), norms 1, biases
    0) with the arithmetic tokenizer, in Hugging Face format. Idempotent: returns early if `path`
    holds the same settings.
    vocab_size: None = the tokenizer's, rounded up to 64; larger gives a real model's shape
    (bench/gpu.py), and the ids the tokenizer does not know decode to nothing."""
    settings = {k: v for k, v in locals().items()
                if k != "path" and not (k == "vocab_size" and v is None)}
    # how the seed becomes weights: a directory made before differs
    settings["init"] = "seeds.seed(seed, 'tiny_init')"
    path = Path(path)
    stamp = path / "nanoforge_tiny.json"  # written last, so a half-written directory is redone
    if stamp.exists() and json.loads(stamp.read_text()) == settings:
        return path
    assert head_dim >= 32, "vLLM's CPU attention rejects head_dim 16"
    from model import ModelConfig, Transformer
    with tempfile.TemporaryDirectory() as tok_dir:
        tok = Tokenizer(make_tiny_tokenizer(tok_dir))
        cfg = ModelConfig(model_type=model_type,
                          vocab_size=vocab_size or -(-tok.vocab_size // 64) * 64,  # 382: 384
                          hidden_size=hidden_size, intermediate_size=intermediate_size,
                          num_hidden_layers=num_hidden_layers,
                          num_attention_heads=num_attention_heads,
                          num_key_value_heads=num_key_value_heads,
                          head_dim=head_dim, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                          max_position_embeddings=2048, tie_word_embeddings=tie_word_embeddings,
                          attention_bias=model_type == "qwen2", qk_norm=model_type == "qwen3")
        model = Transformer(cfg)
        g = torch.Generator().manual_seed(seeds.seed(seed, "tiny_init"))
        # our own init, in name order, so the weights depend on the seed alone
        with torch.no_grad():
            for name, p in sorted(model.named_parameters()):
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith(".bias"):
                    p.zero_()
                else:
                    out_proj = name.endswith(("o_proj.weight", "down_proj.weight"))
                    p.copy_(torch.randn(p.shape, generator=g)
                            * (0.02 / (2 * num_hidden_layers) ** 0.5 if out_proj else 0.02))
        model.save_pretrained(path, tokenizer_dir=tok_dir)
    # eos/pad ids where vLLM and transformers' generate() look for them
    ids = {"bos_token_id": None, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    hf = {**json.loads((path / "config.json").read_text()), **ids}
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
    stamp.write_text(json.dumps(settings, indent=2) + "\n")
    return path
