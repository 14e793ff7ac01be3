"""Regenerate the bundled demo assets in dflash_pipe/data/assets (deterministic; no network).

    python scripts/make_demo_assets.py

Writes demo.jsonl (synthetic multi-turn conversations, messages format), demo_sharegpt.jsonl and
demo_pretokenized.jsonl (small test files), and a byte-level BPE tokenizer trained on the conversations
(tokenizer.json + tokenizer_config.json, Qwen-style chat template).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parents[1] / "dflash_pipe" / "data" / "assets"
NUM_CONVERSATIONS = 3000
VOCAB_SIZE = 1536
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
WORDS = str.split(
    "apple river garden yellow pencil window orange tiger planet silver rocket castle dragon forest "
    "island marble pepper summer winter spring autumn bridge candle doctor engine flower guitar hammer "
    "jacket kitten lemon mirror number ocean pillow rabbit sugar table violin wagon zebra cloud stone"
)
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
    "Greece": "Athens", "Chile": "Santiago", "India": "New Delhi", "China": "Beijing", "Poland": "Warsaw",
}  # fmt: skip
COLORS = {"the sky": "blue", "grass": "green", "snow": "white", "a banana": "yellow", "coal": "black",
          "a tomato": "red", "an orange": "orange", "a plum": "purple"}  # fmt: skip
SYSTEMS = ["You are a helpful assistant.", "You are a patient tutor. Answer in one short sentence.",
           "You answer questions about numbers, words and facts."]  # fmt: skip


def exchange(rng: random.Random) -> tuple[str, str]:
    """One (question, answer) pair from a random template."""
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        op, val = rng.choice([("plus", a + b), ("minus", a - b), ("times", a * b if a * b < 200 else None)])
        if val is None:
            a, b = rng.randint(2, 12), rng.randint(2, 12)
            val = a * b
        q = rng.choice(["What is {} {} {}?", "Compute {} {} {}.", "How much is {} {} {}?"]).format(a, op, b)
        return q, f"{a} {op} {b} is {val}."
    if kind == 1:
        a = rng.randint(1, 30)
        b = a + rng.randint(2, 9)
        return f"Count from {a} to {b}.", ", ".join(str(i) for i in range(a, b + 1)) + "."
    if kind == 2:
        w = rng.choice(WORDS)
        return f"Spell the word {w}.", f"{w} is spelled " + " ".join(w) + "."
    if kind == 3:
        d = rng.randrange(7)
        return f"What day comes after {DAYS[d]}?", f"The day after {DAYS[d]} is {DAYS[(d + 1) % 7]}."
    if kind == 4:
        items = rng.sample(WORDS, rng.randint(3, 5))
        return "Reverse the list: " + ", ".join(items) + ".", ", ".join(reversed(items)) + "."
    if kind == 5:
        c = rng.choice(sorted(CAPITALS))
        return f"What is the capital of {c}?", f"The capital of {c} is {CAPITALS[c]}."
    thing = rng.choice(sorted(COLORS))
    return f"What color is {thing}?", f"The color of {thing} is {COLORS[thing]}."


def conversation(rng: random.Random) -> list[dict[str, str]]:
    """A multi-turn conversation; the turn count is log-uniform-ish so lengths spread over ~30-300 tokens."""
    messages = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 0.15 else []
    for _ in range(min(10, int(2 ** rng.uniform(1.0, 3.4)))):
        q, a = exchange(rng)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return messages


def train_tokenizer(convs: list[list[dict[str, str]]]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    texts = (f"{m['role']}\n{m['content']}\n" for c in convs for m in c)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows), encoding="utf-8")


def main() -> None:
    rng = random.Random(20240611)
    convs = [conversation(rng) for _ in range(NUM_CONVERSATIONS)]
    ASSETS.mkdir(parents=True, exist_ok=True)
    write_jsonl(ASSETS / "demo.jsonl", [{"messages": c} for c in convs])
    role_to_from = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [
        {"conversations": [{"from": role_to_from[m["role"]], "value": m["content"]} for m in c]}
        for c in convs[:40]
    ]
    write_jsonl(ASSETS / "demo_sharegpt.jsonl", sharegpt)

    train_tokenizer(convs).save(str(ASSETS / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "mask_token": "<|mask|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
    }
    (ASSETS / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    # pre-tokenized copy of the first conversations, rendered by the library itself
    sys.path.insert(0, str(ASSETS.parents[2]))
    from dflash_pipe.data.demo import demo_tokenizer
    from dflash_pipe.data.render import render_conversation

    tokenizer = demo_tokenizer()
    rows = []
    for c in convs[:40]:
        ids, mask = render_conversation(tokenizer, c)
        rows.append({"input_ids": ids, "loss_mask": mask.astype(int).tolist()})
    write_jsonl(ASSETS / "demo_pretokenized.jsonl", rows)
    for p in sorted(ASSETS.iterdir()):
        print(f"{p.name}: {p.stat().st_size / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
