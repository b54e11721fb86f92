"""The real Qwen2 tokenizer in shared/ loads offline and round-trips GSM8K questions."""

import json

import transformers


def test_qwen2_tokenizer_roundtrips_gsm8k(qwen2_tokenizer_dir, gsm8k_dir):
    tok = transformers.AutoTokenizer.from_pretrained(str(qwen2_tokenizer_dir))
    assert tok("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    with open(gsm8k_dir / "test.jsonl") as f:
        rows = [json.loads(line) for line in f][:300]
    for row in rows:
        for text in (row["question"], row["answer"]):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": rows[0]["question"]}],
                                   tokenize=False, add_generation_prompt=True)
    assert chat.startswith("<|im_start|>system\n") and chat.endswith("<|im_start|>assistant\n")
