"""Trains the small byte-level BPE tokenizer that vllm-sim and `kvgate demo` use by default.

The corpus is the comment and docstring text of the Python standard library on the machine that
runs this script, so nothing is downloaded. Output: tokenizer/tokenizer.json and
tokenizer/tokenizer_config.json (a ChatML chat template, <|endoftext|> as EOS).
Usage: python make_tokenizer.py   (needs the `tokenizers` package)
"""
import ast, json, os, sys, sysconfig
from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders

here = os.path.dirname(os.path.abspath(__file__))
out = os.path.join(here, "tokenizer")
os.makedirs(out, exist_ok=True)

stdlib = sysconfig.get_paths()["stdlib"]
texts = []
for name in sorted(os.listdir(stdlib)):
    if not name.endswith(".py"):
        continue
    try:
        tree = ast.parse(open(os.path.join(stdlib, name), encoding="utf-8").read())
    except Exception:
        continue
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                texts.append(" ".join(doc.split()))

specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=specials, show_progress=False,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(texts, trainer)
tok.save(os.path.join(out, "tokenizer.json"))

template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
           "pad_token": "<|endoftext|>", "model_max_length": 32768, "chat_template": template},
          open(os.path.join(out, "tokenizer_config.json"), "w"), indent=1)
print("trained on", len(texts), "docstrings; vocab", tok.get_vocab_size(), file=sys.stderr)
