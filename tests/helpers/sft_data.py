"""SFT test data: a small transformers tokenizer folder with a ChatML chat template that marks the assistant's
text with `{% generation %}`, and conversations in every format. `tests/data/sft_tokenizer/` is this module's
`build_tokenizer` output, committed so that packloader's tests and the TRL fixture script
(`tests/helpers/trl_fixture.py`) tokenize with the very same files; rebuild it with
`python tests/helpers/sft_data.py tests/data/sft_tokenizer`."""

from __future__ import annotations

import sys
from pathlib import Path

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "data" / "sft_tokenizer"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- message['content'] + '<|im_end|>' -}}{%- endgeneration -%}{{- '\\n' -}}"
    "{%- else -%}{{- message['content'] + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog", "what is two plus two? four.", "hello there, how are you?",
    "I am fine, thank you. And you?", "Summarise the text in one sentence.", "Translate to French: good morning",
    "bonjour", "Write a haiku about the sea.", "waves fold into foam, salt wind writes on the sand, the tide keeps "
    "its time", "system: be brief and exact.", "user assistant system", "0123456789 + - * / = ?",
]

CONVERSATIONS = [
    [{"role": "user", "content": "what is two plus two?"}, {"role": "assistant", "content": "four."}],
    [{"role": "system", "content": "be brief and exact."}, {"role": "user", "content": "hello there"},
     {"role": "assistant", "content": "hello, how are you?"}, {"role": "user", "content": "fine, thank you"},
     {"role": "assistant", "content": "good."}],
    [{"role": "user", "content": "Write a haiku about the sea."},
     {"role": "assistant", "content": "waves fold into foam, salt wind writes on the sand, the tide keeps its time"}],
    [{"role": "user", "content": "Translate to French: good morning"}, {"role": "assistant", "content": "bonjour"},
     {"role": "user", "content": "and good night?"}, {"role": "assistant", "content": "bonne nuit"}],
]

PLAIN_PAIRS = [
    {"prompt": "Translate to French: good morning\n", "completion": "bonjour"},
    {"prompt": "what is two plus two? ", "completion": "four."},
    {"prompt": "Summarise the text in one sentence: the quick brown fox jumps over the lazy dog. ",
     "completion": "a fox jumps over a dog."},
]

# conversational pairs: the last assistant turn is the completion
CHAT_PAIRS = [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS]


def build_tokenizer(folder) -> None:
    """Train a byte-level BPE of about 400 ids on CORPUS (deterministic) and save it as a transformers folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))


if __name__ == "__main__":
    build_tokenizer(sys.argv[1] if len(sys.argv) > 1 else TOKENIZER_DIR)
