"""Run TRL 1.16's SFT data path on the SFT test conversations and record what it trains, for
tests/test_sft_trl.py (which compares packloader with the record; CI has no TRL).

TRL is run as a user runs it: `SFTTrainer(model, args=SFTConfig(padding_free=True, assistant_only_loss=...,
completion_only_loss=...), train_dataset=...)` prepares (tokenizes, masks) the dataset, and the trainer's own
collator (`DataCollatorForLanguageModeling` with `padding_free=True`) collates all rows into one packed row. The
record holds, per case, each row's input_ids and the collated row's input_ids, position_ids and labels.

Regenerate, with TRL in an environment of its own (it reads the committed tokenizer folder tests/data/sft_tokenizer;
TRL 1.16.0 accepts the project's transformers 4.57.6, torch and datasets, so the record was made with the project's
own versions of those, seen from the TRL environment through a .pth file naming the project's site-packages):
    python3 -m venv .venv-trl
    .venv/bin/python -c "import site; print(site.getsitepackages()[0])" > \
        "$(.venv-trl/bin/python -c 'import site; print(site.getsitepackages()[0])')/project.pth"
    .venv-trl/bin/pip install trl==1.16.0
    PYTHONPATH=. .venv-trl/bin/python tests/helpers/trl_fixture.py tests/data/sft_trl_1.16.0.json
"""

from __future__ import annotations

import json
import sys
import tempfile

from tests.helpers.sft_data import CHAT_PAIRS, CONVERSATIONS, PLAIN_PAIRS, TOKENIZER_DIR

# case name -> (rows, SFTConfig flags); packloader's loss_on for each is in tests/test_sft_trl.py
CASES = {
    "messages_assistant": ([{"messages": c} for c in CONVERSATIONS], dict(assistant_only_loss=True)),
    "messages_all": ([{"messages": c} for c in CONVERSATIONS], dict(assistant_only_loss=False)),
    "plain_pairs_completion": (PLAIN_PAIRS, dict(completion_only_loss=True)),
    "chat_pairs_completion": (CHAT_PAIRS, dict(completion_only_loss=True)),
    "chat_pairs_assistant": (CHAT_PAIRS, dict(completion_only_loss=False, assistant_only_loss=True)),
}


def run_case(rows, flags, tokenizer, out_dir) -> dict:
    import datasets
    import torch
    import transformers
    from trl import SFTConfig, SFTTrainer

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    model = transformers.LlamaForCausalLM(cfg)
    args = SFTConfig(output_dir=out_dir, report_to=[], use_cpu=True, padding_free=True, max_length=None,
                     per_device_train_batch_size=len(rows), **flags)
    trainer = SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                         processing_class=tokenizer)
    prepared = list(trainer.train_dataset)
    batch = trainer.data_collator(prepared)
    return {
        "flags": flags,
        "rows": [{"input_ids": list(r["input_ids"])} for r in prepared],
        "input_ids": batch["input_ids"][0].tolist(),
        "position_ids": batch["position_ids"][0].tolist(),
        "labels": batch["labels"][0].tolist(),
    }


def main(path: str) -> None:
    import transformers
    import trl

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER_DIR), local_files_only=True)
    record = {"trl": trl.__version__, "transformers": transformers.__version__, "cases": {}}
    with tempfile.TemporaryDirectory() as out:
        for name, (rows, flags) in CASES.items():
            record["cases"][name] = run_case(rows, flags, tokenizer, out)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
